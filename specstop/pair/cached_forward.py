"""One forward at a fixed context, timed and rolled back: the primitive every timing shares.

A model's KV cache is filled to the context once; each timed feed runs one forward over a few
tokens (a drafted block, a token tree, or the same tokens for B rows) and is rolled back, so every
sample sees the same context length. ``dtype: auto`` (:mod:`specstop.pair.dtype_timing`) and
``calibrate-cost`` (:mod:`specstop.measure`) time with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specstop import clock
from specstop.pair.compat import cache_kwarg
from specstop.pair.static_cache import CACHE_BUCKETS, compiled_forward, rewind, static_cache_length

__all__ = ["CachedForward", "sync"]


def sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class CachedForward:
    """A model with a KV cache filled to the context length; times feeds and rolls them back.
    ``batch`` > 1 holds that many copies of the context and feeds every row the same tokens
    (:mod:`specstop.measure.batch_cost`: the cost of a round at batch size B). ``compiled``: the feeds
    run as a decoder with ``compile_draft`` runs its draft, ``torch.compile`` over a ``StaticCache``
    (the first feed of each length compiles; time it as a warm-up)."""

    def __init__(self, model, context: list[int], batch: int = 1, compiled: bool = False) -> None:
        self.model = model
        self.batch = int(batch)
        self.device = model.get_input_embeddings().weight.device
        self.length = len(context)
        self.static = bool(compiled)
        self.forward = model
        if self.static:
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=static_cache_length(self.length + 64, 1 << 20))
            self.forward = compiled_forward(model, 2 * CACHE_BUCKETS + 2)
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([context] * self.batch, device=self.device), **cache_kwarg(self.model, self.cache),
                  use_cache=True, logits_to_keep=1, **self._positions(0, self.length))

    def _positions(self, start: int, n: int) -> dict:
        """Explicit positions for a static cache (it does not know its logical length after a rollback)."""
        if not self.static:
            return {}
        pos = torch.arange(start, start + n, device=self.device)
        return {"cache_position": pos, "position_ids": pos.unsqueeze(0).expand(self.batch, -1)}

    @torch.no_grad()
    def time_feed(self, tokens: list[int], inputs: Callable[[], dict] | None = None) -> tuple[float, int]:
        """Seconds for one forward over ``tokens`` (greedy pick of the last row), then roll back.

        Args:
            tokens: the fed tokens (every row gets the same ones).
            inputs: builds extra forward arguments (a token tree's attention mask and positions); it
                runs inside the timed span because a decoder pays for building them too.
        """
        ids = torch.tensor([tokens] * self.batch, device=self.device)
        sync(self.device)
        t0 = clock.now()
        extra = inputs() if inputs is not None else self._positions(self.length, len(tokens))
        out = self.forward(input_ids=ids, **cache_kwarg(self.model, self.cache), use_cache=True,
                           logits_to_keep=len(tokens), **extra)
        nxt = int(out.logits[0, -1].argmax())
        sync(self.device)
        dt = clock.now() - t0
        if self.static:
            rewind(self.cache, self.length)
        else:
            self.cache.crop(self.length - self.cache.get_seq_length())  # transformers 5: negative = remove
        return dt, nxt
