"""Exact threshold tuning: the sweep equals step-by-step replay on every interval; known optimum."""

from dataclasses import replace

import numpy as np
import pytest

from specstop.eval.cost import PRESETS, CostModel
from specstop.eval.episodes import from_arrays
from specstop.eval.replay import replay
from specstop.eval.segments import build_layout, sweep, threshold_from_x
from specstop.eval.synthetic import random_replay_data
from specstop.eval.tune import curve_latency, tune_static, tune_threshold
from specstop.policy import PolicySpec

RULES = [
    PolicySpec(kind="confidence", sl_max=8),
    PolicySpec(kind="confidence", rule="cumprod", sl_max=8),
    PolicySpec(kind="predictor", family="dist", sl_max=10),
    PolicySpec(kind="predictor", family="dist", rule="cumprod", sl_max=10),
    PolicySpec(kind="predictor", family="hidden", reads="hidden", sl_max=12),
    PolicySpec(kind="predictor", family="hidden", reads="hidden", rule="cumprod", sl_max=12),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spec", RULES, ids=lambda s: f"{s.kind}-{s.reads}-{s.rule}")
def test_sweep_equals_reference_at_every_breakpoint(seed, spec):
    d = random_replay_data(8, 40, seed=seed, max_new_tokens=44, score_levels=None if seed else 10)
    curve = sweep(d, spec, build_layout(d))
    cost = PRESETS["reference-cpu"]
    lat = curve_latency(curve, cost)
    for i in range(len(curve.b) + 1):
        ref = replay(d, replace(spec, threshold=threshold_from_x(spec, curve.representative(i))))
        assert ref.to_dict() == curve.counts(i).to_dict()
        assert np.isclose(ref.metrics(cost)["latency_per_token"], lat[i], rtol=1e-12, atol=0)
    # Breakpoints themselves (x = b_i lies in interval i) also agree.
    for i in range(0, len(curve.b), max(1, len(curve.b) // 25)):
        x = float(curve.b[i])
        assert (
            replay(d, replace(spec, threshold=threshold_from_x(spec, x))).to_dict()
            == curve.counts(i).to_dict()
        )


def test_tuning_finds_known_optimum():
    # Score 0.9 on positions before a match, 0.1 before a mismatch: the perfect stopping rule
    # "stop when the next token's score < tau" for any tau in (0.1, 0.9] drafts exactly the
    # oracle's matches except the first token after each mismatch.
    rng = np.random.default_rng(0)
    gm = rng.random(400) < 0.8
    gm[-1] = True
    nxt = np.append(gm[1:], True)
    d = from_arrays(
        gm,
        lengths=[100] * 4,
        max_new_tokens=100,
        eos_token_id=999,
        token=np.arange(400) % 500,
        rollouts={int(m): {"tokens": np.arange(30)} for m in np.flatnonzero(~gm)},
    )
    d.add_scores("perfect", "dist", np.where(nxt, 0.9, 0.1), np.full(len(d.r_tokens), 0.1), None)
    base = PolicySpec(kind="predictor", family="perfect")
    cost = CostModel(t_draft=0.01, t_target=0.1)
    spec, rec = tune_threshold(d, base, cost, [30])
    # On random data one interval wins; here every tau in (0.1, 0.9] is optimal.
    assert 0.1 < spec.threshold <= 0.9
    assert (
        rec["discard_rate"]
        <= replay(d, replace(base, threshold=0.5, sl_max=30)).metrics(cost)["discard_rate"] + 1e-12
    )
    exp = replay(d, replace(base, threshold=0.5, sl_max=30)).metrics(cost)["latency_per_token"]
    assert np.isclose(rec["latency_per_token"], exp)
    # The search interval is exactly (0.1, 0.9].
    assert rec["search"]["interval"] == {"from": 0.1, "to": 0.9, "closed": "right"}


def test_static_opt_and_paper_grid():
    d = random_replay_data(10, 60, seed=5)
    cost = PRESETS["llama2-7b-70b"]
    spec, rec = tune_static(d, cost, 12)
    lats = [
        replay(d, PolicySpec(kind="static", k=k)).metrics(cost)["latency_per_token"] for k in range(1, 13)
    ]
    assert spec.k == int(np.argmin(lats)) + 1
    base = PolicySpec(kind="predictor", family="hidden", reads="hidden", rule="cumprod")
    spec, rec = tune_threshold(d, base, cost, [8, 12], paper_grid=(0.1, 0.3, 0.5, 0.7, 0.9))
    for g in rec["paper_grid"]:
        ref = replay(d, replace(base, threshold=g["threshold"], sl_max=spec.sl_max)).metrics(cost)
        assert np.isclose(ref["latency_per_token"], g["latency_per_token"])
        assert rec["latency_per_token"] <= g["latency_per_token"] + 1e-12
