"""Price-free statistics: any cost table re-prices a tuned policy with no data, exactly as a fresh replay."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from specstop.eval.cost import PRESETS, CostModel
from specstop.eval.price_free import check_stats, counts, reprice, reprice_tuned, with_params
from specstop.eval.segments import build_layout, fast_replay
from specstop.eval.synthetic import random_replay_data
from specstop.eval.tune import tune_heuristic, tune_rules, tune_static, tune_threshold
from specstop.policy import PolicySpec

BASE = PRESETS["reference-cpu"]
# Another machine's shape: a cheap draft and a nearly flat verification.
FLAT = CostModel(t_draft=0.02, t_target=0.2, target_by_k={0: 0.19, 1: 0.2, 4: 0.21, 16: 0.24}, provenance="measured",
                 name="flat")
# A dear draft: short drafts win.
DEAR = CostModel(t_draft=0.4, t_target=1.0, target_by_k={0: 0.5, 1: 1.0, 4: 1.6, 16: 3.0}, provenance="measured",
                 name="dear")


@pytest.fixture(scope="module")
def data():
    return random_replay_data(10, 60, seed=4, max_new_tokens=64)


def _tuned(data, cost):
    layout = build_layout(data)
    return {
        "static": tune_static(data, cost, 12, layout=layout),
        "heuristic": tune_heuristic(data, cost, (1, 2, 4, 6), sl_max=12, layout=layout),
        "confidence": tune_threshold(data, PolicySpec(kind="confidence"), cost, (4, 8, 12), layout=layout),
        "learned": tune_rules(data, PolicySpec(kind="predictor", family="dist", extra={"scores": "dist"}), cost,
                              (4, 8), layout=layout),
    }


@pytest.mark.parametrize("table", [BASE, FLAT, DEAR], ids=lambda c: c.name)
def test_repricing_equals_a_fresh_replay_exactly(data, table):
    layout = build_layout(data)
    for name, (spec, rec) in _tuned(data, BASE).items():
        stats = check_stats(rec["stats"])
        # The same table picks the tuned policy again, at the tuned latency.
        same, metrics, _ = reprice(stats, spec, BASE)
        assert same == spec and metrics["latency_per_token"] == rec["latency_per_token"], name
        # Any table: every candidate's price is a fresh replay's under that table, to the last bit.
        new, metrics, i = reprice(stats, spec, table)
        fresh = fast_replay(data, new, layout)
        assert fresh.to_dict() == counts(stats, i).to_dict(), name
        assert fresh.metrics(table.for_policy(new)) == metrics, name


def test_the_candidates_a_moved_table_picks_are_kept(data):
    """Re-priced under a table the tuning never saw, the statistics pick what tuning afresh with that
    table picks (or one no slower), for every policy."""
    layout = build_layout(data)
    for table in (FLAT, DEAR):
        fresh = _tuned(data, table)
        for name, (spec, rec) in _tuned(data, BASE).items():
            new, metrics, _ = reprice(rec["stats"], spec, table)
            assert metrics["latency_per_token"] <= fresh[name][1]["latency_per_token"] * 1.01, (name, table.name)
            assert fast_replay(data, new, layout).metrics(table.for_policy(new)) == metrics


def test_candidates_span_each_sl_max_and_rule(data):
    _, rec = _tuned(data, BASE)["learned"]
    params = [c["params"] for c in rec["stats"]["candidates"]]
    assert {(p["sl_max"], p["rule"]) for p in params} == {(4, "below"), (8, "below"), (4, "cumprod"), (8, "cumprod")}
    assert len(params) < 4 * 80  # a few dozen per sweep, not every breakpoint
    static = _tuned(data, BASE)["static"][1]["stats"]
    assert [c["params"]["k"] for c in static["candidates"]] == list(range(1, 13))
    assert with_params(PolicySpec(kind="static"), {"k": 3}).k == 3


def test_malformed_statistics_are_refused_in_one_line():
    from specstop.errors import UserError

    for bad in (None, {"format": 9}, {"format": 1, "n": 0, "chosen": 0, "candidates": [{"params": {}, "k_hist": [1]}]},
                {"format": 1, "n": 5, "chosen": 3, "candidates": [{"params": {}, "k_hist": [1]}]}):
        with pytest.raises(UserError) as err:
            check_stats(bad, "tuned.json policy x")
        assert "\n" not in str(err.value) and "tuned.json policy x" in str(err.value)


def test_tune_reprice_cli_repicks_every_policy_without_data(tmp_path, capsys):
    pytest.importorskip("datasets")
    from specstop.cli import main
    from specstop.testing import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "data", {"validation": 4}, tokens_per_prompt=40, with_rollouts=True,
                                   rollout_length=12)
    base, flat = tmp_path / "base.json", tmp_path / "flat.json"
    base.write_text(json.dumps(replace(BASE, provenance="measured", name="base.json").to_dict()))
    flat.write_text(json.dumps(FLAT.to_dict()))
    tuned = tmp_path / "tuned.json"
    assert main(["tune", "--data", str(data), "--cost-model", str(base), "--out", str(tuned), "--sl-max-grid", "4,8",
                 "--force-cost"]) == 0
    doc = json.loads(tuned.read_text())
    assert all("stats" in p for p in doc["policies"].values())
    out = tmp_path / "repriced.json"
    assert main(["tune", "--reprice", str(tuned), "--cost-model", str(flat), "--out", str(out)]) == 0
    new = json.loads(out.read_text())
    assert new["cost_model"]["name"] == "flat" and new["repriced_from"]["tuned"] == str(tuned.resolve())
    for name, entry in new["policies"].items():
        spec = PolicySpec.from_dict(entry["spec"])
        want, metrics, _ = reprice(doc["policies"][name]["stats"], PolicySpec.from_dict(doc["policies"][name]["spec"]), FLAT)
        assert spec == want and entry["validation"]["latency_per_token"] == metrics["latency_per_token"]
        assert entry["validation"]["repriced"]["cost_model"] == "flat"
    assert new["best"] == min(new["policies"], key=lambda n: new["policies"][n]["validation"]["latency_per_token"])
    # --reprice reads no data: --data with it is refused in one line.
    capsys.readouterr()
    assert main(["tune", "--reprice", str(tuned), "--data", str(data), "--cost-model", str(flat), "--out",
                 str(tmp_path / "x.json")]) == 2
    assert "drop --data" in capsys.readouterr().err
    assert main(["tune", "--cost-model", str(flat), "--out", str(tmp_path / "y.json")]) == 2
    assert "missing --data" in capsys.readouterr().err


def test_a_tuned_file_without_statistics_is_refused():
    from specstop.errors import UserError

    with pytest.raises(UserError, match="no price-free statistics"):
        reprice_tuned({"policies": {"static_opt": {"spec": {"kind": "static", "k": 3}, "validation": {}}}}, FLAT)


def test_repriced_batch_schedule_equals_the_tuned_one_under_the_same_table(tmp_path):
    from specstop.eval.batch_schedule import batch_schedule
    from specstop.eval.price_free import reprice_batch_schedule
    from specstop.eval.tune_cli import add_schedule_candidates

    data = random_replay_data(8, 50, seed=2, max_new_tokens=54)
    layout = build_layout(data)
    batch = {"batch_sizes": [1, 4], "k_grid": [0, 1, 2, 4, 8],
             "t_draft": {1: 0.05, 4: 0.06},
             "t_target": {1: {0: 0.2, 1: 0.21, 2: 0.22, 4: 0.24, 8: 0.3}, 4: {0: 0.25, 1: 0.3, 2: 0.36, 4: 0.5, 8: 0.8}}}
    cost = replace(FLAT, batch=batch)
    static = tune_static(data, cost, 8, layout=layout)[1]["stats"]
    conf = tune_threshold(data, PolicySpec(kind="confidence"), cost, (4, 8), layout=layout)[1]["stats"]
    schedule = batch_schedule(data, cost, k_max=8, sl_max_grid=(4, 8), layout=layout)
    add_schedule_candidates(conf, schedule, data, layout)
    again = reprice_batch_schedule(static, conf, cost)
    for a, b in zip(schedule["entries"], again["entries"]):
        assert (a["batch_size"], a["k"], a["predicted_speedup_by_k"]) == (b["batch_size"], b["k"], b["predicted_speedup_by_k"])
        assert a["threshold"]["predicted_speedup"] == pytest.approx(b["threshold"]["predicted_speedup"], abs=1e-4)
    assert np.isfinite([e["predicted_speedup"] for e in again["entries"]]).all()
