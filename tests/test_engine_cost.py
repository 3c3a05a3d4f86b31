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
    runner_swept = {**vllm_cost, "machine": {**vllm_cost["machine"], "vllm_path": "runner"}}
    assert "specstop's stop timed in vLLM's batched draft runner" in priced_by(runner_swept, "vllm")
    assert "not llamacpp's: an estimate" in priced_by(vllm_cost, "llamacpp")
    ours = {"provenance": "measured", "name": "cost.json", "machine": {"cpu": "x"}}
    assert "calibrate-cost --engine vllm" in priced_by(ours, "vllm")
    assert "preset" in priced_by({"provenance": "preset", "name": "amx"}, "sglang")


def test_vllm_runner_steps_price_its_fixed_k():
    """vLLM's own draft-model runner, timed per decode step at K = 0 (no speculation), 2 and 4 and at two batch
    sizes, is kept in the cost model and prices a fixed K as tokens_per_round x step(0) / step(K) at that batch
    size, interpolated between measured K and never extrapolated past them."""
    from specstop.eval.cost import runner_speedup

    runner = {"1": {"0": {"step_s": 0.12}, "2": {"step_s": 0.20}, "4": {"step_s": 0.28}},
              "2": {"0": {"step_s": 0.15}, "2": {"step_s": 0.30}}}
    cost = cost_model_from_engine(_timings(), engine="vllm 0.32.0", name="c", machine={}, runner=runner)
    stored = cost.to_dict()["fit"]["vllm_runner"]
    assert stored["step_s"] == runner
    assert runner_speedup(stored, 2, 2.5) == pytest.approx(2.5 * 0.12 / 0.20)
    assert runner_speedup(stored, 3, 3.0) == pytest.approx(3.0 * 0.12 / 0.24)
    assert runner_speedup(stored, 2, 2.5, batch_size=2) == pytest.approx(2.5 * 0.15 / 0.30)
    assert runner_speedup(stored, 6, 4.0) is None and runner_speedup(stored, 0, 1.0) is None
    assert runner_speedup(stored, 2, 2.5, batch_size=4) is None  # not timed at 4 rows
    assert runner_speedup({"step_s": {"1": {"2": {"step_s": 0.2}}}}, 2, 2.5) is None  # no baseline step
    assert "vllm_runner" not in cost_model_from_engine(_timings(), engine="vllm", name="c", machine={}).fit


def _tuned_with_runner(runner: dict | None, schedule: list[tuple[int, int]] | None = None) -> dict:
    """A tuned file: static K = 2 priced for the proposer, the replay's tokens per round at K = 1..4, the
    engine's cost model (with vLLM's runner steps when given) and a batch schedule of (B, K)."""
    cost = cost_model_from_engine(_timings(), engine="vllm 0.32.0", name="c", machine={}, runner=runner).to_dict()
    per_k = [{"k": k, "latency_per_token": 0.1, "tokens_per_round": v} for k, v in TOKENS_PER_ROUND.items()]
    static = {"spec": {"kind": "static", "k": 2},
              "validation": {"speedup": 1.18, "tokens_per_round": 2.5, "search": {"per_k": per_k}}}
    tuned = {"policies": {"static_opt": static}, "cost_model": cost, "best": "static_opt"}
    if schedule:
        from specstop.export.engines import BATCH_SCHEDULE_FORMAT

        tuned["batch_schedule"] = {"format": BATCH_SCHEDULE_FORMAT, "cost_model": "c", "entries": [
            {"batch_size": b, "k": k, "predicted_speedup": 1.1 if k else 1.0, "predicted_speedup_by_k": {},
             "threshold": None} for b, k in schedule]}
    return tuned


TOKENS_PER_ROUND = {1: 1.8, 2: 2.5, 3: 2.9, 4: 3.2}


def test_vllm_file_runs_the_best_fixed_k_for_vllms_own_runner():
    """A tuned static K priced for specstop's proposer is not what vLLM's runner pays: with the runner's steps
    in the cost model, the vllm file's static_opt runs the K that is best at those steps, with each K's price."""
    from specstop.export.engines import engine_settings

    runner = {"1": {"0": {"step_s": 0.12}, "1": {"step_s": 0.17}, "2": {"step_s": 0.19}, "4": {"step_s": 0.23}}}
    opt = engine_settings(_tuned_with_runner(runner), "vllm", draft="D", target="T")["options"]["static_opt"]
    by_k = {int(k): v for k, v in opt["predicted_by_k"].items()}
    tpr = TOKENS_PER_ROUND
    assert by_k == pytest.approx({k: tpr[k] * 0.12 / s for k, s in ((1, 0.17), (2, 0.19), (3, 0.21), (4, 0.23))})
    assert opt["speculative_config"] == {"model": "D", "num_speculative_tokens": 4} and opt["policy"]["k"] == 4
    assert opt["predicted"]["speedup"] == pytest.approx(3.2 * 0.12 / 0.23) and "K = 4" in opt["k_note"]
    assert '"num_speculative_tokens": 4' in opt["command"]
    # without the runner's steps, the tuned K and its proposer-priced prediction stay
    opt = engine_settings(_tuned_with_runner(None), "vllm", draft="D", target="T")["options"]["static_opt"]
    assert opt["speculative_config"]["num_speculative_tokens"] == 2 and "predicted_by_k" not in opt


def test_a_cost_model_timed_in_specstops_runner_caps_its_stop_at_the_schedules_k():
    """Costs swept in specstop's runner itself (``--vllm-path runner``) price the tuned batch schedule with that
    runner's batched rounds, so above batch size 1 its stop is capped at the schedule's K there (none where the
    schedule drafts nothing); swept through the side path, the schedule says nothing of the runner's rounds."""
    from specstop.export.engines import engine_settings

    tuned = _tuned_with_runner(None, schedule=[(1, 4), (2, 4), (4, 3), (8, 0)])
    tuned["policies"]["confidence_opt"] = {"spec": {"kind": "confidence", "threshold": 0.6, "sl_max": 12},
                                           "validation": {"speedup": 1.3}}
    tuned["cost_model"]["machine"]["vllm_path"] = "runner"
    opt = engine_settings(tuned, "vllm", draft="D", target="T")["options"]["confidence_opt"]
    assert opt["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 12], [2, 3, 4], [4, 7, 3], [8, 8, 0]]
    assert "timed in this runner" in opt["batch_caps_note"] and "skips the draft" in opt["batch_caps_note"]
    assert "--no-async-scheduling" in opt["command"] and "[4, 7, 3]" in opt["command"]
    tuned["cost_model"]["machine"]["vllm_path"] = "proposer"
    opt = engine_settings(tuned, "vllm", draft="D", target="T")["options"]["confidence_opt"]
    assert opt["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 12], [2, 3, 12], [4, 7, 12], [8, 8, 0]]


def test_vllm_schedule_takes_the_runners_k_where_it_was_timed():
    """The schedule vLLM's runner runs: at B = 1 and 2 (timed) the K best at the runner's steps, none at B = 2
    where none beats no speculation; B = 4 (not timed) keeps the tuned K and says so. Where the schedule
    drafts nothing but B = 1 speculates, vLLM's draft-model path runs K = 1 (its draft forward runs at K = 0
    too), priced where the runner was timed at K = 1 and unpriced elsewhere. specstop's stop in that runner
    is capped at the runner's best K above batch size 1, where it was timed, and drafts nothing where no K
    beats no speculation (it skips the draft's forward there)."""
    from specstop.export.engines import engine_settings

    runner = {"1": {"0": {"step_s": 0.12}, "2": {"step_s": 0.19}, "4": {"step_s": 0.23}},
              "2": {"0": {"step_s": 0.13}, "2": {"step_s": 0.40}, "4": {"step_s": 0.60}}}
    tuned = _tuned_with_runner(runner, schedule=[(1, 3), (2, 2), (4, 0)])
    sched = engine_settings(tuned, "vllm", draft="D", target="T")["batch_schedule"]
    rows = {r["batch_size"]: (r["k"], r["predicted_speedup"]) for r in sched["by_batch_size"]}
    assert rows[1] == (4, pytest.approx(3.2 * 0.12 / 0.23)) and rows[2] == (1, None) and rows[4] == (1, None)
    assert sched["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 3, 1], [4, 4, 1]]
    # specstop's stop in vLLM's runner: SL_max at B = 1; at B = 2 the runner's best K (here none beats no
    # speculation: 0); B = 4 (not timed) 0 too, where the tuned schedule drafts nothing
    tuned["policies"]["confidence_opt"] = {"spec": {"kind": "confidence", "threshold": 0.6, "sl_max": 8},
                                           "validation": {"speedup": 1.3}}
    opt = engine_settings(tuned, "vllm", draft="D", target="T")["options"]["confidence_opt"]
    assert opt["worker_cls"] and opt["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 8], [2, 3, 0], [4, 4, 0]]
    assert "calibrate-cost --engine vllm" in opt["batch_caps_note"] and "skips the draft" in opt["batch_caps_note"]
    runner["1"]["3"] = {"step_s": 0.21}
    runner["2"]["3"] = {"step_s": 0.2}  # now K = 3 is best at B = 2: the cap follows it
    tuned = _tuned_with_runner(runner, schedule=[(1, 3), (2, 2), (4, 0)])
    tuned["policies"]["confidence_opt"] = {"spec": {"kind": "confidence", "threshold": 0.6, "sl_max": 8},
                                           "validation": {"speedup": 1.3}}
    opt = engine_settings(tuned, "vllm", draft="D", target="T")["options"]["confidence_opt"]
    assert opt["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 8], [2, 3, 3], [4, 4, 0]]
    del runner["1"]["3"], runner["2"]["3"]
    # a schedule that speculates nowhere, not timed: the stop drafts nothing either, and says why
    untimed = _tuned_with_runner(None, schedule=[(1, 0), (4, 0)])
    untimed["policies"]["confidence_opt"] = tuned["policies"]["confidence_opt"]
    opt = engine_settings(untimed, "vllm", draft="D", target="T")["options"]["confidence_opt"]
    assert opt["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 3, 0], [4, 4, 0]]
    assert "speculates at no batch size" in opt["batch_caps_note"]
    runner["2"]["1"] = {"step_s": 0.25}  # K = 1 timed at B = 2, still slower than no speculation
    tuned = _tuned_with_runner(runner, schedule=[(1, 3), (2, 2), (4, 0)])
    rows = {r["batch_size"]: (r["k"], r["predicted_speedup"], r.get("tuned_k"))
            for r in engine_settings(tuned, "vllm", draft="D", target="T")["batch_schedule"]["by_batch_size"]}
    assert rows[2] == (1, pytest.approx(1.8 * 0.13 / 0.25), 0) and rows[4] == (1, None, 0)
    assert any("batch sizes 1, 2: vLLM's own draft-model runner" in n and "the others" in n for n in sched["notes"])


def test_decode_phase_is_timed_from_the_last_first_token():
    """The decode phase of one generate call: tokens after each request's first, from the moment every request
    has its first token to the last token; None when vLLM kept no per-request timestamps."""
    from types import SimpleNamespace as NS

    from specstop.measure.vllm_cost import decode_phase

    def out(n, first, last):
        return NS(outputs=[NS(token_ids=list(range(n)))], metrics=NS(first_token_ts=first, last_token_ts=last))

    assert decode_phase([out(10, 5.0, 6.0), out(4, 5.2, 5.9)]) == (9 + 3, pytest.approx(0.8))
    assert decode_phase([NS(outputs=[NS(token_ids=[1])], metrics=None)]) is None


def test_calibrate_cost_vllm_refuses_zero_engine_starts(tmp_path, capsys):
    """A bad --engine-starts gets one line before any engine starts."""
    from specstop.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate-cost", "--engine", "vllm", "--draft", "d", "--target", "t", "--engine-starts", "0",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine-starts 0" in err[0], err
    assert not out.exists()


def test_calibrate_cost_vllm_names_the_paths_it_sweeps(tmp_path, capsys):
    """A --vllm-path that is neither the runner nor the side-path proposer is one line naming both."""
    from specstop.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate-cost", "--engine", "vllm", "--draft", "d", "--target", "t", "--vllm-path", "side",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vllm-path side: choose runner" in err[0] and "or proposer" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("flags, engine", [
    (["--engine-starts", "-1"], "vllm"),
    (["--vllm-python", "/usr/bin/python3"], "vllm"),
    (["--vllm-path", "runner"], "vllm"),
    (["--engine", "vllm", "--llama-server", "/bin/true"], "llamacpp"),
    (["--engine", "llamacpp", "--engine-starts", "3"], "vllm"),
])
def test_calibrate_cost_refuses_one_engines_setting_given_with_another(flags, engine, tmp_path, capsys):
    """A setting only one engine reads, given for another engine, is one line, not silently ignored."""
    from specstop.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate-cost", "--draft", "d", "--target", "t", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flags[-2]} {flags[-1]} is a setting of --engine {engine}" in err[0], err
    assert f"add --engine {engine} or drop {flags[-2]}" in err[0]
    assert not out.exists()


def test_calibrate_cost_vllm_names_a_missing_vllm_python(tmp_path, capsys):
    """A --vllm-python that is not there is one line before any prompt or engine loads (was FileNotFoundError)."""
    from specstop.cli import main

    out, missing = tmp_path / "c.json", tmp_path / "no-venv" / "bin" / "python"
    assert main(["calibrate-cost", "--engine", "vllm", "--draft", "d", "--target", "t", "--vllm-python", str(missing),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--vllm-python {missing}: no such program" in err[0] and "make vllm-env" in err[0], err
    assert not out.exists()


def test_calibrate_cost_compile_draft_is_for_specstops_decoders(tmp_path, capsys):
    from specstop.cli import main

    assert main(["calibrate-cost", "--engine", "vllm", "--draft", "d", "--target", "t", "--compile-draft",
                 "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --compile-draft" in err[0], err
