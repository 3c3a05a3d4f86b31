"""A cost table is checked before anything prices rounds with it; the report and the online check
say what they could not honestly show."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specstop.errors import UserError
from specstop.eval.cost import PRESETS, CostModel
from specstop.eval.cost_check import (
    order_problems,
    require_usable,
    spread_problems,
    table_problems,
    table_warnings,
)

# The float32 table a 2-core AMD EPYC (Zen 5) calibrated, and the bf16 one of the same machine.
ERRATIC = {0: 0.291, 1: 0.586, 2: 0.840, 3: 0.517, 4: 0.526, 8: 0.636, 16: 0.693}
SMOOTH = {0: 0.115, 1: 0.111, 2: 0.112, 3: 0.113, 4: 0.117, 8: 0.129, 16: 0.153}


def measured(table: dict, **fit) -> CostModel:
    return CostModel(t_draft=0.04, t_target=0.11, target_by_k=table, provenance="measured", name="cost.json",
                     fit=fit or None)


def test_an_injected_erratic_k_is_caught():
    problems = table_problems(measured(ERRATIC))
    assert len(problems) == 2  # K=1 and K=2 both cost more than K=3 (and K=2 more than K=4 and K=16)
    assert problems[1].startswith("t_target(K=2) 0.840 s is above longer verifications (K=3 0.517 s, K=4 0.526 s")
    with pytest.raises(UserError) as err:
        require_usable(measured(ERRATIC))
    msg = str(err.value)
    assert "\n" not in msg and "K=2" in msg and "--force-cost" in msg and "calibrate-cost" in msg
    assert require_usable(measured(ERRATIC), force=True) == problems


def test_smooth_tables_and_presets_pass():
    assert table_problems(measured(SMOOTH)) == []  # K=1 3% under K=0: noise, not an erratic K
    assert all(table_problems(p) == [] for p in PRESETS.values())


def test_spread_and_decoder_disagreement_are_problems():
    # Spread left after the re-measure is reported, not refused: the median it leaves is robust.
    wide = measured(SMOOTH, target_iqr_by_k={"8": [0.08, 0.20]})
    assert table_problems(wide) == [] and table_warnings(wide)[0].startswith("K=8 spread")
    off = measured(SMOOTH, decoder_check={"target-only step": {"measured": 0.159, "predicted": 0.125,
                                                                 "ratio": 1.27, "rounds": 10}})
    assert table_problems(off) == ["target-only step: the decoder measured 0.159 s per round where the table "
                                   "predicts 0.125 s (1.27x)"]
    samples = {0: [0.1, 0.1, 0.1, 0.1], 2: [0.3, 0.8, 0.9, 1.9, 0.4]}
    assert [ks for ks, _ in spread_problems(samples)] == [(2,)]
    # The quickstart's float32 calibration on the same machine.
    assert [ks for ks, _ in order_problems({0: 0.29, 1: 1.94, 2: 0.86, 3: 3.77, 8: 0.65})] == [(1, 2, 8), (2, 8), (3, 8)]


def test_calibrate_remeasures_suspect_k(monkeypatch):
    from specstop.measure import calibrate as cal
    from specstop.testing import tiny_pair

    calls = []

    def fake_time_pair(pair, context, *, context_tokens, budget_s, k_grid, progress=True, seed=0, decoder=False):
        calls.append(tuple(k_grid))
        base = {k: [0.1 + 0.01 * k] * 4 for k in k_grid}
        if len(calls) == 1:
            base[2] = [0.9, 0.3, 1.8, 0.95]  # a burst of load on K = 2
        return {"draft": [0.02] * 8, "target": base, "rounds": 4, "seconds": 1.0}

    monkeypatch.setattr(cal, "time_pair", fake_time_pair)
    cost, raw = cal.calibrate(tiny_pair(), context=list(range(60)), context_tokens=20, budget_s=1.0,
                              k_grid=(0, 1, 2, 4), progress=False, check_decoder=False)
    assert calls == [(0, 1, 2, 4), (2, 4)]  # K=2 spread, and it sits above K=4
    # K=2's burst is replaced; K=4 measured the same again, so both its sets of samples are kept.
    assert cost.fit["check"] == {"problems": [], "warnings": [], "remeasured": [2, 4], "reproduced": [4]}
    assert cost.target_by_k[2] == pytest.approx(0.12) and len(raw["target"][4]) == 8


def test_an_order_the_kernels_reproduce_is_priced_as_measured(monkeypatch):
    # One-row bf16 GEMMs cost more than two- and three-row ones on a Zen 4: real, and reproducible.
    from specstop.measure import calibrate as cal
    from specstop.testing import tiny_pair

    shape = {0: 0.25, 1: 0.21, 2: 0.22, 4: 0.25, 8: 0.30}

    def fake_time_pair(pair, context, *, context_tokens, budget_s, k_grid, progress=True, seed=0, decoder=False):
        return {"draft": [0.1] * 8, "target": {k: [shape[k]] * 4 for k in k_grid}, "rounds": 4, "seconds": 1.0}

    monkeypatch.setattr(cal, "time_pair", fake_time_pair)
    cost, _ = cal.calibrate(tiny_pair(), context=list(range(60)), context_tokens=20, budget_s=1.0,
                            k_grid=tuple(shape), progress=False, check_decoder=False)
    assert cost.fit["check"]["reproduced"] == [0, 1, 2] and cost.fit["check"]["problems"] == []
    assert require_usable(cost) == []
    # The same table without the re-measure's confirmation is not trusted.
    assert table_problems(measured(shape))


def test_calibrate_checks_the_table_against_the_decoder():
    from specstop.measure.calibrate import build_context, calibrate
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 40)
    # A budget spent before the first window: every decoder run still gets its rounds checked.
    cost, _ = calibrate(pair, context=ctx, context_tokens=40, budget_s=0.0, k_grid=(0, 1, 4), progress=False)
    check = cost.fit["decoder_check"]
    assert set(check) == {"target-only step", "static:4 round"}
    for rec in check.values():  # each round against the forwards timed beside it: the median of those ratios
        assert rec["rounds"] >= 1 and rec["measured"] > 0 and rec["ratio_iqr"][0] <= rec["ratio"] <= rec["ratio_iqr"][1]
    assert "problems" in cost.fit["check"]


def test_tune_refuses_an_erratic_cost_file_unless_forced(tmp_path, capsys):
    pytest.importorskip("datasets")
    from specstop.cli import main
    from specstop.testing import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "data", {"validation": 3}, tokens_per_prompt=30, with_rollouts=True)
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(measured(ERRATIC, rounds=3).to_dict()))
    argv = ["tune", "--data", str(data), "--cost-model", str(cost), "--out", str(tmp_path / "tuned.json"),
            "--sl-max-grid", "4"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "K=2" in err[0] and "--force-cost" in err[0]
    assert not (tmp_path / "tuned.json").exists()
    assert main([*argv, "--force-cost"]) == 0 and (tmp_path / "tuned.json").is_file()


def _row(label: str, lat: float) -> dict:
    return {"label": label, "latency_per_token": lat}


def test_gap_closed_only_when_the_oracle_is_fastest():
    from specstop.eval.report import _relative_columns

    rows = {"static_opt": _row("Static SL-opt", 0.10), "disco": _row("DISCO", 0.09), "oracle": _row("Oracle", 0.08),
            "pearl": _row("PEARL", 0.05)}  # PEARL runs the models in parallel: the chain's Oracle does not bound it
    assert _relative_columns(rows) is None
    assert rows["disco"]["gap_closed"] == pytest.approx(0.5)
    # The quickstart's float32 table: the Oracle priced at 0.823x, below Static SL-opt at 0.888x.
    rows = {"static_opt": _row("Static SL-opt", 0.100), "disco": _row("DISCO", 0.105), "oracle": _row("Oracle", 0.108)}
    why = _relative_columns(rows)
    assert "Oracle (0.10800 s/token) is slower than Static SL-opt" in why and "cost table" in why
    assert all(r["gap_closed"] is None for r in rows.values())
    assert rows["disco"]["improvement_over_static_opt"] == pytest.approx(-0.05)


def test_online_check_sizes_itself_to_its_budget():
    from specstop.measure.online_budget import estimate, run_seconds, size_online_check

    cost = measured(SMOOTH)
    lens = [120] * 8
    speedups = [1.0, 1.5, 1.5, 1.6, 1.0]  # target, three tuned methods, HF (unknown)
    full = size_online_check(cost, lens, max_new_tokens=32, repeats=2, speedups=speedups, budget_s=None)
    assert (full.prompts, full.max_new_tokens, full.methods) == (8, 32, 5) and "budget" not in full.line()
    assert full.estimate_s == pytest.approx(estimate(cost, lens, 32, 2, speedups))
    # A faster method costs less: its decode steps are divided by its speedup, its prefill is not.
    assert run_seconds(cost, 120, 32, 2.0) < run_seconds(cost, 120, 32) < 2 * run_seconds(cost, 120, 32, 2.0)
    fit = size_online_check(cost, lens, max_new_tokens=32, repeats=2, speedups=speedups, budget_s=full.estimate_s / 1.8)
    assert fit.prompts < 8 and fit.max_new_tokens == 32 and fit.estimate_s <= full.estimate_s / 1.8
    assert "sized to its" in fit.line() and f"{fit.prompts} prompts x 32 tokens x 2 repeats x 5 methods" in fit.line()
    tiny = size_online_check(cost, lens, max_new_tokens=32, repeats=2, speedups=speedups, budget_s=1.0)
    assert tiny.prompts == 4 and tiny.max_new_tokens == 16  # the floor: still a check, said so in its line
    assert np.isfinite(tiny.estimate_s)
    # An optional comparison (HF's defaults, the last method) goes before any token: 4 prompts x 32 tokens.
    four = size_online_check(cost, lens[:4], max_new_tokens=32, repeats=2, speedups=speedups, budget_s=None).estimate_s
    fit = size_online_check(cost, lens, max_new_tokens=32, repeats=2, speedups=speedups, budget_s=four * 0.9, optional=1)
    assert (fit.prompts, fit.methods, fit.max_new_tokens) == (4, 4, 32) and "4 methods" in fit.line()


def test_remeasuring_a_few_short_k_still_times_the_draft():
    # A re-measure of K = 1 alone still takes DRAFT_STEPS_PER_ROUND draft steps from the block.
    from specstop.measure.calibrate import DRAFT_STEPS_PER_ROUND, build_context, time_pair
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 30)
    raw = time_pair(pair, ctx, context_tokens=30, budget_s=0.05, k_grid=(1,), progress=False)
    assert set(raw["target"]) == {1} and len(raw["draft"]) == raw["rounds"] * DRAFT_STEPS_PER_ROUND


def test_compiled_draft_timing_picks_what_the_eager_draft_picks():
    """calibrate-cost --compile-draft times the draft as the decoder's compiled draft runs: a static cache
    rewound after every timed feed, so each sample sees the same context and picks the same token."""
    from specstop.measure.calibrate import build_context, machine_record, time_pair
    from specstop.pair.cached_forward import CachedForward
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 30)
    eager, compiled = CachedForward(pair.draft, ctx), CachedForward(pair.draft, ctx, compiled=True)
    for tokens in ([5], [7, 9], [5]):
        assert eager.time_feed(tokens)[1] == compiled.time_feed(tokens)[1]
    assert compiled.cache.get_seq_length() == len(ctx)  # rewound: the next feed sees the same context
    fast = pair.with_compiled_draft()
    raw = time_pair(fast, ctx, context_tokens=30, budget_s=0.05, k_grid=(1,), progress=False)
    assert len(raw["draft"]) >= 4 and all(s > 0 for s in raw["draft"])
    assert machine_record(fast, 30)["draft_compiled"] is True and "draft_compiled" not in machine_record(pair, 30)


def test_pearl_row_priced_with_the_measured_split():
    from specstop.eval.pearl import pearl_replay
    from specstop.eval.synthetic import random_replay_data

    data = random_replay_data(10, 40, seed=3)
    ideal = measured(SMOOTH)
    split = CostModel(**{**ideal.to_dict(), "target_by_k": SMOOTH,
                         "pearl_split": {"draft_step": 0.08, "target_scale": 1.7, "measured": {}}})
    a, b = pearl_replay(data, ideal), pearl_replay(data, split)
    assert "idealised" in a["model"] and "measured core split" in b["model"]
    assert b["latency_per_token"] > a["latency_per_token"]  # half the machine each: slower than perfect overlap


def test_calibrate_times_pearls_core_split():
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("PEARL's split needs 2+ cores")
    from specstop.measure.calibrate import build_context, calibrate
    from specstop.testing import tiny_pair

    pair = tiny_pair()
    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 40)
    cost, _ = calibrate(pair, context=ctx, context_tokens=40, budget_s=0.1, k_grid=(0, 1, 4), progress=False,
                        check_decoder=False, measure_pearl=True)
    split = cost.pearl_split
    assert split["draft_step"] > 0 and split["target_scale"] > 0
    assert {"draft_alone_s", "target_beside_draft_s", "gamma_beside"} <= set(split["measured"])
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))).pearl_split == split


def test_side_tables_are_checked_against_the_k_table_and_measured_again():
    """A tree or batch table timed while the machine was busy (every entry 3x the K table) is
    measured once more; one that agrees is kept as measured."""
    from specstop.eval.cost_check import section_disagreement
    from specstop.measure.calibrate import checked_side_table

    k_table = {0: 0.24, 1: 0.22, 4: 0.25, 8: 0.27}
    assert section_disagreement({k: v * 1.1 for k, v in k_table.items()}, k_table) is None
    busy = section_disagreement({k: v * 3 for k, v in k_table.items()}, k_table)
    assert busy is not None and busy[0] == pytest.approx(3.0) and "\n" not in busy[1]
    # one noisy size does not condemn a table: the median decides
    assert section_disagreement({**k_table, 4: 1.0}, k_table) is None

    tables = iter([{"t": {k: v * 3 for k, v in k_table.items()}}, {"t": dict(k_table)}])
    calls = []

    def measure():
        calls.append(1)
        return next(tables)

    table = checked_side_table("test", measure, lambda t: (section_disagreement(t["t"], k_table) or (0, None))[1])
    assert len(calls) == 2 and table["t"] == k_table and table["check"] == {"agrees_with_k_table": True, "problem": None}


def test_a_side_table_that_repeats_its_disagreement_is_the_paths_own_cost(caplog):
    """Both measurements of a tree table put one draft node at 1.2x the chain's draft step (within
    10% of each other): the path's own cost on that device (a GPU's extra mask launches), kept and
    said so, with no advice that the machine was busy. Two that differ are still blamed on load."""
    from specstop.measure.calibrate import checked_side_table, tables_repeat

    k_step = 0.014

    def disagreement(t):
        ratio = t["t_draft_width"][1] / k_step
        return None if abs(ratio - 1) < 0.15 else f"draft: ratio {ratio:.2f}"

    tables = iter([{"t_draft_width": {1: 0.0170}, "rounds": 25}, {"t_draft_width": {1: 0.0168}, "rounds": 31}])
    with caplog.at_level("INFO", logger="specstop"):
        table = checked_side_table("token-tree", lambda: next(tables), disagreement)
    assert table["check"] == {"agrees_with_k_table": False, "problem": "draft: ratio 1.20", "reproduced": True}
    assert "own cost on this device" in caplog.text and "busy" not in caplog.text

    assert not tables_repeat({"t_draft_width": {1: 0.03}}, {"t_draft_width": {1: 0.017}})
    # one noisy entry among repeating ones does not break the repeat (the median ratio decides)
    noisy = {"t_target_tree": {1: 0.019, 2: 0.019, 4: 0.030}, "t_draft_width": {1: 0.028}}
    assert tables_repeat(noisy, {"t_target_tree": {1: 0.019, 2: 0.020, 4: 0.019}, "t_draft_width": {1: 0.029}})
    tables = iter([{"t_draft_width": {1: 0.030}}, {"t_draft_width": {1: 0.017}}])
    caplog.clear()
    with caplog.at_level("INFO", logger="specstop"):
        table = checked_side_table("token-tree", lambda: next(tables), disagreement)
    assert "reproduced" not in table["check"] and "probably busy" in caplog.text


def test_an_order_problem_left_by_the_remeasure_is_timed_side_by_side(monkeypatch):
    """K = 0 spreads, is re-measured alone and lands above K = 1..3 timed in the first run: those K
    are timed again together; the order recurs there, so it is the machine's and the table passes."""
    from specstop.measure import calibrate as cal
    from specstop.testing import tiny_pair

    shape = {0: 0.247, 1: 0.197, 2: 0.207, 3: 0.221, 4: 0.231, 8: 0.247}
    calls = []

    def fake_time_pair(pair, context, *, context_tokens, budget_s, k_grid, progress=True, seed=0, decoder=False):
        calls.append(tuple(k_grid))
        target = {k: [shape[k]] * 4 for k in k_grid}
        if len(calls) == 1:
            target[0] = [0.10, 0.30, 0.12, 0.33]  # spread, and its median (0.21 s) not yet above K = 1
        return {"draft": [0.1] * 8, "target": target, "rounds": 4, "seconds": 1.0}

    monkeypatch.setattr(cal, "time_pair", fake_time_pair)
    cost, _ = cal.calibrate(tiny_pair(), context=list(range(60)), context_tokens=20, budget_s=1.0,
                            k_grid=tuple(shape), progress=False, check_decoder=False)
    assert calls[1] == (0,) and set(calls[2]) == {0, 1, 2, 3}
    assert cost.fit["check"]["problems"] == [] and set(cost.fit["check"]["reproduced"]) == {0, 1, 2, 3}
    assert require_usable(cost) == []
