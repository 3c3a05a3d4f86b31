"""InRunTiming (specstop.measure.in_run_cost) times the target by rows and each draft's steps in passes, and
re-prices a calibrated cost model and a multi-level stack's level cost with its medians, keeping the rest."""

from __future__ import annotations

import pytest

from specstop.eval.cost import CostModel
from specstop.eval.levels import LevelCost
from specstop.measure.in_run_cost import DRAFT_STEPS, InRunTiming
from specstop.testing import tiny_pair


def test_passes_reprice_the_cost_models_with_their_medians():
    pair = tiny_pair(seed=3)
    timing = InRunTiming(pair.target, {"": (pair.draft, False)}, list(range(3, 30)), [1, 2, 4],
                         middle=(pair.target, [1, 3]), bottom_rows=(1, 2))
    for _ in range(3):
        timing.sample()
    assert timing.passes == 3 and len(timing.samples[("draft:", 1)]) == 3 * DRAFT_STEPS
    base = CostModel(t_draft=9.0, t_target=9.0, draft_per_token=8.0, target_by_k={0: 9.0, 1: 9.0, 3: 9.0, 7: 9.0},
                     policy_per_step={"confidence": 0.5}, provenance="measured", name="cal")
    cost = timing.cost_for(base, "")
    assert cost.t_draft == timing.median("draft:", 1) and cost.draft_per_token is None
    assert cost.target_by_k == {0: timing.median("target", 1), 1: timing.median("target", 2),
                                3: timing.median("target", 4)}  # K = 7 was not timed: it is left out
    assert cost.policy_per_step == {"confidence": 0.5} and cost.fit["in_run"]["calibrated_t_draft"] == 9.0
    level = timing.level_cost_for(LevelCost(["d", "m", "t"], [{1: 9.0, 2: 9.0}, {1: 9.0, 3: 9.0, 5: 9.0},
                                                              {1: 9.0, 4: 9.0}]), "")
    assert level.forward[0] == {1: timing.median("draft:", 1), 2: timing.median("draft:", 2)}
    assert level.forward[1] == {1: timing.median("middle", 1), 3: timing.median("middle", 3), 5: 9.0}
    assert level.forward[2][4] == pytest.approx(timing.median("target", 4)) and level.machine["in_run_passes"] == 3
