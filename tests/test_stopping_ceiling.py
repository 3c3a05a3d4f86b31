"""benchmarks/stopping_ceiling.py: its rule shapes replay like the stock policies; it runs end to end."""

import json
import sys
from pathlib import Path

from specstop.eval.cost import load_cost_model
from specstop.eval.episodes import load_replay_data
from specstop.eval.replay import replay
from specstop.policy import PolicySpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import stopping_ceiling  # noqa: E402


def _counts(c):
    return (c.n, c.rounds, c.drafted, c.accepted)


def test_below_and_cumprod_shapes_replay_as_the_stock_confidence_rules(synth_dir):
    data = load_replay_data(synth_dir, "validation")
    for tau in (0.3, 0.6, 0.9):
        spec = PolicySpec(kind="confidence", threshold=tau, sl_max=8)
        shaped = replay(data, spec, make_policy=stopping_ceiling.ShapedRule.factory(tau, 0.0, 0.0, True))
        assert _counts(shaped) == _counts(replay(data, spec))
    # prod(top1) < c is the stock cumulative rule 1 - prod(top1) > h with h = 1 - c.
    spec = PolicySpec(kind="confidence", rule="cumprod", threshold=0.5, sl_max=8)
    shaped = replay(data, spec, make_policy=stopping_ceiling.ShapedRule.factory(0.0, 0.0, 0.5, True))
    assert _counts(shaped) == _counts(replay(data, spec))


def test_the_benchmark_writes_feature_aurocs_and_validation_tuned_shapes(synth_dir, tmp_path):
    out = tmp_path / "ceiling"
    args = ["--data", str(synth_dir), "--cost", "llama2-7b-70b", "--sl-max", "8", "--out", str(out)]
    assert stopping_ceiling.main(args) == 0
    result = json.loads((out / "ceiling.json").read_text())
    assert set(result["feature_information"]) == {"top1", "disco", "+context", "+target"}
    for row in result["feature_information"].values():
        assert 0.0 <= row["test"] <= 1.0
    assert set(result["rule_shapes"]) == {f"top1 {s}" for s in stopping_ceiling.SHAPES}
    # The tuned threshold is the grid's best on validation: no worse than any stock grid point.
    cost = load_cost_model("llama2-7b-70b")
    data = load_replay_data(synth_dir, "validation")
    tuned = result["rule_shapes"]["top1 below"]["validation_speedup"]
    for tau in stopping_ceiling.SHAPES["below"][::6]:
        spec = PolicySpec(kind="confidence", threshold=float(tau[0]), sl_max=8)
        assert tuned >= replay(data, spec).metrics(cost.for_policy(spec))["speedup"] - 1e-12
    assert (out / "ceiling.png").stat().st_size > 0
