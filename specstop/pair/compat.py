"""Small bridges over differences between transformers 5.x releases.

The KV cache keyword of a model's ``forward`` was renamed from ``past_key_values`` to ``cache``
within transformers 5 (5.24 accepts both but warns on every call site with a FutureWarning that
says the old name goes in 5.40). specstop supports ``transformers>=5.0,<6``, so it asks each
model's ``forward`` which name it takes instead of pinning one.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

__all__ = ["cache_kwarg", "output_cache"]


@lru_cache(maxsize=64)
def _cache_name(forward_cls: type) -> str:
    try:
        params = inspect.signature(forward_cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins / compiled wrappers
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model, cache) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever ``model.forward`` takes."""
    return {_cache_name(type(model)): cache}


def output_cache(out):
    """The KV cache a forward returned (``out.cache`` on newer releases, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
