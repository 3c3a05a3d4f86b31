"""Cost model: Eq. 5.1 special case, presets, JSON round trip; calibrate-cost on the tiny pair."""

import numpy as np
import pytest

from specstop.eval.cost import PRESETS, CostModel, load_cost_model
from specstop.eval.replay import Counts, replay
from specstop.eval.synthetic import random_replay_data
from specstop.policy import PolicySpec


def test_eq51_matches_round_formula():
    d = random_replay_data(10, 50, seed=4, max_new_tokens=50, eos_end=False, vary_lengths=False)
    c = replay(d, PolicySpec(kind="static", k=4))
    cost = CostModel(t_draft=0.0234, t_target=0.112)  # Eq. 5.1's assumptions: no single-step cost
    lat = c.metrics(cost)["latency_per_token"]
    assert np.isclose(lat, cost.eq51(c.n, c.rounds, c.discarded))


def test_general_round_cost():
    cost = CostModel(t_draft=0.1, t_target=1.0, verify_per_token=0.05, predictor_per_step=0.01)
    assert np.isclose(cost.round_cost(3), 3 * 0.11 + 1.0 + 0.05 * 4)
    assert np.isclose(cost.round_cost(0), 1.05)
    # Two rounds: K = 1 and K = 2.
    assert np.isclose(cost.total_hist([0, 1, 1]), 2 * 1.05 + 3 * 0.16)


def test_json_round_trip(tmp_path):
    for c in PRESETS.values():
        p = tmp_path / "c.json"
        c.save(p)
        assert load_cost_model(str(p)).to_dict() | {"name": c.name} == c.to_dict()
    assert load_cost_model("reference-cpu").verify_per_token > 0
    # A measured table survives JSON (int keys become strings and back).
    c = CostModel(t_draft=0.1, t_target=0.2, target_by_k={0: 0.19, 1: 0.2, 4: 0.21}, provenance="measured", name="m")
    c.save(tmp_path / "m.json")
    back = load_cost_model(str(tmp_path / "m.json"))
    assert back.target_by_k == {0: 0.19, 1: 0.2, 4: 0.21} and not back.is_preset


@pytest.mark.parametrize("given", [{}, {"t_draft": 0.1}])
def test_a_cost_model_without_its_step_costs_is_refused_in_one_line(given, tmp_path):
    with pytest.raises(ValueError, match=r"a cost model needs \['t_draft', 't_target'\] \(missing .*calibrate-cost"):
        load_cost_model(given)
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="missing"):
        load_cost_model(tmp_path / "empty.json")


def test_calibrate_tiny_pair(tmp_path):
    from specstop.export.runtime import StoppingPolicy
    from specstop.measure.calibrate import build_context, calibrate, calibration_plot
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 40)
    cost, raw = calibrate(pair, context=ctx, context_tokens=40, budget_s=0.2, k_grid=(0, 1, 4),
                          policies={"confidence": StoppingPolicy.from_string("confidence:0.4")}, progress=False)
    # Every K has at least the 3 rounds' samples (a K re-measured for its spread has its new ones).
    assert raw["rounds"] >= 3 and all(len(v) >= 3 for v in raw["target"].values())
    assert set(cost.target_by_k) == {0, 1, 4} and cost.t_target_single == cost.target_by_k[0]
    assert cost.t_draft > 0 and not cost.is_preset and cost.machine["context_tokens"] == 40
    assert cost.policy_per_step["confidence"] > 0
    assert cost.for_policy("static").predictor_per_step == 0.0
    assert cost.for_policy("confidence").predictor_per_step == cost.policy_per_step["confidence"]
    cost.save(tmp_path / "cost.json")
    back = load_cost_model(str(tmp_path / "cost.json"))
    assert back.target_by_k == cost.target_by_k and back.t_draft == cost.t_draft
    assert calibration_plot(tmp_path / "cost.png", cost, raw).stat().st_size > 0


def test_single_step_cost_prices_plain_decoding_and_k0_rounds():
    # CPU regime: one token is much cheaper than the verification line's value at K = 0.
    cost = CostModel(t_draft=0.2, t_target=1.2, verify_per_token=0.12, t_target_single=0.57)
    assert np.isclose(cost.target_only_per_token, 0.57)
    assert np.isclose(cost.round_cost(0), 0.57)
    assert np.isclose(cost.round_cost(2), 1.2 + 0.12 * 3 + 2 * 0.2)
    # 3 rounds: one drafted nothing, the others 2 and 3 tokens.
    assert np.isclose(cost.total_hist([1, 0, 1, 1]), 0.57 + (1.2 + 0.12 * 3 + 2 * 0.2) + (1.2 + 0.12 * 4 + 3 * 0.2))
    # The target-only replay row is exactly plain decoding: speedup 1.
    d = random_replay_data(4, 30, seed=1, max_new_tokens=30, eos_end=False, vary_lengths=False)
    n = d.num_tokens
    assert np.isclose(Counts(n=n, rounds=n, target_only=n, k_hist=[n]).metrics(cost)["speedup"], 1.0)
    # Brute force: a static policy's latency equals the sum of its rounds' costs.
    c = replay(d, PolicySpec(kind="static", k=3))
    by_round = c.target_only * 0.57 + (c.rounds - c.target_only) * 1.32 + c.drafted * 0.32
    assert np.isclose(c.metrics(cost)["latency_per_token"], by_round / c.n)


def test_table_interpolates_and_extrapolates():
    # A concave CPU table (AVX2 EPYC, float32): no line fits it.
    cost = CostModel(t_draft=0.2, t_target=1.0, target_by_k={0: 0.57, 1: 1.05, 2: 1.51, 4: 2.13, 8: 2.54})
    t = cost.target_costs(10)
    assert np.isclose(t[0], 0.57) and np.isclose(t[1], 1.05) and np.isclose(t[4], 2.13)
    assert np.isclose(t[3], (1.51 + 2.13) / 2) and np.isclose(t[6], (2.13 + 2.54) / 2)
    slope = (2.54 - 2.13) / 4
    assert np.isclose(t[10], 2.54 + 2 * slope)
    assert np.isclose(cost.round_cost(3), 3 * 0.2 + t[3])


def test_table_prices_replay_round_by_round():
    from specstop.eval.replay import ReplayTrace
    from specstop.eval.segments import fast_replay

    cost = CostModel(t_draft=0.08, t_target=0.2, target_by_k={0: 0.19, 1: 0.19, 2: 0.2, 8: 0.21, 16: 0.25},
                     predictor_per_step=0.001)
    d = random_replay_data(6, 40, seed=3, max_new_tokens=40)
    for spec in (PolicySpec(kind="static", k=3), PolicySpec(kind="confidence", threshold=0.5, sl_max=12),
                 PolicySpec(kind="heuristic", start=3, sl_max=20)):
        tr = ReplayTrace()
        c = replay(d, spec, trace=tr)
        brute = sum(cost.round_cost(k) for k in tr.k) / c.n
        assert np.isclose(c.metrics(cost)["latency_per_token"], brute), spec
        assert np.isclose(fast_replay(d, spec).metrics(cost)["latency_per_token"], brute), spec
        assert c.k_hist.sum() == c.rounds and (np.arange(len(c.k_hist)) * c.k_hist).sum() == c.drafted


def test_provenance_line_names_presets():
    assert "NOT measured on this machine" in PRESETS["reference-cpu"].provenance_line()
    m = CostModel(t_draft=0.1, t_target=0.2, provenance="measured",
                  machine={"cpu": "Xeon", "device": "cpu", "dtype": "bfloat16", "context_tokens": 300})
    line = m.provenance_line()
    assert "NOT" not in line and "Xeon" in line and "bfloat16" in line
