"""Forward costs timed inside an online check, between its prompts, to price its predictions.

On a shared or drifting machine the target's one-token step can move by a quarter between minutes (see
``benchmarks/step_drift.py``), and a speedup prediction is a ratio to exactly that step: a calibration
made ten minutes before a run then decides whether its prediction lands. :class:`InRunTiming` times the
same primitives calibrate-cost times (each draft's one-token step, the target's verification of K + 1
tokens, a middle model's verification blocks) in short passes interleaved with the online check's
prompts, so the costs and the decoding they price come from the same minutes. The calibrated cost
models keep everything else (the policies' per-step costs, PEARL and tree tables); the replays are
unchanged. A prediction priced this way still never reads the measured decoding itself.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.levels import LevelCost
from specstop.pair.cached_forward import CachedForward

__all__ = ["InRunTiming"]

#: Draft steps timed per pass (a round drafts a few).
DRAFT_STEPS = 3


class InRunTiming:
    """Time a target, its drafts and a middle model in passes; hand out re-timed cost models.

    Args:
        target: the target model.
        drafts: ``{name: (draft model, compiled)}``, each draft a method's cost model prices.
        context: token ids of a decoding context (calibrate-cost's, e.g. ``context_from_data``).
        target_rows: the target's block sizes to time (K + 1 for each K of the cost tables).
        middle: ``(model, rows)`` of a multi-level stack's middle model, or None.
        bottom_rows: the block sizes of each draft's steps (1; 1-3 under a multi-level stack).
    """

    def __init__(self, target, drafts: dict[str, tuple], context: list[int], target_rows: list[int], *,
                 middle: tuple | None = None, bottom_rows: tuple[int, ...] = (1,)) -> None:
        self.context = list(context)
        self.block = (self.context * 2)[: max([*target_rows, *(middle[1] if middle else [1]), 3]) + 1]
        self.items: list[tuple[str, int, CachedForward]] = []
        target_feed = CachedForward(target, self.context)
        self.items += [("target", int(n), target_feed) for n in sorted(set(target_rows))]
        for name, (model, compiled) in drafts.items():
            feed = CachedForward(model, self.context, compiled=bool(compiled))
            self.items += [(f"draft:{name}", int(n), feed) for n in bottom_rows]
        if middle is not None:
            feed = CachedForward(middle[0], self.context)
            self.items += [("middle", int(n), feed) for n in sorted(set(middle[1]))]
        self.samples: dict[tuple[str, int], list[float]] = {(who, n): [] for who, n, _ in self.items}
        self.rng = random.Random(0)
        for _, n, feed in self.items:  # warm-up: kernel choice per shape (and a compiled draft's graphs)
            feed.time_feed(self.block[:n])

    def sample(self) -> None:
        """One pass: every (model, rows) once, the draft steps ``DRAFT_STEPS`` times, in a shuffled order."""
        order = [it for it in self.items for _ in range(DRAFT_STEPS if it[0].startswith("draft:") else 1)]
        self.rng.shuffle(order)
        for who, n, feed in order:
            self.samples[(who, n)].append(feed.time_feed(self.block[:n])[0])

    def median(self, who: str, rows: int) -> float:
        return float(np.median(self.samples[(who, rows)]))

    @property
    def passes(self) -> int:
        return min(len(v) for (who, _), v in self.samples.items() if who == "target")

    def cost_for(self, base: CostModel, draft: str) -> CostModel:
        """``base`` with its draft step and target table re-timed here (its K grid, where timed)."""
        table = {k: self.median("target", k + 1) for k in (base.target_by_k or {0: 0})
                 if ("target", k + 1) in self.samples}
        fit = dict(base.fit or {}, in_run={"passes": self.passes, "calibrated_t_draft": base.t_draft,
                                           "calibrated_target_by_k": base.target_by_k})
        return dataclasses.replace(base, t_draft=self.median(f"draft:{draft}", 1), draft_per_token=None,
                                   target_by_k=table, t_target_single=table.get(0, base.t_target_single),
                                   name=f"{base.name} (re-timed in the run)", fit=fit)

    def level_cost_for(self, base: LevelCost, draft: str) -> LevelCost:
        """``base`` (a multi-level stack's costs) with every table re-timed here (its rows, where timed)."""
        whos = [f"draft:{draft}", "middle", "target"]
        forward = [{n: self.median(who, n) if (who, n) in self.samples else s for n, s in table.items()}
                   for who, table in zip(whos, base.forward)]
        machine = dict(base.machine or {}, in_run_passes=self.passes)
        return dataclasses.replace(base, forward=forward, machine=machine)
