"""Time every model of a multi-level stack by the number of tokens one forward feeds.

A multi-level round feeds the bottom draft one or two tokens per step, the middle model a verified block
(its drafted tokens plus one) and the target another; :func:`time_levels` times each model's forward over
each block size asked for at one context, rolled back after each (:class:`~specstop.pair.cached_forward.CachedForward`),
with every (level, rows) pair taking turns in a shuffled order per round so that the machine's drift
reaches them alike. The result, a :class:`~specstop.eval.levels.LevelCost`, prices
:func:`specstop.eval.levels.replay_levels`.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from specstop.eval.levels import LevelCost
from specstop.pair.cached_forward import CachedForward, sync
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = ["time_levels"]

MIN_ROUNDS = 5


def _probs_step(vocab_size: int, logits_size: int, dtype, repeats: int = 50) -> float:
    """Seconds a confidence rule spends per drafted token: softmax over the shared vocabulary and its max."""
    row = torch.randn(logits_size).to(dtype)
    ts = []
    for r in range(repeats + 5):
        t0 = time.perf_counter()
        float(logits_to_probs(row, DecodingConfig(), vocab_size).max())
        if r >= 5:
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_levels(models: list, names: list[str], context: list[int], rows: list[list[int]], *, vocab_size: int,
                budget_s: float = 60.0, machine: dict | None = None, progress: bool = True) -> LevelCost:
    """Median seconds of one forward of each model over each of ``rows[level]`` tokens after ``context``.

    Args:
        models: the stack, bottom first.
        names: one name per model (for the file and reports).
        context: token ids; the whole list is the context (the fed blocks repeat its first tokens).
        rows: per level, the block sizes to time (e.g. ``[[1, 2], [1, 2, 3, 4], [1, 2, 4, 8, 16]]``; the
            cost reads linearly between them).
        vocab_size: the shared vocabulary (for the rules' per-step cost).
        budget_s: seconds to spend on the timed rounds (at least ``MIN_ROUNDS`` rounds).
        machine: recorded with the result.
    """
    from tqdm.auto import tqdm

    rows = [sorted({int(n) for n in r}) for r in rows]
    block = (context * 2)[: max(max(r) for r in rows) + 1]
    feeds = [CachedForward(m, context) for m in models]
    for f, r in zip(feeds, rows):  # warm-up: allocator and kernel choice per shape
        for n in r:
            f.time_feed(block[:n])
    samples = {(lv, n): [] for lv, r in enumerate(rows) for n in r}
    order = list(samples)
    rng = random.Random(0)
    bar = tqdm(total=round(budget_s), unit="s", desc="time levels", disable=not progress,
               bar_format="{desc} {bar} {n:.0f}/{total:.0f} s")
    t_start, rounds = time.perf_counter(), 0
    while True:
        rng.shuffle(order)
        for lv, n in order:
            samples[(lv, n)].append(feeds[lv].time_feed(block[:n])[0])
        rounds += 1
        elapsed = time.perf_counter() - t_start
        bar.n = min(elapsed, budget_s)
        bar.set_description_str(f"time levels (round {rounds}: " + ", ".join(
            f"{names[lv]} x{rows[lv][0]} {np.median(samples[(lv, rows[lv][0])]):.3f} s" for lv in range(len(models))) + ")")
        bar.refresh()
        if rounds >= MIN_ROUNDS and elapsed >= budget_s:
            break
    bar.close()
    sync(feeds[0].device)
    bottom = models[0]  # a quantized draft's head has no float weight to read sizes from: its config has them
    step = _probs_step(vocab_size, int(bottom.config.vocab_size), bottom.get_input_embeddings().weight.dtype)
    forward = [{n: float(np.median(samples[(lv, n)])) for n in r} for lv, r in enumerate(rows)]
    spread = {f"{names[lv]}:{n}": [float(np.percentile(v, 25)), float(np.percentile(v, 75))]
              for (lv, n), v in samples.items()}
    rec = dict(machine or {}, rounds=rounds, iqr=spread)
    return LevelCost(list(names), forward, step, rec, len(context))
