"""The token tree one round drafts and verifies, and its tree attention (mask and position ids).

A tree is stored flat: node 0 is the root (the last token of the sequence so far, already chosen),
every other node is a drafted token whose ``parent`` has a smaller index, so node order is a
topological order and any prefix of it is a valid tree.

Tree attention (SpecInfer; the topology-aware causal mask of improved MCSD, section 2.2): the tree's
tokens are fed as ONE sequence after the cached prefix; each token attends to the whole prefix and
to its own ancestors (itself included) only, and its position id is ``prefix_len + depth``, so every
root-to-node path sees exactly what a plain causal forward over that path would see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["TokenTree", "ancestor_matrix", "tree_attention_mask", "tree_depths"]


@dataclass
class TokenTree:
    """A drafted token tree (node 0 = root).

    Attributes:
        tokens: token id per node (``tokens[0]`` is the root's, the last token of the sequence).
        parents: parent index per node (``-1`` for the root; always smaller than the node's index).
        scores: estimated path acceptance per node: the product of the draft probabilities (greedy) or
            of the draft's sorted top probabilities (sampling, see :mod:`specstop.decode.drafting`)
            along the path, or of a node head's estimates (:mod:`specstop.decode.node_head`); 1 at the root.
        children: child indices per node, in the order they were drafted (the verification order).
        draft_dists: the draft distribution ``[V]`` each expanded node's children were drawn from.
    """

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [1.0])
    children: list[list[int]] = field(default_factory=lambda: [[]])
    depths: list[int] = field(default_factory=lambda: [0])
    draft_dists: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def rooted_at(cls, token: int) -> TokenTree:
        return cls(tokens=[int(token)])

    def add(self, parent: int, token: int, score: float) -> int:
        """Append a child of ``parent``; returns its index."""
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.scores.append(float(score))
        self.children.append([])
        self.depths.append(self.depths[parent] + 1)
        self.children[parent].append(node)
        return node

    @property
    def num_drafted(self) -> int:
        """Drafted nodes (the root excluded): the tokens one target forward verifies."""
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth per node of a flat forest (``-1`` parents are depth 0; parents precede children)."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestor_matrix(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``BoolTensor[n, n]``: ``[i, j]`` is True iff node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def tree_attention_mask(
    parents: Sequence[int],
    prefix_len: int,
    num_new: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive 4D attention mask and position ids that feed tree nodes after a cached prefix.

    The "region" is every node fed since the prefix (possibly over several forwards): node i of the
    region sits in cache slot ``prefix_len + i``. Nodes with parent -1 hang directly off the prefix.

    Args:
        parents: parent per region node (region-relative index, or -1), parents before children.
        prefix_len: tokens in the cache before the region (every node sees all of them).
        num_new: the last ``num_new`` region nodes are the ones fed now (default: all of them); the
            earlier ones are already in the cache.
        dtype: the model's dtype (the mask is added to attention scores).

    Returns:
        ``(mask [1, 1, num_new, prefix_len + len(parents)], position_ids [1, num_new])``: mask is 0
        where attention is allowed and ``finfo(dtype).min`` elsewhere; a node's position id is
        ``prefix_len + depth``.
    """
    n = len(parents)
    num_new = n if num_new is None else num_new
    if not 0 < num_new <= n:
        raise ValueError(f"num_new={num_new} must be in 1..{n}")
    anc = ancestor_matrix(parents, device)[n - num_new :]
    visible = torch.cat([torch.ones(num_new, prefix_len, dtype=torch.bool, device=device), anc], dim=1)
    zero = torch.zeros((), dtype=dtype, device=device)
    mask = torch.where(visible, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device))
    depths = tree_depths(parents)[n - num_new :]
    pos = torch.tensor(depths, dtype=torch.long, device=device) + prefix_len
    return mask[None, None], pos[None]
