"""Cost models measured inside an engine (specstop.measure.engine_cost), on timings with known answers."""

from __future__ import annotations

import pytest

from specstop.errors import UserError
from specstop.export.engines import priced_by
from specstop.measure.engine_cost import cost_model_from_engine


def _timings(batch_sizes=(1,), ks=(0, 1, 2, 4, 8), per_token=0.03, call_overhead=0.004, verify=(0.15, 0.006)):
    """Exact timings of a line: draft_call(B, K) = B (overhead + K per_token) for K >= 1, 0.001 at K = 0;
    target_step(B, L) = B^0.5 (verify[0] + verify[1] L)."""
    calls, steps = {}, {}
    for b in batch_sizes:
        for k in ks:
            calls[f"{b}x{k}"] = b * (call_overhead + k * per_token) if k else 0.001
            steps[f"{b}x{k + 1}"] = b ** 0.5 * (verify[0] + verify[1] * (k + 1))
    return {"draft_call": calls, "target_step": steps}


def test_round_costs_are_the_engines_rounds():
    costs = _timings()
    cost = cost_model_from_engine(costs, engine="vllm 0.32.0", name="vllm_cost.json", machine={"cpu": "x"})
    assert cost.t_draft == pytest.approx(0.03)
    for k in (0, 1, 2, 4, 8):  # the model's round cost reproduces draft_call(K) + target_step(K + 1)
        assert cost.round_cost(k) == pytest.approx(costs["draft_call"][f"1x{k}"] + costs["target_step"][f"1x{k + 1}"])
    assert cost.single_step == pytest.approx(0.001 + 0.156)
    assert cost.machine == {"cpu": "x", "engine": "vllm 0.32.0"} and cost.batch is None
    assert cost.provenance_line().startswith("Priced with cost model `vllm_cost.json`, measured")


def test_batch_section_from_several_batch_sizes():
    cost = cost_model_from_engine(_timings(batch_sizes=(1, 2, 4)), engine="vllm", name="c", machine={})
    assert cost.batch["batch_sizes"] == [1, 2, 4] and cost.batch["k_grid"] == [0, 1, 2, 4, 8]
    assert cost.batch["t_draft"]["4"] == pytest.approx(4 * 0.03)
    from specstop.eval.batch_schedule import cost_at

    at4 = cost_at(cost, 4)
    assert at4.round_cost(2) == pytest.approx(4 * (0.004 + 2 * 0.03) + 2 * (0.15 + 0.006 * 3))


def test_too_short_a_sweep_is_refused():
    costs = _timings(ks=(0, 2))
    with pytest.raises(UserError, match="too few draft lengths at batch size 1"):
        cost_model_from_engine(costs, engine="vllm", name="c", machine={})


def test_engine_files_say_whose_costs_priced_them():
    vllm_cost = cost_model_from_engine(_timings(), engine="vllm 0.32.0", name="vllm_cost.json", machine={}).to_dict()
    assert priced_by(vllm_cost, "vllm").startswith("vllm's own costs, measured inside vllm 0.32.0")
    assert "not llamacpp's: an estimate" in priced_by(vllm_cost, "llamacpp")
    ours = {"provenance": "measured", "name": "cost.json", "machine": {"cpu": "x"}}
    assert "calibrate-cost --engine vllm" in priced_by(ours, "vllm")
    assert "preset" in priced_by({"provenance": "preset", "name": "amx"}, "sglang")
