"""Choosing a token-tree shape against this machine's measured tree costs (``specstop tune``).

A greedy tree round accepts along the target's own greedy response X. The dataset records, for every
response position i, the rank of X_i among the draft's top candidates of q_i = q(. | x, X_<i)
(``target_rank``; -1 when X_i is not among the stored top k) and q_i's sorted top probabilities
(``topk``). A round that starts after i emitted tokens (its root is X_{i-1}) therefore accepts:

* **static shapes** (``mcsd:W1,W2,...``) - exactly: the largest n such that ``target_rank_{i+d-1} <
  W_d`` for d = 1..n. The candidates below the accepted path node at depth d - 1 are the top W_d
  tokens of q_{i+d-1}, the recorded distribution, so the replay is the decoder's round for round
  (tests/test_tree_tune.py checks it against :class:`~specstop.decode.TreeDecoder`). Nodes per round
  are the shape's nominal count (a drafted EOS would get no children; the data does not say where
  off-path EOS nodes are).
* **dynamic shapes** (``tree:N``) - approximately: best-first growth reads the draft's probabilities
  at every node, and the data has them only along X. Path nodes use their recorded ``topk``; every
  other node uses the split's mean sorted top-k profile. The accepted depth then follows from the
  ranks as above, for the nodes this growth placed. Marked ``exact: false``.

Each round is priced with the cost model's measured ``tree`` section (calibrate-cost): one target
forward over the round's N nodes (:meth:`~specstop.eval.cost.CostModel.tree_target_cost`) plus one
draft forward per fed frontier of W nodes, the catch-up feed included
(:meth:`~specstop.eval.cost.CostModel.tree_draft_cost`); target-only steps at t_target(0). Sampled
(T > 0) data is not tuned here: its acceptance depends on the draws, which a rank replay cannot give.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass

import numpy as np

from specstop.errors import UserError
from specstop.tree_policy import MAX_TREE_NODES, DynamicTreeShape, StaticTreeShape, TreeShape

log = logging.getLogger("specstop")

__all__ = [
    "TreeReplayData",
    "load_tree_replay",
    "replay_tree",
    "static_round_depth",
    "tree_candidates",
    "tree_policy_label",
    "tune_tree",
]

# Candidate shapes: per-depth widths from this set (non-increasing with depth), up to this depth and
# node count; dynamic budgets from the grid below (default width and depth, as `tree:N` parses).
STATIC_WIDTHS = (1, 2, 3, 4, 6, 8)
STATIC_MAX_DEPTH = 8
MAX_CANDIDATE_NODES = 64
DYNAMIC_BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)
TOP_CANDIDATES = 10  # how many runners-up the tuned file lists


@dataclass
class TreeReplayData:
    """One split's greedy responses as a tree replay reads them.

    Attributes:
        ranks: per prompt, ``[L]`` int64 target_rank of X_i (-1: not among the stored top k).
        topk: per prompt, ``[L, k]`` float64 sorted top draft probabilities of q_i.
        eos_end: per prompt, whether the response ends with an EOS (its last token).
        max_new_tokens: the generation's length cap (a round's depth cap is remaining - 1).
        k: stored candidates per position (ranks >= k are unknown: a wider tree is not replayed).
        profile: ``[k]`` the split's mean sorted top-k probabilities (dynamic trees' off-path nodes).
    """

    ranks: list[np.ndarray]
    topk: list[np.ndarray]
    eos_end: list[bool]
    max_new_tokens: int
    k: int
    profile: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(sum(len(r) for r in self.ranks))


def load_tree_replay(data_dir, split: str) -> TreeReplayData:
    """Read ``split`` of a specstop dataset for tree replay.

    Raises:
        UserError: sampled data, a dataset older than labels version 4 (no ``target_rank``), or an
            empty split - each in one line with the fix.
    """
    from specstop.data_gen.storage import load_arrays, read_manifest

    man = read_manifest(data_dir)
    gen = man.get("generation") or {}
    if float(gen.get("temperature") or 0.0) > 0:
        raise UserError(f"{data_dir} was generated with temperature {gen.get('temperature')}; tree shapes are tuned "
                        "on greedy data (generate with temperature 0)")
    try:
        tok = load_arrays(data_dir, "tokens", split, columns=["prompt_id", "position", "topk", "target_rank"])
    except KeyError:
        raise UserError(f"{data_dir} has no target_rank column (labels version < 4), which tree tuning replays: "
                        "regenerate it with this specstop (`specstop generate` into a new folder)") from None
    seqs = load_arrays(data_dir, "sequences", split, columns=["prompt_id", "num_tokens", "stop_reason"])
    if not len(seqs["prompt_id"]):
        raise UserError(f"{data_dir} has no {split!r} prompts to tune tree shapes on; pick another --split")
    pid = np.asarray(tok["prompt_id"]).astype(str)
    pos = np.asarray(tok["position"], dtype=np.int64)
    order = np.lexsort((pos, pid))
    pid, pos = pid[order], pos[order]
    rank = np.asarray(tok["target_rank"], dtype=np.int64)[order]
    topk = np.asarray(tok["topk"], dtype=np.float64)[order]
    starts = {p: i for i, p in reversed(list(enumerate(pid)))}
    counts = dict(zip(*np.unique(pid, return_counts=True)))
    ranks, tops, eos_end = [], [], []
    for p, n, why in zip(np.asarray(seqs["prompt_id"]).astype(str), seqs["num_tokens"], seqs["stop_reason"]):
        n = int(n)
        r = np.full(n, -1, dtype=np.int64)  # a position without a row: its token is not a candidate
        t = np.zeros((n, topk.shape[1]))
        if p in starts:
            s = starts[p]
            pp = pos[s : s + counts[p]]
            keep = pp < n
            r[pp[keep]] = rank[s : s + counts[p]][keep]
            t[pp[keep]] = topk[s : s + counts[p]][keep]
        ranks.append(r)
        tops.append(t)
        eos_end.append(str(why) == "eos")
    return TreeReplayData(ranks, tops, eos_end, int(gen.get("max_new_tokens") or max(len(r) for r in ranks)),
                          int(topk.shape[1]), topk.mean(axis=0) if len(topk) else np.zeros(topk.shape[1]))


def static_round_depth(ranks: np.ndarray, start: int, widths: tuple[int, ...], depth_cap: int) -> int:
    """Accepted depth of a static tree round starting at response position ``start`` (greedy).

    Args:
        ranks: ``[L]`` target_rank per response position.
        start: tokens emitted before the round (its root is X_{start-1}).
        widths: the shape's per-depth widths W_1, W_2, ...
        depth_cap: the round's depth cap (<= len(widths)).
    """
    n = 0
    while n < depth_cap and start + n < len(ranks) and 0 <= ranks[start + n] < widths[n]:
        n += 1
    return n


def _static_levels(widths: tuple[int, ...], depth: int) -> list[int]:
    """Nodes per level 1..depth of a static shape."""
    out, level = [], 1
    for w in widths[:depth]:
        level *= w
        out.append(level)
    return out


def _dynamic_round(shape: DynamicTreeShape, ranks, topk, profile, start: int, depth_cap: int, k: int):
    """One best-first round, as :func:`specstop.decode.drafting.grow_tree` grows it (see the module
    docstring): ``(accepted depth, nodes placed, fed widths, whether the accepted leaf was fed)``.

    The on-path node at depth d is X_{start+d-1} (depth 0 = the root); it exists only while every
    path token so far was placed as a candidate.
    """
    budget = shape.budget
    heap: list = []  # (-score of the next candidate, tie, node id, candidate index)
    score: list[float] = [1.0]
    depth: list[int] = [0]
    path_depth: list[int] = [0]  # depth along the target's path, -1 for off-path nodes
    cand: dict[int, np.ndarray] = {}
    tie = itertools.count()

    def open_node(v: int) -> None:
        n_cand = min(budget, shape.width)  # the remaining budget, as the decoder's growth reads it
        pd = path_depth[v]
        probs = topk[start + pd] if pd >= 0 and start + pd < len(topk) else profile
        f = np.zeros(n_cand)
        f[: min(n_cand, k)] = probs[: min(n_cand, k)]  # ranks beyond the stored k: never accepted here
        cand[v] = f
        if n_cand:
            heapq.heappush(heap, (-score[v] * f[0], next(tie), v, 0))

    open_node(0)
    fed_widths: list[int] = []
    path_end, fed_path = 0, {0}
    while budget > 0 and heap:
        added = []
        while heap and len(added) < min(shape.width, budget):
            neg, _, v, i = heapq.heappop(heap)
            pd = path_depth[v]
            on = pd >= 0 and start + pd < len(ranks) and ranks[start + pd] == i
            u = len(score)
            score.append(-neg)
            depth.append(depth[v] + 1)
            path_depth.append(pd + 1 if on else -1)
            if on:
                path_end = max(path_end, pd + 1)
            added.append(u)
            if i + 1 < len(cand[v]):
                heapq.heappush(heap, (-score[v] * cand[v][i + 1], next(tie), v, i + 1))
        budget -= len(added)
        fed = [u for u in added if depth[u] < depth_cap] if budget > 0 else []
        if not fed:
            continue
        fed_widths.append(len(fed))
        for u in fed:
            if path_depth[u] >= 0:
                fed_path.add(path_depth[u])
            open_node(u)
    n = min(path_end, depth_cap)
    return n, len(score) - 1, fed_widths, n in fed_path


def replay_tree(data: TreeReplayData, shape: TreeShape, cost, *, trace: list | None = None) -> dict:
    """Replay ``shape`` over every prompt and price its rounds with ``cost``'s tree section.

    Args:
        data: the split (:func:`load_tree_replay`).
        shape: a static or dynamic tree shape.
        cost: a :class:`~specstop.eval.cost.CostModel` (its ``tree`` section prices tree forwards).
        trace: if given, one ``{"nodes": [...], "accepted": [...], "draft_widths": [...]}`` per prompt
            is appended (per round: tree nodes, accepted depth; every draft forward's width).

    Returns:
        ``{"latency_per_token", "speedup", "tokens_per_round", "accepted_per_round", "nodes_per_round",
        "rounds", "n", "exact", "method"}`` (speedup over plain target decoding, t_target(0) per token).
    """
    static = isinstance(shape, StaticTreeShape)
    if static and max(shape.branching) > data.k:
        raise UserError(f"{shape.label} is wider than the {data.k} candidates the dataset stores per position; "
                        f"regenerate with --feature-topk {max(shape.branching)} or use narrower shapes")
    seconds = tokens = rounds = accepted = nodes_total = 0.0
    for ranks, topk, eos_end in zip(data.ranks, data.topk, data.eos_end):
        length = len(ranks)
        i, pending = 0, 1  # prefill leaves the last prompt token for the first round's catch-up feed
        rec: dict = {"nodes": [], "accepted": [], "draft_widths": []}
        while i < length:
            depth_cap = min(shape.max_depth, data.max_new_tokens - i - 1)
            rounds += 1
            if depth_cap <= 0:
                seconds += cost.target_cost(0)
                rec["nodes"].append(0)
                rec["accepted"].append(0)
                i += 1
                pending += 1
                continue
            if static:
                n = static_round_depth(ranks, i, shape.branching, depth_cap)
                levels = _static_levels(shape.branching, depth_cap)
                n_nodes, fed = sum(levels), levels[:-1]
                leaf_fed = n < depth_cap  # levels above the depth cap are fed (expanded)
            else:
                n, n_nodes, fed, leaf_fed = _dynamic_round(shape, ranks, topk, data.profile, i, depth_cap, data.k)
            seconds += cost.tree_target_cost(n_nodes) + cost.tree_draft_cost(pending)
            seconds += sum(cost.tree_draft_cost(w) for w in fed)
            rec["nodes"].append(n_nodes)
            rec["accepted"].append(n)
            rec["draft_widths"] += [pending] + list(fed)
            eos_hit = eos_end and i + n >= length  # the accepted path ends with the response's EOS
            emitted = n if eos_hit else min(n + 1, length - i)
            # Next catch-up feed: the final token, plus the accepted leaf when it was never fed.
            pending = 1 + (0 if n == 0 or leaf_fed else 1)
            accepted += n
            nodes_total += n_nodes
            i += emitted
        tokens += length
        if trace is not None:
            trace.append(rec)
    latency = seconds / max(tokens, 1)
    return {
        "latency_per_token": latency,
        "speedup": cost.target_only_per_token / latency if latency > 0 else 0.0,
        "tokens_per_round": tokens / max(rounds, 1),
        "accepted_per_round": accepted / max(rounds, 1),
        "nodes_per_round": nodes_total / max(rounds, 1),
        "rounds": int(rounds),
        "n": int(tokens),
        "exact": static,
        "method": ("exact greedy replay of the recorded target ranks" if static else
                   "approximate: recorded draft probabilities on the target's path, the split's mean top-k "
                   "profile elsewhere"),
    }


def tree_candidates(k: int, *, max_nodes: int = MAX_CANDIDATE_NODES, max_depth: int = STATIC_MAX_DEPTH,
                    budgets=DYNAMIC_BUDGETS) -> list[TreeShape]:
    """Static k-configs (per-depth widths from :data:`STATIC_WIDTHS` up to ``k``, non-increasing with
    depth, at most ``max_nodes`` nodes) and dynamic budgets ``tree:N`` (default width and depth)."""
    widths = [w for w in STATIC_WIDTHS if w <= k]
    out: list[TreeShape] = []

    def extend(prefix: tuple[int, ...], nodes: int, level: int) -> None:
        if prefix:
            out.append(StaticTreeShape(prefix))
        if len(prefix) == max_depth:
            return
        for w in widths:
            if prefix and w > prefix[-1]:
                break
            if nodes + level * w <= max_nodes:
                extend(prefix + (w,), nodes + level * w, level * w)

    extend((), 0, 1)
    out += [DynamicTreeShape.with_defaults(n) for n in budgets if n <= min(max_nodes, MAX_TREE_NODES)]
    return out


def tune_tree(data_dir, split: str, cost) -> dict:
    """The fastest tree shape on ``split`` under ``cost`` (which must carry a measured ``tree`` section).

    Returns:
        The tuned-file entry ``{"spec": {"kind": "tree", "policy": "mcsd:..."|"tree:N,W,D"}, "validation":
        {...replay_tree's metrics, "candidates": [runners-up]}}``.
    """
    if not getattr(cost, "tree", None):
        raise UserError("the cost model has no measured 'tree' section; run `specstop calibrate-cost` (without "
                        "--no-tree) to tune tree shapes")
    data = load_tree_replay(data_dir, split)
    results = []
    for shape in tree_candidates(data.k):
        results.append((replay_tree(data, shape, cost), shape))
    results.sort(key=lambda r: r[0]["latency_per_token"])
    best, shape = results[0]
    log.info("tree shapes: %d tried on %d tokens; fastest %s (%.3fx predicted, %.2f tokens per round)",
             len(results), data.num_tokens, shape.label, best["speedup"], best["tokens_per_round"])
    validation = dict(best)
    validation["candidates"] = [
        {"policy": s.label, "speedup": r["speedup"], "latency_per_token": r["latency_per_token"],
         "tokens_per_round": r["tokens_per_round"], "nodes_per_round": r["nodes_per_round"], "exact": r["exact"]}
        for r, s in results[:TOP_CANDIDATES]
    ]
    return {"spec": {"kind": "tree", "policy": shape.label}, "validation": validation}


def tree_policy_label(entry: dict) -> str:
    """The decode policy text of a tuned tree entry (``mcsd:...`` / ``tree:N,W,D``)."""
    return str((entry.get("spec") or {}).get("policy"))

