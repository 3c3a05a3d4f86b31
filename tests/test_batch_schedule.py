"""Batch schedules: the closed-form batch pricing against a brute-force serving simulation, the schedule's
response to verification costs that rise with B, tuned.json's section and the batch cost timing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specstop.eval.batch_schedule import (
    batch_schedule,
    batch_speedup,
    cost_at,
    fixed_batch_seconds,
    prompt_rounds,
    simulate_serving,
)
from specstop.eval.cost import CostModel
from specstop.eval.segments import fast_replay
from specstop.eval.synthetic import random_replay_data
from specstop.policy import PolicySpec

SIZES = (1, 2, 4, 8)
KS = tuple(range(0, 9))


def batch_cost(t_draft, t_target, name="synthetic") -> CostModel:
    """A cost model whose batch section is given by functions t_draft(B) and t_target(B, K)."""
    section = {
        "batch_sizes": list(SIZES), "k_grid": list(KS),
        "t_draft": {str(b): t_draft(b) for b in SIZES},
        "t_target": {str(b): {str(k): t_target(b, k) for k in KS} for b in SIZES},
    }
    return CostModel(t_draft=t_draft(1), t_target=t_target(1, 1), target_by_k={k: t_target(1, k) for k in KS},
                     policy_per_step={"confidence": 1e-4}, name=name, batch=section)


def gentle(b, k):
    return 0.10 + 0.004 * b * (k + 1)


def steep(b, k):  # verification grows fast with the rows x tokens verified: compute-bound at large B
    return 0.10 * (1 + 0.02 * (k + 1)) if b == 1 else 0.10 * (1 + 0.06 * b * (k + 1))


@pytest.fixture(scope="module")
def data():
    return random_replay_data(40, 60, seed=3, match_rate=0.8, rollout_length=24)


@pytest.mark.parametrize("spec", [PolicySpec(kind="static", k=3), PolicySpec(kind="static", k=6),
                                  PolicySpec(kind="confidence", threshold=0.5, sl_max=8)], ids=lambda s: s.label)
@pytest.mark.parametrize("b", [1, 3, 8])
def test_pricing_matches_a_brute_force_serving_batch(spec, b, data):
    cost = batch_cost(lambda b: 0.02 + 0.002 * b, gentle)
    rounds = prompt_rounds(data, spec)
    counts = fast_replay(data, spec)
    # The exact replay's rounds per prompt are the segment engine's rounds.
    assert sum(e for r in rounds for _, e in r) == counts.n
    assert np.bincount([k for r in rounds for k, _ in r], minlength=len(counts.k_hist)).tolist() == \
        counts.k_hist.tolist()
    predicted = float(batch_speedup(counts.k_hist, counts.n, b, cost_at(cost, b).for_policy(spec)))
    simulated = simulate_serving(rounds, b, cost, batch_rounds=30000, seed=1, spec=spec)
    assert predicted == pytest.approx(simulated, rel=0.015)
    if b == 1:  # batch 1 is the chain cost model's speedup
        assert predicted == pytest.approx(counts.metrics(cost.for_policy(spec))["speedup"], rel=1e-9)


def test_interpolation_between_measured_batch_sizes():
    cost = batch_cost(lambda b: 0.02 * b, gentle)
    mid = cost_at(cost, 3)
    assert mid.t_draft == pytest.approx(0.06)
    assert mid.target_cost(4) == pytest.approx(gentle(3, 4))
    assert cost_at(cost, 2).for_policy("confidence").predictor_per_step == pytest.approx(2e-4)


def test_schedule_picks_shorter_drafts_when_verification_gets_expensive(data):
    cost = batch_cost(lambda b: 0.01, steep)
    sched = batch_schedule(data, cost, k_max=8, sl_max_grid=(4, 8))
    ks = {e["batch_size"]: e["k"] for e in sched["entries"]}
    assert ks[1] > ks[8], ks
    assert all(ks[a] >= ks[b] for a, b in zip(SIZES, SIZES[1:])), ks
    for e in sched["entries"]:
        by_k = e["predicted_speedup_by_k"]
        assert by_k["0"] == 1.0 and set(by_k) == {str(k) for k in range(9)}
        assert e["predicted_speedup"] == max(by_k.values()) == by_k[str(e["k"])]
    # With gentle costs the batch-1 choice holds at every B.
    flat = batch_schedule(data, batch_cost(lambda b: 0.01, gentle), k_max=8, sl_max_grid=(4, 8))
    assert flat["entries"][0]["k"] > ks[8]


def test_fixed_batch_pricing():
    cost = batch_cost(lambda b: 0.02, gentle)
    rounds = [[(2, 3), (2, 1)], [(2, 2)], [(0, 1)]]
    sec, tok = fixed_batch_seconds(rounds, 2, cost)
    c2, c1 = cost_at(cost, 2), cost_at(cost, 1)
    # batch 1: rows 0 + 1 (2 rounds: both rows, then row 0 alone); batch 2: row 2 alone.
    assert tok == 7
    assert sec == pytest.approx(c2.round_cost(2) + c1.round_cost(2) + c1.round_cost(0))


def test_tune_writes_the_batch_schedule(synth_dir, tmp_path):
    from specstop.cli import main

    cost_path = tmp_path / "cost.json"
    batch_cost(lambda b: 0.02 + 0.002 * b, steep, name="cost.json").save(cost_path)
    out = tmp_path / "tuned.json"
    assert main(["tune", "--data", str(synth_dir), "--cost-model", str(cost_path), "--sl-max-grid", "2,4,8",
                 "--out", str(out)]) == 0
    tuned = json.loads(out.read_text())
    sched = tuned["batch_schedule"]
    assert set(sched) == {"format", "cost_model", "entries"}
    assert sched["format"] == 1 and sched["cost_model"] == "cost.json"
    assert [e["batch_size"] for e in sched["entries"]] == list(SIZES)
    for e in sched["entries"]:
        assert set(e) == {"batch_size", "k", "predicted_speedup", "predicted_speedup_by_k", "threshold"}
        assert set(e["threshold"]) == {"threshold", "sl_max", "predicted_speedup"}
        assert e["threshold"]["sl_max"] in (2, 4, 8)
    # Batch 1 agrees with the chain tuner's static optimum (the same costs at B = 1, when it speculates).
    k1 = sched["entries"][0]["k"]
    assert k1 == 0 or k1 == tuned["policies"]["static_opt"]["spec"]["k"]
    # Without a batch section there is no schedule.
    plain = tmp_path / "plain.json"
    assert main(["tune", "--data", str(synth_dir), "--cost-model", "reference-cpu", "--sl-max-grid", "2,4,8",
                 "--out", str(plain)]) == 0
    assert "batch_schedule" not in json.loads(plain.read_text())


def test_time_batch_on_a_tiny_pair():
    import torch

    from specstop.errors import UserError
    from specstop.measure.batch_cost import parse_batch_grid, time_batch
    from specstop.testing import tiny_pair

    torch.set_num_threads(1)
    pair = tiny_pair()
    context = list(range(3, 3 + 80))
    sec = time_batch(pair, context, context_tokens=40, batch_sizes=(1, 3), k_grid=(0, 2), budget_s=0.0,
                     progress=False)
    assert sec["batch_sizes"] == [1, 3] and sec["k_grid"] == [0, 2] and sec["rounds"] >= 3
    assert set(sec["t_target"]["3"]) == {"0", "2"} and sec["t_draft"]["1"] > 0
    cost = CostModel(t_draft=0.1, t_target=0.1, batch=sec)
    assert cost_at(cost, 2).target_cost(2) > 0
    assert parse_batch_grid("8,1, 2") == (1, 2, 8)
    with pytest.raises(UserError, match="batch-grid"):
        parse_batch_grid("1,x")
    with pytest.raises(UserError, match="too short"):
        time_batch(pair, context[:41], context_tokens=40, batch_sizes=(1,), k_grid=(0, 2), budget_s=0.0)


def test_batch_throughput_benchmark_runs(tiny_pair_dir, tmp_path, data, capsys):
    """benchmarks/batch_throughput.py end to end on a tiny pair (text prompts: no replay prediction)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_throughput.py"
    spec = importlib.util.spec_from_file_location("batch_throughput", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cost = batch_cost(lambda b: 0.02 + 0.002 * b, steep, name="cost.json")
    cost.save(tmp_path / "cost.json")
    (tmp_path / "tuned.json").write_text(json.dumps({"batch_schedule": batch_schedule(data, cost, k_max=4,
                                                                                      sl_max_grid=(4,))}))
    out = tmp_path / "batch.json"
    assert bench.main(["--pair", str(tiny_pair_dir), "--dtype", "float32", "--device", "cpu",
                       "--cost", str(tmp_path / "cost.json"), "--tuned", str(tmp_path / "tuned.json"),
                       "--prompt", "hello world", "--prompt", "def f(x):", "--prompt", "zz",
                       "--batch-sizes", "1,2", "--k", "1,2", "--max-new-tokens", "6", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    methods = {(r["batch_size"], r["method"]) for r in doc["rows"]}
    assert {(1, "target"), (2, "static:2"), (2, "threshold")} <= methods
    assert any(m.startswith("schedule K=") for _, m in methods) and any(m.startswith("batch-1 K=") for _, m in methods)
    for r in doc["rows"]:
        assert r["throughput"] > 0 and len(r["throughput_runs"]) == 2 and r["pred_speedup_rounds"] > 0
    assert "| B | method |" in capsys.readouterr().out
