"""What calibrate-cost times, and how a token tree is fed to the shared timing primitive
(:class:`specstop.pair.cached_forward.CachedForward`)."""

from __future__ import annotations

import torch

from specstop.pair.cached_forward import CachedForward

#: drafted lengths K calibrate-cost times by default.
K_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 20)
#: draft steps timed per round (each round also times every K once).
DRAFT_STEPS_PER_ROUND = 4
#: rounds always taken, whatever the budget.
MIN_ROUNDS = 3


def tree_inputs(fwd: CachedForward, parents: list[int]):
    """The forward arguments of a token tree of ``parents`` (one per node, -1 = follows the cached
    context) fed after ``fwd``'s context, as the tree decoder feeds it: the tree attention mask, tree
    position ids and cache positions. Returns a callable for :meth:`CachedForward.time_feed`."""
    from specstop.decode.token_tree import tree_attention_mask

    def build() -> dict:
        mask, pos = tree_attention_mask(parents, fwd.length, dtype=next(fwd.model.parameters()).dtype,
                                        device=fwd.device)
        return {"attention_mask": mask, "position_ids": pos,
                "cache_position": torch.arange(fwd.length, fwd.length + len(parents), device=fwd.device)}

    return build
