"""The one rule by which a KV cache is cut back before a feed (multi-level decoding, its record and replay)."""

from __future__ import annotations

__all__ = ["cached_prefix"]


def cached_prefix(cached: list[int], seq: list[int], keep: int) -> int:
    """How many leading tokens of ``seq`` a cache holding ``cached`` keeps before feeding the rest: their
    longest shared prefix, leaving at least ``keep`` tokens of ``seq`` to feed (their logits are wanted).
    The decoder's levels, the multi-level recorder and its replay all cut caches by this rule."""
    shared, limit = 0, min(len(cached), len(seq) - keep)
    while shared < limit and cached[shared] == seq[shared]:
        shared += 1
    return shared
