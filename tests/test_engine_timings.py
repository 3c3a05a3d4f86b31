"""What a proposer's calls and the target steps between them cost (specstop.decode.engine_timings), by hand."""

from __future__ import annotations

import pytest

from specstop.decode.engine_timings import EngineTimings
from specstop.measure.engine_cost import cost_model_from_engine


def test_calls_and_steps_are_keyed_by_rows_and_block_where_every_row_decodes_alike():
    t = EngineTimings()
    assert t.record(0.0, 0.1, [2, 2], decoding=True) is None  # the first call: no step before it
    assert t.record(0.5, 0.55, [0, 0], decoding=True) == pytest.approx(0.4)  # verified 2 x (2 + 1) tokens
    assert t.record(0.85, 1.0, [1, 2], decoding=True) == pytest.approx(0.3)  # verified 2 x 1 token
    assert t.record(1.2, 1.3, [3], decoding=True) is None  # a request finished: no step prices it
    assert t.record(1.5, 1.6, [3], decoding=False) is None  # a prefill shares the step
    # the call before held a prefill: its step is returned (live pricing reads it), keyed under no block
    assert t.record(1.9, 2.0, [3], decoding=True) == pytest.approx(0.3)
    costs = t.costs()
    assert costs["draft_call"] == {"2x2": pytest.approx(0.1), "2x0": pytest.approx(0.05), "1x3": pytest.approx(0.1)}
    assert costs["target_step"] == {"2x3": pytest.approx(0.4), "2x1": pytest.approx(0.3)}
    # seconds per drafted token at B rows: 0.1 / 4 and 0.15 / 3 at B = 2; B = 1: 0.1 / 3 each
    assert costs["draft_per_token"] == {1: pytest.approx(0.1 / 3), 2: pytest.approx((0.025 + 0.05) / 2)}
    assert costs["samples"]["call"] == {"2x2": 1, "2x0": 1, "1x3": 2}  # the call beside a prefill has no block
    assert t.last.rows == 1 and t.last.block == 4 and t.last.longest == 3


def test_a_sweeps_timings_make_a_cost_model():
    """Each K of a sweep, drafted and verified: the cost model's round(K) is draft_call(K) + target_step(K + 1)."""
    t, now = EngineTimings(), 0.0
    for _ in range(4):
        for k in (0, 1, 2, 4):
            t_in = now
            now += 0.01 + 0.02 * k  # the call: 20 ms per drafted token
            t.record(t_in, now, [k], decoding=True)
            now += 0.1 + 0.01 * (k + 1)  # the target step verifying k + 1 tokens
    cost = cost_model_from_engine(t.costs(), engine="vllm test", name="sweep", machine={"vllm_path": "runner"})
    assert cost.t_draft == pytest.approx(0.02)
    assert cost.target_by_k[2] == pytest.approx(0.01 + 0.1 + 0.03)
    assert "vLLM's batched draft runner" in cost.fit["method"]


def test_a_call_that_also_caught_up_prices_no_round_but_its_target_step_does():
    t = EngineTimings()
    t.record(0.0, 0.1, [0], decoding=True)
    assert t.record(0.3, 0.5, [2], decoding=True, one_off=True) == pytest.approx(0.2)
    t.record(0.7, 0.8, [2], decoding=True)
    costs = t.costs()
    assert costs["draft_call"] == {"1x0": pytest.approx(0.1), "1x2": pytest.approx(0.1)}  # not the 0.2 s one
    assert costs["target_step"] == {"1x1": pytest.approx(0.2), "1x3": pytest.approx(0.2)}
