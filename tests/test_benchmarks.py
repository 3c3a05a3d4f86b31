"""Every script in benchmarks/ answers ``--help`` and finishes a smoke run on the tiny pair or a
synthetic dataset (seconds each), run as ``python benchmarks/X.py ARGS`` runs it (in this process,
as ``__main__``). A new script without a smoke run here fails :func:`test_every_benchmark_has_a_smoke_run`.
The example command lines in each script's docstring parse with its own arguments.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from _snippets import REPO, command_argv, parse_script, run_script

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))

#: script -> its smoke arguments (``{pair}``, ``{data}``, ``{out}`` and ``{tmp}`` are filled in below).
SMOKE = {
    "compiled_draft_step.py": "--pair {pair} --quant none,int8 --dtype float32 --context 4 --steps 2 --repeats 2 "
                              "--json {out}",
    "data_gen_throughput.py": "--pair tiny --n 2 --batch-sizes 1 --max-new-tokens 4 --device cpu --dtype float32",
    "dataset_stats.py": "{data}",
    "float32_gemm.py": "--reps 1 --rows 1",
    "linear_route.py": "--pair {pair} --dtype bfloat16 --processes 2 --reps 1 --rows 1,2 --context 4 --out {out}",
    "online_speedup.py": "--pair {pair} --prompt hello --policy static:2 --policy mcsd:2,1 --limit 1 --repeats 1 "
                         "--max-new-tokens 4 --dtype float32 --device cpu --draft-quant int8 --self-draft int8 "
                         "--multi-level static:1/static:2 --multi-level-quant int8 --out {out}",
    "replay_speed.py": "--tokens 2000 --tokens-per-prompt 100",
    "step_drift.py": "--pair {pair} --dtype float32 --processes 2 --reps 1 --rows 1,2 --context 4",
    "stopping_headroom.py": "--data {data} --split test --out {tmp}/headroom",
    "theorem1_check.py": "--pair {pair} --limit 1 --seeds 1 --max-new-tokens 4 --dtype float32 --out {out}",
    "train_throughput.py": "--rows 256 --hidden-size 16 --batch-size 64 --epochs 1 --device cpu --families disco_ffn "
                           "--repeats 1 --json {out}",
    # llama.cpp itself is not installed here: a stand-in server answers its HTTP API (see below).
    "llamacpp_speculative.py": "--data {data} --split test --limit 2 --settings {tmp}/llamacpp.json "
                               "--server {tmp}/llama-server --draft-gguf {tmp}/draft.gguf --target-gguf {tmp}/target.gguf "
                               "--max-new-tokens 25 --repeats 1 --threads 1 --out {out}",
}
#: Scripts whose smoke run is a test elsewhere (test file, test name).
SMOKE_ELSEWHERE = {
    "batch_throughput.py": ("test_batch_schedule.py", "test_batch_throughput_benchmark_runs"),
    "stopping_ceiling.py": ("test_stopping_ceiling.py", "test_the_benchmark_writes_feature_aurocs_and_validation_tuned_shapes"),
    "multi_level.py": ("test_benchmarks.py", "test_multi_level_tunes_a_stack_and_online_speedup_predicts_it"),
    # vLLM runs in its own venv: marked `vllm` (make test-vllm), skipped without it (below).
    "vllm_serving.py": ("test_benchmarks.py", "test_vllm_serving_smoke_run"),
}


def test_every_benchmark_has_a_smoke_run():
    missing = [s for s in SCRIPTS if s not in SMOKE and s not in SMOKE_ELSEWHERE]
    assert not missing, f"benchmarks without a smoke run: {missing} (add one to SMOKE in {Path(__file__).name})"
    assert not (set(SMOKE) | set(SMOKE_ELSEWHERE)) - set(SCRIPTS), "smoke runs of scripts that are gone"
    for script, (test_file, test_name) in SMOKE_ELSEWHERE.items():
        text = (REPO / "tests" / test_file).read_text()
        assert f"def {test_name}(" in text and script.removesuffix(".py") in text, f"{script}: {test_file}::{test_name}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, capsys):
    assert run_script(BENCH / script, ["--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def _llamacpp_inputs(tmp: Path, pair_dir: Path) -> None:
    """A stand-in llama-server, two GGUF placeholders, and a llamacpp.json from `specstop export --for llamacpp`."""
    from _fake_llama_server import install as install_fake_llama_server
    from _usage_fixtures import usage_fixtures

    from specstop.cli import main

    install_fake_llama_server(tmp)
    for name in ("draft.gguf", "target.gguf"):
        (tmp / name).write_bytes(b"GGUF")
    fx = usage_fixtures(tmp / "fx", pair_dir)
    assert main(["export", "--tuned", str(fx.tuned), "--out", str(tmp), "--for", "llamacpp"]) == 0


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smoke_run(script, tiny_pair_dir, synth_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # scripts that write next to their outputs write here
    old_threads = torch.get_num_threads()
    if script == "llamacpp_speculative.py":
        _llamacpp_inputs(tmp_path, tiny_pair_dir)
    out = tmp_path / "out.json"
    args = SMOKE[script].format(pair=tiny_pair_dir, data=synth_dir, out=out, tmp=tmp_path).split()
    try:
        assert run_script(BENCH / script, args) == 0
    finally:
        torch.set_num_threads(old_threads)
    if "{out}" in SMOKE[script]:
        assert json.loads(out.read_text()), f"{script} wrote nothing to --out"
    if script == "compiled_draft_step.py":  # in float32 the compiled step is the same model, token for token
        results = json.loads(out.read_text())["results"]
        assert set(results) == {"none", "int8"} and all(r["same_tokens"] for r in results.values())
        assert all(len(r["eager"]) == len(r["compiled"]) == 2 and r["compiled_over_eager"] > 0 for r in results.values())
    if script == "linear_route.py":  # every route that applies, per process, one and two rows
        from specstop.pair.fast_paths import route_applies

        procs = json.loads(out.read_text())["processes"]
        routes = {r for r in ("linear", "mv", "pad2", "packed") if route_applies(r, torch.bfloat16)}
        assert len(procs) == 2 and all({k.split()[1] for k in p["steps"]} == routes for p in procs)
        assert all(v[0] > 0 for p in procs for v in p["steps"].values())
    if script == "llamacpp_speculative.py":
        record = json.loads(out.read_text())
        options = json.loads((tmp_path / "llamacpp.json").read_text())["options"]
        assert options and set(record["summary"]) == {"target", "default", *options}
        for name in ("default", *options):  # the stand-in accepts half of each round's drafts, rounded down
            flags = record["settings"]["options"][name]["flags"] if name in options else ["--spec-draft-n-max", "3"]
            n_max = int(flags[flags.index("--spec-draft-n-max") + 1])
            assert record["summary"][name]["draft_acceptance"] == pytest.approx((n_max // 2) / n_max, abs=0.02), name
            assert record["summary"][name]["speedup_vs_target"] > 0
        assert set(record["predicted_speedup"]) == set(options)
        # every drafting configuration flips the stand-in's last token (24 of 25), at its top-2 gap
        assert {(d["configuration"], d["prompt"]) for d in record["differences"]} == {
            (n, p) for n in ("default", *options) for p in (0, 1)}
        assert all(d["token"] == 24 and d["top2_logit_gap"] == pytest.approx(0.5) for d in record["differences"])


def _docstring_commands(script: str) -> list[str]:
    """``python benchmarks/X.py ...`` lines of a script's docstring, continuations joined (synopses
    with ``[--flag]`` left out)."""
    import ast

    lines = (ast.get_docstring(ast.parse((BENCH / script).read_text())) or "").splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].strip().startswith("python benchmarks/"):
            i += 1
            continue
        command = lines[i].strip()
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        out.append(command)
        i += 1
    return [c for c in out if "[" not in c]


@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_examples_parse(script):
    for command in _docstring_commands(script):
        argv = command_argv(command)
        target = re.sub(r"^benchmarks/", "", argv[1])
        assert (BENCH / target).is_file(), f"{script}: {command} names a script that is not there"
        parse_script(BENCH / target, argv[2:])


VLLM_VENV = Path(os.environ.get("SPECSTOP_VLLM_VENV") or REPO / ".venv-vllm")
needs_vllm = pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").is_file(),
                                reason=f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` (vLLM's CPU build in its own venv)")


def _serving_rows(record: dict, may_not_draft: tuple = ()) -> dict:
    """``{(method, B): summary row}``; every row's greedy outputs equal vLLM's without speculation, and every
    speculative method drafted and had drafts accepted (except the ``(method, B)`` in ``may_not_draft``)."""
    rows = {}
    for name, by_b in record["summary"].items():
        for b, row in by_b.items():
            assert row["identical"] == row["prompts"], (name, b, row["differing"])
            assert row["tok_s"]["median"] > 0 and row["speedup"] > 0, (name, b)
            if name != "no_spec" and (name, int(b)) not in may_not_draft:
                assert row["spec"]["drafts"] > 0 and row["spec"]["accepted_tokens"] > 0, (name, b, row["spec"])
            rows[name, int(b)] = row
    return rows


def test_vllm_serving_reads_the_k_each_method_runs_and_its_full_batch_steps():
    """The serving benchmark's step table: the K vLLM's runner drafts at B rows per method, a run's decode
    steps split into those with all B rows and the tail of rows that finished early, and the report's
    words for how requests decoded."""
    import runpy

    bench = runpy.run_path(str(BENCH / "vllm_serving.py"))
    sched = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3,
                                    "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 3, 1], [4, 8, 0]]}}
    assert [bench["runner_k"](sched, b) for b in (1, 2, 3, 4, 8)] == [3, 1, 1, 0, 0]
    assert bench["runner_k"]({"speculative_config": None}, 4) == 0
    assert bench["runner_k"]({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, 8) == 2
    assert bench["runner_k"]({"speculative_config": {"method": "custom_class"}}, 1) is None
    table = bench["_step_table"]([(0.5, 2, False), (0.2, 2, True), (0.3, 2, True), (0.1, 1, True)])
    assert table == {"prefill": {"n": 1, "seconds": 0.5, "median_s": 0.5},
                     "2": {"n": 2, "seconds": pytest.approx(0.5), "median_s": pytest.approx(0.25)},
                     "1": {"n": 1, "seconds": 0.1, "median_s": 0.1}}
    row = bench["_steps_row"]([{"steps": table}, {"steps": {"2": {"n": 3, "seconds": 0.9, "median_s": 0.3}}}], 2)
    assert row["full_steps"] == 5 and row["partial_steps"] == 1
    assert row["full_median_s"] == pytest.approx(0.275) and row["partial_share"] == pytest.approx(0.1 / 1.5)
    assert bench["_steps_row"]([{"steps": None}], 2) is None
    assert bench["_decoding_words"]({"temperature": 0.0}) == "greedy"
    assert bench["_decoding_words"]({"temperature": 0.7, "top_p": 0.9}) == "sampled at T=0.7, top-p 0.9 (a seed per request)"


def test_vllm_serving_runner_methods_keep_the_files_per_batch_caps():
    """A runner option of ``--engines`` with per-batch caps (``export --for vllm`` writes them where the tuned
    schedule drafts less) runs with those caps, and its label says so; a proposer option's caps are not the
    runner's."""
    import runpy

    bench = runpy.run_path(str(BENCH / "vllm_serving.py"))
    ranges = [[1, 3, 4], [4, 8, 1]]
    runner = {"worker_cls": "W", "speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                                        "num_speculative_tokens_per_batch_size": ranges}}
    caps, words = bench["_runner_caps"](runner)
    assert caps == ranges and words == ", the file's per-batch cap B 1-3: 4, B 4-8: 1"
    proposer = {"speculative_config": {"method": "custom_class", "num_speculative_tokens_per_batch_size": ranges}}
    assert bench["_runner_caps"](proposer) == (None, "") and bench["_runner_caps"](None) == (None, "")


@pytest.mark.vllm
@needs_vllm
def test_vllm_serving_smoke_run(tmp_path, monkeypatch):
    """--smoke: a tiny pair vLLM serves, no speculation / vLLM's draft model / a batch schedule / specstop's
    proposer and specstop's stop in vLLM's runner with a confidence rule (both also with an int4 draft), at B = 1
    and 2; lossless, vLLM's
    counters show each method's drafts. The runner runs without its speculation gate: on the tiny pair the gate
    may measure that drafting does not pay and skip it for a whole short request (tests/test_vllm_engine.py
    checks the gate)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    assert run_script(BENCH / "vllm_serving.py", ["--smoke", "--no-speculation-gate", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [m["name"] for m in record["methods"]] == ["no_spec", "draft_k2", "schedule", "specstop_confidence",
                                                      "specstop_confidence_int4", "runner_confidence",
                                                      "runner_confidence_int4"]
    rows = _serving_rows(record, may_not_draft=(("specstop_confidence", 2), ("specstop_confidence_int4", 2),
                                                ("runner_confidence", 2), ("runner_confidence_int4", 2)))
    assert set(rows) == {(m["name"], b) for m in record["methods"] for b in (1, 2)}
    assert rows["draft_k2", 1]["draft_len"] == rows["draft_k2", 2]["draft_len"] == 2
    assert rows["schedule", 1]["draft_len"] == 2 and 1 <= rows["schedule", 2]["draft_len"] < 1.5  # schedule 1:2,2:1
    for name in ("specstop_confidence", "specstop_confidence_int4"):
        assert 1 <= rows[name, 1]["draft_len"] <= 4  # SL_max 4
        # --proposer-schedule 1:4,2:0: drafts only once a request runs alone
        assert rows[name, 2]["spec"]["drafts"] < rows[name, 1]["spec"]["drafts"]
        costs = record["engine_costs"][name][0]
        assert costs["draft_per_token"]["1"] > 0 and all(v > 0 for v in costs["target_step"].values())
    # specstop's stop in vLLM's own runner: batched rounds, drafts of the policy's lengths (SL_max 4)
    for name in ("runner_confidence", "runner_confidence_int4"):
        assert 1 <= rows[name, 1]["draft_len"] <= 4
        assert rows[name, 2]["spec"]["drafts"] < rows[name, 1]["spec"]["drafts"]
        stats = record["runner_stats"][name][0]
        assert stats["rounds"] > 0 and stats["settings"] == {"greedy": "confidence:0.4"}
    assert stats["draft_quant"]["scheme"] == "int4" and stats["draft_quant"]["layers"] > 0
    assert record["versions"]["vllm"] and record["versions"]["torch"] and record["host"]["cpu_model"]
    assert set(record["reference"]) == {"1", "2"}  # no_spec's top-2 logprobs, for the gap where outputs differ
    assert len(record["runs"]) == 7 * 2 and not record["errors"]
    for (name, b), row in rows.items():  # every engine step timed: decode steps with all B rows, the tail apart
        steps = row["steps"]
        assert steps["full_steps"] > 0 and steps["full_median_s"] > 0 and 0 <= steps["partial_share"] < 1, (name, b)
    # the host's speed, timed before every vLLM process (--smoke: one per pass) and after the last
    probes, settings = record["host_probe"]["probes"], record["settings"]
    assert settings["process"] == "pass" and len(probes) == settings["passes"] + 1
    assert probes[0]["when"].startswith("before pass 1 no_spec+") and probes[-1]["when"] == "after the last engine"
    assert all(p["stream_ms"] > 0 and p["gemm_ms"] > 0 for p in probes)
    assert set(record["host_probe"]["drift"]) == {"stream_ms", "gemm_ms"}
    table = out.with_suffix(".md").read_text()
    assert "| specstop_confidence | 2 |" in table and "None: every method's greedy output equals" in table
    assert "Decode steps as the engine timed them" in table and "## Host speed" in table


@pytest.mark.vllm
@needs_vllm
def test_vllm_serving_runs_exported_settings(tmp_path, monkeypatch):
    """--engines (a `specstop export --for hf,vllm` folder) by option name, its draft name replaced by
    --draft; static_opt's K joins the grid; --policy runs a learned export through specstop's proposer."""
    from _usage_fixtures import usage_fixtures

    from specstop.cli import main
    from specstop.testing import save_vllm_tiny_pair

    monkeypatch.chdir(tmp_path)
    pair = save_vllm_tiny_pair(tmp_path / "pair")
    fx = usage_fixtures(tmp_path / "fx", pair)  # static K 3, heuristic, confidence 0.4 / SL_max 6, disco_ffn, a schedule
    engines = tmp_path / "engines"
    assert main(["export", "--tuned", str(fx.tuned), "--out", str(engines), "--for", "vllm",
                 "--draft-name", "elsewhere/draft", "--target-name", str(pair / "target")]) == 0
    out = tmp_path / "out.json"
    args = ["--draft", str(pair / "draft"), "--target", str(pair / "target"), "--engines", str(engines),
            "--policy", str(fx.export), "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1,2",
            "--k-grid", "2", "--passes", "1", "--repeats", "1", "--warmup-tokens", "4", "--process", "pass",
            "--dtype", "float32", "--kv-cache-gib", "1", "--out", str(out),
            "--methods", "draft_k3,schedule,specstop_confidence,specstop_learned,specstop_heuristic"]
    assert run_script(BENCH / "vllm_serving.py", args) == 0
    record = json.loads(out.read_text())
    methods = {m["name"]: m for m in record["methods"]}
    assert list(methods) == ["no_spec", "draft_k3", "schedule", "specstop_confidence", "specstop_learned",
                             "specstop_heuristic"]
    assert methods["draft_k3"]["source"] == "--engines static_opt"
    assert methods["schedule"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 3, 3], [4, 4, 2]]
    for name in ("schedule", "specstop_confidence", "specstop_heuristic"):
        assert methods[name]["draft_replaced"] == {"from": "elsewhere/draft", "to": str(pair / "draft")}, name
    assert methods["specstop_confidence"]["additional_config"]["specstop"]["policy"]["threshold"] == 0.4
    assert methods["specstop_learned"]["additional_config"]["specstop"] == {"draft": str(pair / "draft"),
                                                                            "policy": str(fx.export.resolve())}
    rows = _serving_rows(record)
    assert rows["draft_k3", 1]["draft_len"] == rows["schedule", 1]["draft_len"] == 3  # schedule: K 3 below B = 4
    assert 1 <= rows["specstop_confidence", 1]["draft_len"] <= 6 and 1 <= rows["specstop_learned", 1]["draft_len"] <= 6


def test_online_speedup_runs_a_quantized_drafts_export_on_that_draft_and_multi_level(tiny_pair_dir, tmp_path,
                                                                                     monkeypatch):
    """An export trained with the int8 draft runs on the run's int8 copy of the pair (and is refused without
    --draft-quant int8); --multi-level runs the stack and records each level's counters per run."""
    import runpy
    import shutil

    from _usage_fixtures import usage_fixtures

    monkeypatch.chdir(tmp_path)
    fx = usage_fixtures(tmp_path / "fx", tiny_pair_dir)
    export = tmp_path / "export_int8"
    shutil.copytree(fx.export, export)
    config = json.loads((export / "config.json").read_text())
    config["pair"]["draft"]["quant"] = "int8"  # as `specstop export` writes it for data made with --draft-quant int8
    (export / "config.json").write_text(json.dumps(config))
    base = ["--pair", str(tiny_pair_dir), "--prompt", "hello", "--limit", "1", "--repeats", "1", "--max-new-tokens", "4",
            "--dtype", "float32", "--device", "cpu", "--policy", str(export)]
    policy_pair = runpy.run_path(str(BENCH / "online_speedup.py"))["policy_pair"]
    with pytest.raises(SystemExit, match="trained with the int8 draft: add --draft-quant int8 to run it"):
        policy_pair(str(export), "the float pair", [])
    assert policy_pair("static:2", "the float pair", []) == (None, "the float pair")
    with pytest.raises(SystemExit, match="'int4' is not a draft of this run .have: int8; add it with --draft-quant"):
        runpy.run_path(str(BENCH / "online_speedup.py"))["named_paths"](["int4=x.json"], "--quant-cost", [("int8", 0)])
    out = tmp_path / "out.json"
    old_threads = torch.get_num_threads()
    try:
        assert run_script(BENCH / "online_speedup.py", [*base, "--draft-quant", "int8", "--multi-level",
                                                        "static:2/confidence:0.5", "--multi-level-quant", "int8",
                                                        "--quant-cost", f"int8={fx.cost}", "--cost", str(fx.cost),
                                                        "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(old_threads)
    record = json.loads(out.read_text())
    rows = record["summary"]["rows"]
    (quantized,) = [row for name, row in rows.items() if name.startswith("ours[int8] export")]
    assert quantized["predicted_decode_speedup"] > 0  # priced by --quant-cost, the int8 draft's own cost model
    assert not any(name.startswith("ours export") for name in rows)  # never on the float draft it was not made for
    (name, runs), = record["levels"].items()
    assert name == "ours[int8 / self-int8] static:2/confidence:0.5" and name in rows
    assert [lv["name"] for lv in runs[0]] == ["level0", "level1", "target"] and runs[0][2]["rounds"] > 0


def _online_speedup(tmp_path, monkeypatch, args: list[str]) -> dict:
    """Run online_speedup.py with ``args`` (and ``--out``) in ``tmp_path``; the record it wrote."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    old_threads = torch.get_num_threads()
    try:
        assert run_script(BENCH / "online_speedup.py", [*args, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(old_threads)
    return json.loads(out.read_text())


def test_online_speedup_runs_an_export_pinned_and_with_live_repricing(tiny_pair_dir, tmp_path, monkeypatch):
    """--live: an export with price-free statistics runs pinned (as tuned, what the replay predicts) and again
    with live re-pricing; the live run's record (its prices against the table, its switches) is written."""
    from _usage_fixtures import usage_fixtures

    fx = usage_fixtures(tmp_path / "fx", tiny_pair_dir)
    rows = _online_speedup(tmp_path, monkeypatch, [
        "--pair", str(tiny_pair_dir), "--prompt", "hello", "--prompt", "def f(x):", "--repeats", "1",
        "--max-new-tokens", "12", "--dtype", "float32", "--device", "cpu", "--policy", str(fx.export),
        "--policy", "static:2", "--live", "--cost", str(fx.cost)])["summary"]["rows"]
    assert {"ours export disco_ffn", "ours export disco_ffn (live)", "ours static:2"} <= set(rows)
    assert "ours static:2 (live)" not in rows  # a rule string carries no statistics
    live = rows["ours export disco_ffn (live)"]
    assert set(live["live"]) == {"scales", "rounds", "policy", "switches"} and live["live"]["rounds"] > 0
    assert live["greedy_diffs"] == 0 and live["live_predicted_decode_speedup"] > 0


def test_multi_level_tunes_a_stack_and_online_speedup_predicts_it(tiny_pair_dir, tmp_path, monkeypatch):
    """multi_level.py times the stack's forwards, records and ranks every combination of the grids; its
    level_cost.json then prices online_speedup's --multi-level runs by their exact replay on the run's prompts,
    which counts the decoder's own target rounds (float32, greedy)."""
    monkeypatch.chdir(tmp_path)
    levels = tmp_path / "levels"
    old_threads = torch.get_num_threads()
    try:
        assert run_script(BENCH / "multi_level.py", [
            "--pair", str(tiny_pair_dir), "--prompt", "hello", "--prompt", "a longer prompt here", "--limit", "2",
            "--max-new-tokens", "6", "--quant", "int8", "--bottom", "static:1,confidence:0.5", "--top", "static:2,static:3",
            "--budget-s", "0", "--dtype", "float32", "--device", "cpu", "--out", str(levels)]) == 0
        tuned = json.loads((levels / "tuned.json").read_text())
        assert len(tuned["ranked"]) == 4 and tuned["best"] == tuned["ranked"][0]["policies"]
        assert tuned["ranked"][0]["speedup"] >= tuned["ranked"][-1]["speedup"] > 0
        assert json.loads((levels / "level_cost.json").read_text())["names"] == ["int8 draft", "self-int8", "target"]
        out = tmp_path / "online.json"
        assert run_script(BENCH / "online_speedup.py", [
            "--pair", str(tiny_pair_dir), "--prompt", "hello", "--limit", "1", "--repeats", "1", "--max-new-tokens", "6",
            "--dtype", "float32", "--device", "cpu", "--policy", "static:2", "--multi-level", "/".join(tuned["best"]),
            "--multi-level-quant", "int8", "--multi-level-cost", str(levels / "level_cost.json"), "--retime",
            "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(old_threads)
    record = json.loads(out.read_text())
    (name, runs), = record["levels"].items()
    row = record["summary"]["rows"][name]
    assert row["replay_same_prompts"] > 0 and row["greedy_diffs"] == 0
    # --retime: the calibration's prediction is kept beside the one priced by forwards timed in the run
    calibrated = record["calibrated_summary"]["rows"][name]
    assert calibrated["replay_same_prompts"] > 0 and calibrated["replay_tokens_per_round"] == row["replay_tokens_per_round"]
    rounds = runs[0][2]["rounds"]  # the decoder's target rounds; the replay's tokens per target round match them
    assert row["replay_tokens_per_round"] == pytest.approx(len(record["runs"][name][0][0]["tokens"]) / rounds)


def test_online_speedup_runs_each_chain_again_with_a_compiled_draft(tiny_pair_dir, tmp_path, monkeypatch):
    """--compile-draft: every rule policy again on the float draft and on each --draft-quant copy with its
    steps compiled, priced by --quant-cost NAME+compiled=COST, the output the target's own (float32)."""
    from _usage_fixtures import usage_fixtures

    monkeypatch.chdir(tmp_path)
    fx = usage_fixtures(tmp_path / "fx", tiny_pair_dir)
    out = tmp_path / "out.json"
    old_threads = torch.get_num_threads()
    try:
        assert run_script(BENCH / "online_speedup.py", [
            "--pair", str(tiny_pair_dir), "--prompt", "hello", "--limit", "1", "--repeats", "1", "--max-new-tokens",
            "6", "--dtype", "float32", "--device", "cpu", "--policy", "static:2", "--draft-quant", "int8",
            "--compile-draft", "--quant-cost", f"int8+compiled={fx.cost}", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(old_threads)
    record = json.loads(out.read_text())
    rows = record["summary"]["rows"]
    assert {"ours static:2", "ours[int8] static:2", "ours[compiled] static:2", "ours[int8+compiled] static:2"} <= set(rows)
    assert rows["ours[int8+compiled] static:2"]["predicted_decode_speedup"] > 0
    assert not record["summary"]["flips"]  # every method's greedy output is the target's


def test_online_speedup_samples_with_a_seed_per_repeat(tiny_pair_dir, tmp_path, monkeypatch):
    """--temperature / --top-p: every method samples (chains, trees, multi-level), repeat r with seed r,
    and the summary pools the seeds and shows their range; HF's greedy-only methods are refused."""
    monkeypatch.chdir(tmp_path)
    base = ["--pair", str(tiny_pair_dir), "--prompt", "hello", "--prompt", "a longer prompt here", "--limit", "2",
            "--repeats", "3", "--max-new-tokens", "6", "--dtype", "float32", "--device", "cpu", "--temperature", "0.8",
            "--top-p", "0.9", "--policy", "static:2", "--policy", "mcsd:2,1"]
    import runpy

    main = runpy.run_path(str(BENCH / "online_speedup.py"))["main"]
    with pytest.raises(SystemExit, match="--hf-default: HF's methods here decode greedily"):
        main([*base, "--hf-default"])
    out = tmp_path / "sampled.json"
    old_threads = torch.get_num_threads()
    try:
        assert run_script(BENCH / "online_speedup.py", [*base, "--multi-level", "static:2/static:2",
                                                        "--multi-level-quant", "int8", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(old_threads)
    record = json.loads(out.read_text())
    assert record["decoding"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    summary = record["summary"]
    assert summary["sampled"] and summary["all_identical"] is None
    for name in ("ours static:2", "ours mcsd:2,1", "ours[int8 / self-int8] static:2/static:2"):
        med, lo, hi = summary["rows"][name]["decode_speedup_seeds"]
        assert lo <= med <= hi
    runs = record["runs"]["ours static:2"]
    assert len({tuple(r["tokens"]) for rs in runs for r in rs}) > 2  # the seeds sample different responses
