"""Timing one forward at a fixed context: the primitive calibrate-cost and the batch costs share.

A model's KV cache is filled to the context once; each timed feed runs one forward over a few
tokens (a drafted block, a token tree, or the same tokens for B rows) and is rolled back, so every
sample sees the same context length.
"""

from __future__ import annotations

import time

import torch

from specstop.pair.compat import cache_kwarg

#: drafted lengths K calibrate-cost times by default.
K_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 20)
#: draft steps timed per round (each round also times every K once).
DRAFT_STEPS_PER_ROUND = 4
#: rounds always taken, whatever the budget.
MIN_ROUNDS = 3


def sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class CachedForward:
    """A model with a KV cache filled to the context length; times feeds and rolls them back.
    ``batch`` > 1 holds that many copies of the context and feeds every row the same tokens
    (:mod:`specstop.measure.batch_cost`: the cost of a round at batch size B)."""

    def __init__(self, model, context: list[int], batch: int = 1) -> None:
        from transformers import DynamicCache

        self.model = model
        self.batch = int(batch)
        self.device = model.get_input_embeddings().weight.device
        self.cache = DynamicCache(config=model.config)
        self.length = len(context)
        with torch.no_grad():
            model(input_ids=torch.tensor([context] * self.batch, device=self.device), **cache_kwarg(self.model, self.cache),
                  use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def time_feed(self, tokens: list[int], parents: list[int] | None = None) -> tuple[float, int]:
        """Seconds for one forward over ``tokens`` (greedy pick of the last row), then roll back.

        With ``parents`` (one per token, -1 = follows the cached context) the tokens are a token tree
        fed under the tree attention mask and tree position ids, as the tree decoder feeds them; the
        mask is built inside the timed span because the decoder pays for it too.
        """
        ids = torch.tensor([tokens] * self.batch, device=self.device)
        sync(self.device)
        t0 = time.perf_counter()
        tree = {}
        if parents is not None:
            from specstop.decode.token_tree import tree_attention_mask

            mask, pos = tree_attention_mask(parents, self.length, dtype=next(self.model.parameters()).dtype,
                                            device=self.device)
            tree = {"attention_mask": mask, "position_ids": pos,
                    "cache_position": torch.arange(self.length, self.length + len(tokens), device=self.device)}
        out = self.model(input_ids=ids, **cache_kwarg(self.model, self.cache), use_cache=True, logits_to_keep=len(tokens),
                         **tree)
        nxt = int(out.logits[0, -1].argmax())
        sync(self.device)
        dt = time.perf_counter() - t0
        self.cache.crop(self.length - self.cache.get_seq_length())  # transformers 5: negative = remove
        return dt, nxt
