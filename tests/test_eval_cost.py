"""Cost model: Eq. 5.1 special case, presets, JSON round trip; calibrate-cost on the tiny pair."""

import numpy as np

from specstop.eval.cost import PRESETS, CostModel, load_cost_model
from specstop.eval.replay import Counts, replay
from specstop.eval.synthetic import random_replay_data
from specstop.policy import PolicySpec


def test_eq51_matches_round_formula():
    d = random_replay_data(10, 50, seed=4, max_new_tokens=50, eos_end=False, vary_lengths=False)
    c = replay(d, PolicySpec(kind="static", k=4))
    cost = PRESETS["llama2-7b-70b"]
    lat = c.metrics(cost)["latency_per_token"]
    assert np.isclose(lat, cost.eq51(c.n, c.rounds, c.discarded))


def test_general_round_cost():
    cost = CostModel(t_draft=0.1, t_target=1.0, verify_per_token=0.05, predictor_per_step=0.01)
    assert np.isclose(cost.round_cost(3), 3 * 0.11 + 1.0 + 0.05 * 4)
    assert np.isclose(cost.round_cost(0), 1.05)
    assert np.isclose(cost.total(2, 3, 0), 2 * 1.05 + 3 * 0.16)


def test_json_round_trip(tmp_path):
    for c in PRESETS.values():
        p = tmp_path / "c.json"
        c.save(p)
        assert load_cost_model(str(p)).to_dict() | {"name": c.name} == c.to_dict()
    assert load_cost_model("reference-cpu").verify_per_token > 0


def test_calibrate_tiny_pair(tmp_path):
    from specstop.eval.calibrate import calibrate
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    cost = calibrate(
        pair, ["def add(a, b):\n    return a + b\n"], repeats=1, draft_steps=(1, 2, 4), verify_k=(0, 1, 4)
    )
    assert cost.t_draft > 0 and cost.t_target > 0 and cost.verify_per_token >= 0
    assert -1.0 <= cost.fit["target"]["r2"] <= 1.0 or np.isfinite(cost.fit["target"]["r2"])
    assert np.isfinite(cost.fit["draft"]["r2"])
    cost.save(tmp_path / "cost.json")
    assert load_cost_model(str(tmp_path / "cost.json")).t_draft == cost.t_draft


def test_single_step_cost_prices_plain_decoding_and_k0_rounds():
    # CPU regime: one token is much cheaper than the verification line's value at K = 0.
    cost = CostModel(t_draft=0.2, t_target=1.2, verify_per_token=0.12, t_target_single=0.57)
    assert np.isclose(cost.target_only_per_token, 0.57)
    assert np.isclose(cost.round_cost(0), 0.57)
    assert np.isclose(cost.round_cost(2), 1.2 + 0.12 * 3 + 2 * 0.2)
    # 3 rounds, one of which drafted nothing, 5 drafted tokens.
    assert np.isclose(cost.total(3, 5, target_only=1), 2 * 1.32 + 0.57 + 5 * 0.32)
    # The target-only replay row is exactly plain decoding: speedup 1.
    d = random_replay_data(4, 30, seed=1, max_new_tokens=30, eos_end=False, vary_lengths=False)
    n = d.num_tokens
    assert np.isclose(Counts(n=n, rounds=n, target_only=n).metrics(cost)["speedup"], 1.0)
    # Brute force: a static policy's latency equals the sum of its rounds' costs.
    c = replay(d, PolicySpec(kind="static", k=3))
    by_round = c.target_only * 0.57 + (c.rounds - c.target_only) * 1.32 + c.drafted * 0.32
    assert np.isclose(c.metrics(cost)["latency_per_token"], by_round / c.n)
