"""Batch-aware costs: t_draft(B) and t_target(B, K) on this machine (``calibrate-cost --batch-grid``).

At batch size B a round of speculative decoding is one draft forward over B rows per drafted step and
one target forward over B rows of K + 1 tokens. Neither costs B times the batch-1 figure: weights are
read once per forward, so on memory-bound hardware a larger batch is nearly free at first and
verification stops being so once the B x (K + 1) rows make the forward compute-bound. Both are
measured the way :func:`specstop.measure.calibrate.time_pair` measures batch 1, with its cached-model
helper (every row holds the same context of ``context_tokens`` tokens; each forward is rolled back):

* warm-up per B: one draft step and target passes at the smallest, K = 1 and the largest K;
* then rounds until ``budget_s`` (at least :data:`~specstop.measure.calibrate.MIN_ROUNDS`): in each,
  every (B, K) target pass and every B's draft steps once, in a shuffled order, so drift and other
  load spread over the whole grid alike;
* the medians are the costs, the interquartile ranges are kept beside them.

The result is the cost model's ``batch`` section (JSON, string keys)::

    {"batch_sizes": [1, 2, 4, 8], "k_grid": [0, 1, ...], "t_draft": {"B": s},
     "t_target": {"B": {"K": s}}, "iqr": {"t_draft": {"B": [q1, q3]}, "t_target": {"B": {"K": [q1, q3]}}},
     "context_tokens": n, "rounds": r, "seconds": s, "method": "..."}
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np

from specstop.errors import UserError
from specstop.measure.step_timing import DRAFT_STEPS_PER_ROUND, K_GRID, MIN_ROUNDS
from specstop.pair.cached_forward import CachedForward

log = logging.getLogger("specstop")

BATCH_GRID = (1, 2, 4, 8)


def parse_batch_grid(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``; a one-line :class:`UserError` for anything else."""
    try:
        sizes = tuple(sorted({int(v) for v in str(text).split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--batch-grid takes comma-separated batch sizes, e.g. 1,2,4,8; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-grid needs batch sizes >= 1, e.g. 1,2,4,8; got {text!r}")
    return sizes


def time_batch(pair, context: list[int], *, context_tokens: int, batch_sizes=BATCH_GRID, k_grid=K_GRID,
               budget_s: float = 60.0, progress: bool = True, seed: int = 0) -> dict:
    """Measure t_draft(B) and t_target(B, K) over the grid (see the module docstring).

    Args:
        pair: the loaded pair, in the dtype and on the device decoding uses.
        context: token ids: the first ``context_tokens`` fill every row's cache, the next ``max(K) + 1``
            are the fed block.
        batch_sizes: B values. k_grid: drafted lengths K (a target pass verifies K + 1 tokens).
        budget_s: seconds of measuring after the warm-up.

    Returns:
        The ``batch`` section of the cost model (module docstring).
    """
    batch_sizes = sorted({int(b) for b in batch_sizes})
    k_grid = sorted({int(k) for k in k_grid})
    n_block = max(k_grid[-1] + 1, DRAFT_STEPS_PER_ROUND)
    block = context[context_tokens : context_tokens + n_block]
    if len(block) < n_block:
        raise UserError(f"context too short for the batch timing: need {context_tokens + n_block} tokens, "
                        f"have {len(context)}; lower --context-tokens or --k-grid")
    ctx = context[:context_tokens]
    draft = {b: CachedForward(pair.draft, ctx, batch=b) for b in batch_sizes}
    target = {b: CachedForward(pair.target, ctx, batch=b) for b in batch_sizes}
    for b in batch_sizes:  # warm-up: allocator and kernel choice per shape
        draft[b].time_feed(block[:1])
        for k in sorted({k_grid[0], min(1, k_grid[-1]), k_grid[-1]}):
            target[b].time_feed(block[: k + 1])
    jobs = [("draft", b, None) for b in batch_sizes] + [("target", b, k) for b in batch_sizes for k in k_grid]
    draft_s = {b: [] for b in batch_sizes}
    target_s = {b: {k: [] for k in k_grid} for b in batch_sizes}
    rng = random.Random(seed)
    t_start, rounds = time.perf_counter(), 0
    while True:
        rng.shuffle(jobs)
        for kind, b, k in jobs:
            if kind == "draft":
                draft_s[b] += [draft[b].time_feed(block[i : i + 1])[0] for i in range(DRAFT_STEPS_PER_ROUND)]
            else:
                target_s[b][k].append(target[b].time_feed(block[: k + 1])[0])
        rounds += 1
        if rounds >= MIN_ROUNDS and time.perf_counter() - t_start >= budget_s:
            break
    if progress:
        log.info("calibrate: batch costs timed in %d rounds (B = %s)", rounds, ", ".join(map(str, batch_sizes)))

    def iqr(v):
        return [float(np.percentile(v, 25)), float(np.percentile(v, 75))]

    return {
        "batch_sizes": batch_sizes,
        "k_grid": k_grid,
        "t_draft": {str(b): float(np.median(draft_s[b])) for b in batch_sizes},
        "t_target": {str(b): {str(k): float(np.median(v)) for k, v in target_s[b].items()} for b in batch_sizes},
        "iqr": {"t_draft": {str(b): iqr(draft_s[b]) for b in batch_sizes},
                "t_target": {str(b): {str(k): iqr(v) for k, v in target_s[b].items()} for b in batch_sizes}},
        "context_tokens": int(context_tokens),
        "rounds": rounds,
        "seconds": time.perf_counter() - t_start,
        "method": "interleaved rounds over every (B, K), shuffled; medians; every row holds the same context",
    }
