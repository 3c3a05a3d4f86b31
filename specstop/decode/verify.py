"""Verifying a token tree against the target's distributions at every node (one target forward).

Greedy: from the root, follow the child whose token equals the target's argmax at the current node;
stop where no child matches and emit the target's argmax there. The result is exactly the target's
greedy continuation.

Sampling: the multi-candidate rule of MCSD (Yang et al. 2024, "Multi-Candidate Speculative Decoding",
its verification for candidates sampled WITHOUT replacement; improved MCSD keeps it), which is
SpecInfer's recursive rejection sampling with the draft distribution updated after each drawn
candidate. At node v with target distribution p and draft distribution q (children x_1, x_2, ...
drawn from q in that order without replacement):

    for i = 1, 2, ...:  q_i = norm(q with x_1 .. x_{i-1} set to 0)
                        accept x_i with probability min(1, p(x_i) / q_i(x_i)) -> descend into x_i
                        otherwise p <- norm(max(p - q_i, 0))
    no child accepted:  emit a sample from p (the last residual; p itself at a leaf)

Each step is ordinary speculative sampling of a draw from q_i against p, so the emitted token is
distributed exactly as the target's p at v (by induction over the siblings); an accepted child
continues the walk at its own node. Emitting EOS ends the walk.
"""

from __future__ import annotations

import torch

from specstop.decode.token_tree import TokenTree
from specstop.probs import accept_probability, residual_distribution

__all__ = ["greedy_walk", "sampling_walk"]


def greedy_walk(
    tree: TokenTree, target_argmax: list[int], eos: set[int], *, start: int = 0
) -> tuple[list[int], int | None]:
    """The longest root-to-node path matching the target's argmax.

    Args:
        tree: the verified tree.
        target_argmax: the target's argmax token at every node (node order, root first).
        eos: EOS ids (an accepted EOS ends the response).
        start: the node to walk down from (default the root; target-initialized rounds walk below
            each of their first-level candidates).

    Returns:
        ``(path, final)``: accepted node indices (``start`` excluded) and the target's token after
        them, or None when the path ends with an accepted EOS.
    """
    v, path = start, []
    while True:
        want = target_argmax[v]
        child = next((c for c in tree.children[v] if tree.tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        v = child
        if tree.tokens[v] in eos:
            return path, None


def sampling_walk(
    tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator, eos: set[int], *, start: int = 0,
    sample_final: bool = True,
):
    """The lossless multi-candidate walk (see the module docstring).

    Args:
        tree: the verified tree; ``tree.draft_dists[v]`` is the q every child of v was drawn from.
        target_probs: ``[num_nodes, V]`` the target's distribution at every node (root first).
        gen: the generator for the acceptance uniforms and the final sample.
        eos: EOS ids.
        start: the node to walk down from (default the root).
        sample_final: False returns the final distribution ``[V]`` (the last residual p) instead of a
            sample from it (target-initialized rounds draw several tokens from it).

    Returns:
        ``(path, final)`` as :func:`greedy_walk` (``final`` a ``[V]`` tensor without ``sample_final``).
    """
    v, path = start, []
    while True:
        p = target_probs[v].float()
        accepted = None
        if tree.children[v]:
            q = tree.draft_dists[v].to(p.device).float()
            drawn = torch.zeros_like(q, dtype=torch.bool)
            for c in tree.children[v]:
                x = tree.tokens[c]
                q_i = torch.where(drawn, torch.zeros_like(q), q)
                q_i = q_i / q_i.sum()
                acc = accept_probability(p, q_i, torch.tensor(x, device=p.device))
                r = torch.rand((), generator=gen, device=gen.device)
                if float(r) < float(acc):
                    accepted = c
                    break
                p = residual_distribution(p, q_i)
                drawn[x] = True
        if accepted is None:
            if not sample_final:
                return path, p
            return path, int(torch.multinomial(p.to(gen.device), 1, generator=gen))
        path.append(accepted)
        v = accepted
        if tree.tokens[v] in eos:
            return path, None
