"""Honest pricing of PEARL's split: each model's step on its own share of the machine, timed alone and
while the other model runs on its share (memory bandwidth and caches are shared even when the cores
are not). The replay's PEARL timing model assumes perfect overlap; these numbers say how far the
split is from it.
"""

from __future__ import annotations

import math

from specstop.decode.pearl_workers import PearlWorkers

__all__ = ["time_split"]


def time_split(workers: PearlWorkers, *, target_tokens: int = 1, context: int = 64, reps: int = 5) -> dict:
    """Median step seconds of both models on their workers' cores, alone and side by side.

    Args:
        workers: the PEARL workers (started here if needed); their cores are the split measured.
        target_tokens: tokens per target forward (1: a single step; gamma + 1: a post-verify pass).
        context: cached tokens before the timed step.
        reps: timed steps of the target; the draft repeats its step for as long as the target runs.

    Returns:
        ``{"draft_alone_s", "target_alone_s", "draft_beside_target_s", "target_beside_draft_s",
        "draft_slowdown", "target_slowdown", "gamma_alone", "gamma_beside", "workers"}``: the
        slowdowns are beside / alone, the gammas round(t_target / t_draft) for each case.
    """
    workers.start()
    draft, target = workers.draft, workers.target
    draft.submit("step_seconds", context, 1, reps)
    d_alone = draft.result()
    target.submit("step_seconds", context, target_tokens, reps)
    t_alone = target.result()
    # Side by side: the draft keeps stepping for the whole of the target's measurement.
    d_reps = max(reps, math.ceil(reps * t_alone / max(d_alone, 1e-9)))
    draft.submit("step_seconds", context, 1, d_reps)
    target.submit("step_seconds", context, target_tokens, reps)
    d_beside, t_beside = draft.result(), target.result()
    return {
        "draft_alone_s": d_alone,
        "target_alone_s": t_alone,
        "draft_beside_target_s": d_beside,
        "target_beside_draft_s": t_beside,
        "draft_slowdown": d_beside / d_alone,
        "target_slowdown": t_beside / t_alone,
        "gamma_alone": max(1, round(t_alone / d_alone)),
        "gamma_beside": max(1, round(t_beside / d_beside)),
        "target_tokens": target_tokens,
        "workers": workers.describe(),
    }
