"""Deterministic train/validation/test splits by prompt.

Schemes:

* ``random``: a seeded permutation of the (deduplicated) prompts cut into ``sizes`` (DISCO:
  500/80/80). ``-1`` means "all the rest". When the set is too small the sizes shrink
  proportionally, with a warning.
* ``mbpp``: MBPP's own split by ``task_id`` (601-974 train, 511-600 validation, 11-510 test;
  1-10 are the few-shot examples and are excluded); ``sizes`` then subsample each split
  (DISCO: the whole train split, 80 validation, 80 test).
* ``all:<split>``: every prompt in one split (e.g. ``all:test`` for HumanEval); ``sizes`` may
  subsample it.

Every scheme works on unique prompts, so no prompt text can land in two splits.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from specstop.errors import UserError
from specstop.names import check_plain_name

log = logging.getLogger(__name__)

DISCO_SIZES: dict[str, int] = {"train": 500, "validation": 80, "test": 80}
#: MBPP's official split by task_id (inclusive ranges).
MBPP_RANGES: dict[str, tuple[int, int]] = {"train": (601, 974), "validation": (511, 600), "test": (11, 510)}
SPLIT_ORDER = ("train", "validation", "test")


def dedupe(texts: Sequence[str]) -> list[int]:
    """Indices of the first occurrence of each distinct text, in input order."""
    seen: set[str] = set()
    keep = []
    for i, t in enumerate(texts):
        if t not in seen:
            seen.add(t)
            keep.append(i)
    return keep


def _scale(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Resolve ``-1`` and shrink fixed sizes proportionally (largest remainder) to fit ``n``."""
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
        raise UserError(f"split sizes {sizes}: only one split may be -1 (the rest)")
    bad = {k: v for k, v in sizes.items() if v < -1}
    if bad:
        raise UserError(f"split sizes must be >= 0 or -1 (the rest), got {bad}")
    fixed = {k: v for k, v in sizes.items() if v != -1}
    total = sum(fixed.values())
    if total > n:
        log.warning("only %d unique prompts for split sizes %s; shrinking them proportionally", n, sizes)
        exact = {k: v * n / total for k, v in fixed.items()}
        out = {k: int(x) for k, x in exact.items()}
        # Hand the leftover prompts to the splits with the largest fractional parts.
        for k in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[: n - sum(out.values())]:
            out[k] += 1
        fixed = out
    resolved = dict(fixed)
    if rest:
        resolved[rest[0]] = n - sum(fixed.values())
    # Keep the caller's split order.
    return {k: resolved[k] for k in sizes}


def _subsample(indices: list[int], size: int | None, rng: random.Random, split: str) -> list[int]:
    if size is None or size == -1 or size >= len(indices):
        if size not in (None, -1) and size > len(indices):
            log.warning("split %r has only %d prompts, fewer than the %d asked for; using all", split, len(indices), size)
        return list(indices)
    picked = rng.sample(indices, size)
    return sorted(picked)


def assign_splits(
    n: int,
    scheme: str = "random",
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    ids: Sequence | None = None,
) -> dict[str, list[int]]:
    """Assign prompt indices ``0..n-1`` (already deduplicated) to splits.

    Args:
        n: number of unique prompts.
        scheme: ``random``, ``mbpp`` or ``all:<split>``.
        sizes: prompts per split; ``-1`` = all the rest (random) / the whole split (mbpp, all:).
            Defaults: DISCO's 500/80/80 for ``random``; whole splits otherwise.
        seed: seeds the permutation and subsampling.
        ids: per-prompt ids; ``mbpp`` needs MBPP's integer ``task_id`` here.

    Returns:
        ``{split: sorted prompt indices}``; prompts outside every split are left out.
    """
    rng = random.Random(seed)
    # Split names become shard folder names: a path separator or '..' would write outside the dataset folder (--data).
    for name in sizes or {}:
        check_plain_name(name, "split name (in split_sizes)")
    if scheme == "random":
        resolved = _scale(dict(sizes or DISCO_SIZES), n)
        perm = list(range(n))
        rng.shuffle(perm)
        out, start = {}, 0
        for split, k in resolved.items():
            out[split] = sorted(perm[start : start + k])
            start += k
        return out
    if scheme == "mbpp":
        if ids is None or len(ids) != n:
            raise UserError("split scheme 'mbpp' needs each prompt's MBPP task_id (set id_field: task_id)")
        by_split: dict[str, list[int]] = {s: [] for s in MBPP_RANGES}
        for i, tid in enumerate(ids):
            try:
                tid = int(tid)
            except (TypeError, ValueError):
                raise UserError(
                    f"split scheme 'mbpp' needs integer task ids, got {tid!r}; is this MBPP with id_field task_id?"
                ) from None
            for split, (lo, hi) in MBPP_RANGES.items():
                if lo <= tid <= hi:
                    by_split[split].append(i)
        sizes = sizes or {}
        unknown = set(sizes) - set(MBPP_RANGES)
        if unknown:
            raise UserError(f"split scheme 'mbpp' has splits {list(MBPP_RANGES)}, not {sorted(unknown)}")
        return {s: _subsample(idx, sizes.get(s), rng, s) for s, idx in by_split.items()}
    if scheme.startswith("all:"):
        split = scheme[4:]
        if not split:
            raise UserError("split scheme 'all:' needs a split name, e.g. 'all:test'")
        check_plain_name(split, "split name (in split scheme)")
        sizes = sizes or {}
        if set(sizes) - {split}:
            raise UserError(f"split scheme {scheme!r} puts everything in {split!r}; sizes {sizes} name other splits")
        return {split: _subsample(list(range(n)), sizes.get(split), rng, split)}
    raise UserError(f"unknown split scheme {scheme!r}: use 'random', 'mbpp' or 'all:<split>' (e.g. 'all:test')")
