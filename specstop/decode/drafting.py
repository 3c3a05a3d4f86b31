"""Growing one round's token tree with the draft model (static k-config or best-first budget).

Candidates. Each expanded node v has a draft distribution q_v (one row of a draft forward) and an
ordered list of candidate children: greedy decoding takes q_v's top tokens in order; sampling takes
a sequential sample *without replacement* from q_v (an exponential race: keys E_x / q_v(x) with
E_x ~ Exp(1), sorted ascending, give exactly the order of successive draws without replacement).
Child i of v gets the estimated path acceptance ``score(v) * s_i``, where s_i is q_v's i-th largest
probability. Under greedy s_i is the child's own draft probability, so the score is EAGLE-2's joint
draft probability along the path. Under sampling the score never reads the drawn token itself:
whether a candidate enters the tree is decided before it is drawn, which the lossless multi-candidate
rule requires (a candidate kept *because* of its value would no longer be a draw from q_v).

A node scorer (the learned node head, :mod:`specstop.decode.node_head`) may replace the factor
s_i by its own estimate that the target accepts candidate i given that it accepts v's path; the
child's score is then ``score(v)`` times that estimate. It reads only what the draft has before
the candidate is drawn (q_v, the rank i, the joint draft probability of v's path, the depth), so
it decides WHICH nodes are drafted and nothing else: acceptance stays exact. Its estimates are made
non-increasing over the candidate order (a running minimum), so best-first growth still adds
each node's children as a prefix of its candidate order. Static shapes ignore the scorer.

Which nodes enter the tree is final once decided (nothing drafted is pruned afterwards), and each
node's children are always a prefix of its candidate order - again what the verification needs.
All nodes expanded in one step are fed to the draft in ONE forward (tree attention); nodes that can
get no children (EOS, depth cap, budget spent) are never fed, like the chain's last drafted token.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import torch

from specstop.decode.token_tree import TokenTree
from specstop.tree_policy import DynamicTreeShape, StaticTreeShape, TreeShape

__all__ = ["NodeScorer", "candidate_order", "grow_below", "grow_tree"]

# expand(tree, nodes) -> [len(nodes), V] draft distributions of the fed nodes (one draft forward).
Expand = Callable[[TokenTree, list[int]], torch.Tensor]
# scorer(q_v [V], n, log joint draft probability of v's path, depth of the children) -> n estimates
# of P(candidate i accepted | v's path accepted), i = 0..n-1. ``scorer.max_candidates`` caps n.
NodeScorer = Callable[[torch.Tensor, int, float, int], list[float]]


def candidate_order(
    q: torch.Tensor, k: int, greedy: bool, gen: torch.Generator | None
) -> tuple[list[int], list[float]]:
    """The first ``k`` candidate children drawn from q and their score factors.

    Args:
        q: ``[V]`` the draft distribution at the node (after the decoding transform).
        k: candidates wanted (fewer come back when q has fewer nonzero tokens under sampling).
        greedy: top tokens in order (True) or a sample without replacement (False).
        gen: the sampling generator (sampling only).

    Returns:
        ``(tokens, factors)``: candidate token ids in verification order and q's sorted top
        probabilities (the factors each candidate's path score is multiplied by).
    """
    k = min(k, q.shape[-1])
    if greedy:
        vals, idx = q.topk(k)
        return idx.tolist(), vals.tolist()
    k = min(k, int((q > 0).sum()))
    e = torch.empty(q.shape, dtype=torch.float32, device=gen.device).exponential_(generator=gen).to(q.device)
    keys = torch.where(q > 0, e / q.float().clamp_min(1e-38), torch.full_like(e, float("inf")))
    order = torch.topk(keys, k, largest=False).indices
    return order.tolist(), q.topk(k).values.tolist()


def grow_tree(
    shape: TreeShape,
    root_token: int,
    root_dist: torch.Tensor,
    expand: Expand,
    *,
    depth_cap: int,
    eos: set[int],
    greedy: bool,
    gen: torch.Generator | None = None,
    scorer: NodeScorer | None = None,
) -> tuple[TokenTree, int]:
    """Draft one round's tree.

    Args:
        shape: the static or dynamic shape.
        root_token: the last token of the sequence (node 0).
        root_dist: ``[V]`` the draft distribution after it.
        expand: feeds nodes to the draft in one forward and returns their distributions ``[n, V]``.
        depth_cap: no node deeper than this (the round's remaining-tokens cap, >= 1).
        eos: EOS ids (an EOS node gets no children).
        greedy / gen: how candidates are picked (see :func:`candidate_order`).
        scorer: estimates each candidate's acceptance for dynamic shapes (None: its draft
            probability factor, EAGLE-2's joint probability).

    Returns:
        ``(tree, draft_forwards)``: the tree (``draft_dists`` holds q for every expanded node) and
        the number of draft forwards spent on tree nodes (the forward giving ``root_dist`` excluded).
    """
    tree = TokenTree.rooted_at(root_token)
    tree.draft_dists[0] = root_dist
    if isinstance(shape, StaticTreeShape):
        return _grow_static(shape, tree, expand, depth_cap, eos, greedy, gen)
    if isinstance(shape, DynamicTreeShape):
        return _grow_dynamic(shape, tree, expand, depth_cap, eos, greedy, gen, scorer)
    raise TypeError(f"unknown tree shape {shape!r}")


def grow_below(
    shape: StaticTreeShape, tree: TokenTree, frontier: list[int], expand: Expand, *, depth_cap: int, eos: set[int],
    greedy: bool, gen: torch.Generator | None = None,
) -> int:
    """Grow a static k-config below each node of ``frontier`` (target-initialized rounds: the
    first-level nodes are the target's own samples, already fed to the draft).

    Args:
        shape: ``branching[d]`` children per node d levels below the frontier.
        tree: the tree; every frontier node has its ``draft_dists`` entry.
        frontier: the nodes to grow below. depth_cap: levels below them (<= the shape's depth).
        expand / eos / greedy / gen: as for :func:`grow_tree`.

    Returns:
        Draft forwards spent (the forward that gave the frontier's distributions excluded).
    """
    if depth_cap <= 0 or not frontier:
        return 0
    return _grow_static(shape, tree, expand, depth_cap, eos, greedy, gen, frontier)[1]


def _grow_static(shape, tree, expand, depth_cap, eos, greedy, gen, frontier=None):
    """Static levels below ``frontier`` (default the root), whose ``draft_dists`` are already set."""
    frontier, forwards = list(frontier or [0]), 0
    depth = min(depth_cap, shape.max_depth)
    for level in range(depth):
        new = []
        for v in frontier:
            tokens, factors = candidate_order(tree.draft_dists[v], shape.branching[level], greedy, gen)
            new += [tree.add(v, t, tree.scores[v] * f) for t, f in zip(tokens, factors)]
        frontier = [u for u in new if tree.tokens[u] not in eos]
        if level + 1 == depth or not frontier:
            break
        for u, q in zip(frontier, expand(tree, frontier)):
            tree.draft_dists[u] = q
        forwards += 1
    return tree, forwards


def _grow_dynamic(shape, tree, expand, depth_cap, eos, greedy, gen, scorer=None):
    budget = shape.budget
    order: dict[int, tuple[list[int], list[float]]] = {}
    gains: dict[int, list[float]] = {}  # per candidate of v: the factor its path score is multiplied by
    joint = {0: 1.0}  # joint draft probability of each node's path (what a scorer reads)
    heap: list[tuple[float, int, int]] = []  # (-score of v's next candidate, v, candidate index)

    def open_node(v: int) -> None:
        k = min(budget, shape.width)
        if scorer is not None:
            k = min(k, scorer.max_candidates)
        order[v] = candidate_order(tree.draft_dists[v], k, greedy, gen)
        tokens, factors = order[v]
        gains[v] = factors
        if scorer is not None and tokens:
            est = scorer(tree.draft_dists[v], len(tokens), math.log(max(joint[v], 1e-30)), tree.depths[v] + 1)
            gains[v] = [min(est[: i + 1]) for i in range(len(est))]  # non-increasing: children stay a prefix
        if tokens:
            heapq.heappush(heap, (-tree.scores[v] * gains[v][0], v, 0))

    open_node(0)
    forwards = 0
    while budget > 0 and heap:
        added = []
        while heap and len(added) < min(shape.width, budget):
            neg, v, i = heapq.heappop(heap)
            tokens, factors = order[v]
            u = tree.add(v, tokens[i], -neg)
            joint[u] = joint[v] * factors[i]
            added.append(u)
            if i + 1 < len(tokens):
                heapq.heappush(heap, (-tree.scores[v] * gains[v][i + 1], v, i + 1))
        budget -= len(added)
        fed = [u for u in added if tree.depths[u] < depth_cap and tree.tokens[u] not in eos] if budget > 0 else []
        if not fed:
            continue
        for u, q in zip(fed, expand(tree, fed)):
            tree.draft_dists[u] = q
            open_node(u)
        forwards += 1
    return tree, forwards
