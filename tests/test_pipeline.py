"""`specstop pipeline` end to end on a tiny random pair: outputs, reuse, resume after interruption."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from specstop.cli import main
from specstop.data_gen.storage import complete_shards
from specstop.testing import save_tiny_pair

PROMPTS = [
    "Write a function to add two numbers.",
    "Write a function that reverses a string.",
    "Write a function to find the maximum of a list.",
    "Write a function that checks whether a number is prime.",
    "Write a function to count vowels in a string.",
    "Write a function that returns the n-th Fibonacci number.",
    "Write a function to sort a list of tuples by the second item.",
    "Write a function that removes duplicates from a list.",
    "Write a function to compute the factorial of n.",
    "Write a function that merges two dictionaries.",
]


@pytest.fixture(scope="module")
def pipeline_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    pair_dir = save_tiny_pair(root / "pair", seed=1)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    cfg = {
        "run_dir": str(root / "run"),
        "pair": str(pair_dir),
        "dtype": "float32",
        "device": "cpu",
        "data": {
            "prompts_per_shard": 2,
            "prompts": {
                "source": str(prompts),
                "template": "field:prompt",
                "id_field": "id",
                "split_scheme": "random",
                "split_sizes": {"train": 4, "validation": 3, "test": 3},
            },
            "generation": {"max_new_tokens": 16, "batch_size": 4},
            "labels": {
                "hidden_states": True,
                "mixing": {"draws": 1, "splits": ["train", "validation"]},
                "rollouts": {"length": 20, "splits": ["validation", "test"]},
            },
        },
        "families": [
            {"name": "disco_ffn", "config": "configs/train/disco_ffn.yaml", "args": ["--trainer.max_epochs", "2"]},
            {"name": "specdecpp_resnet", "config": "configs/train/specdecpp_resnet.yaml",
             "args": ["--trainer.max_epochs", "2"]},
        ],
        "cost_model": "calibrate",
        "calibrate_budget": 0.5,
        # Millisecond forwards of tiny models jitter with any other load; the table check has its own tests.
        "force_cost": True,
        "online_prompts": 2,
        "online_repeats": 1,
        "online_max_new_tokens": 12,
        "export_policy": "disco_ffn",  # a learned policy: exercises export from a real training checkpoint
    }
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _stages(run_dir) -> dict:
    rep = json.loads((run_dir / "report.json").read_text())
    return {s["name"]: s["status"] for s in rep["stages"]}


def test_pipeline_runs_reuses_and_resumes(pipeline_config, tmp_path, monkeypatch):
    import pathlib

    path, cfg = pipeline_config
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])  # configs/train/*.yaml are repo-relative
    run_dir = pathlib.Path(cfg["run_dir"])

    assert main(["pipeline", "--config", str(path)]) == 0
    for rel in ("report.md", "report.json", "tuned.json", "eval/report.md", "eval/report.json",
                "export/config.json", "online.json", "data/manifest.json"):
        assert (run_dir / rel).is_file(), rel
    first = _stages(run_dir)
    assert set(first.values()) == {"ran"}, first
    online = json.loads((run_dir / "online.json").read_text())
    assert online["all_identical"], online  # our decoder reproduced the target's greedy output
    names = list(online["rows"])
    assert names[0] == "target" and any(n.startswith("export") for n in names), names
    assert any(n.startswith("static_opt") for n in names) and "HF assisted (defaults)" in names, names
    exp = next(r for n, r in online["rows"].items() if n.startswith("export"))
    lo_hi = exp["decode_speedup"]
    assert lo_hi[1] <= lo_hi[0] <= lo_hi[2] and "predicted_decode_speedup" in exp and "predicted_round_seconds" in exp
    # The replay of the same prompts at the online budget (12 < the dataset's) has the decoder's rounds.
    for n, r in online["rows"].items():
        if n != "target" and not n.startswith("HF"):
            assert r["rounds_as_replayed"] == online["prompts"] and r["replay_same_prompts"] > 0, (n, r)
    report = json.loads((run_dir / "report.json").read_text())
    assert "oracle" in report["eval"]["rows"]
    cost = json.loads((run_dir / "cost.json").read_text())
    assert cost["provenance"] == "measured" and cost["target_by_k"], cost
    md = (run_dir / "report.md").read_text()
    assert "measured on this machine" in md.splitlines()[2] and "Online check" in md

    # Unchanged rerun: everything reused.
    assert main(["pipeline", "--config", str(path)]) == 0
    assert set(_stages(run_dir).values()) == {"reused"}

    # An interrupted data stage: its record is gone and one shard was half-written.
    (run_dir / "stages" / "data.json").unlink()
    shards = complete_shards(run_dir / "data")
    victim = shards[-1]
    (victim / "_COMPLETE.json").unlink()
    kept = {p.name: p.stat().st_mtime for p in shards[:-1]}
    assert main(["pipeline", "--config", str(path)]) == 0
    st = _stages(run_dir)
    assert st["data"] == "ran"
    # Finished shards were kept as they were; only the broken one was regenerated.
    after = {p.name: p.stat().st_mtime for p in complete_shards(run_dir / "data")}
    assert all(after[n] == t for n, t in kept.items())
    assert victim.name in after

    # Changing one family's training config reruns that family and what reads it, nothing else.
    cfg2 = dict(cfg)
    cfg2["families"] = [dict(f) for f in cfg["families"]]
    cfg2["families"][0]["args"] = ["--trainer.max_epochs", "3"]
    path2 = tmp_path / "pipeline2.yaml"
    path2.write_text(yaml.safe_dump(cfg2))
    assert main(["pipeline", "--config", str(path2)]) == 0
    st = _stages(run_dir)
    assert st["data"] == "reused" and st["train_specdecpp_resnet"] == "reused"
    assert st["train_disco_ffn"] == "ran" and st["tune"] == "ran" and st["eval"] == "ran"
    shutil.rmtree(run_dir / "train", ignore_errors=True)


def test_pipeline_trains_on_two_devices_without_rerunning_itself(pipeline_config, tmp_path):
    """A family with --trainer.devices 2 (CPU, gloo) trains in its own process: the pipeline runs once."""
    import os
    import pathlib
    import subprocess
    import sys

    _, cfg = pipeline_config
    repo = pathlib.Path(__file__).resolve().parents[1]
    cfg = dict(cfg, run_dir=str(tmp_path / "run"), online_prompts=0, export_policy="best")
    cfg["families"] = [{"name": "disco_ffn", "config": "configs/train/disco_ffn.yaml",
                        "args": ["--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                                 "--trainer.strategy", "ddp", "--trainer.enable_progress_bar", "false"]}]
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "specstop.cli", "pipeline", "--config", str(path)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "MEMBER: 2/2" in log  # two ranks trained
    assert log.count("stage data") == 1 and log.count("stage tune") == 1, log[-3000:]  # ... and nothing else twice
    assert (tmp_path / "run" / "export" / "config.json").is_file()


def test_pipeline_stops_cleanly_on_low_memory_and_resumes(pipeline_config, tmp_path, monkeypatch, capsys):
    """Memory running low in the data stage: a one-line message naming the stage, the measured memory
    and what to reduce (never the OOM killer); the rerun resumes. Each stage frees its models."""
    import gc
    import pathlib
    import weakref

    from specstop import memory
    from specstop.pair import registry

    _, cfg = pipeline_config
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    cfg = {**cfg, "run_dir": str(tmp_path / "run"), "families": cfg["families"][:1], "online_prompts": 0}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    real_status, real_load = memory.memory_status, registry.load_named_pair
    calls = {"n": 0}

    def low_after_a_few_batches():
        calls["n"] += 1
        status = real_status()
        return memory.MemoryStatus(10 << 20, status.total, status.rss) if calls["n"] > 3 else status

    monkeypatch.setattr(memory, "POLL_SECONDS", 60.0)  # only the cooperative per-batch checks
    monkeypatch.setattr(memory, "memory_status", low_after_a_few_batches)
    assert main(["pipeline", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ": error: " in ln)
    assert line.startswith("specstop pipeline: error: stopped in specstop pipeline > pipeline stage 'data' > specstop generate before")
    assert "RSS" in line and "--batch-size" in line and "rerun the same command to resume" in line
    kept = complete_shards(pathlib.Path(cfg["run_dir"]) / "data", strict=False)
    assert kept and not (tmp_path / "run" / "data" / "manifest.json").exists()

    models = []

    def tracked(*a, **kw):
        pair = real_load(*a, **kw)
        models.extend(weakref.ref(m) for m in (pair.draft, pair.target))
        return pair

    monkeypatch.setattr(memory, "memory_status", real_status)
    monkeypatch.setattr(registry, "load_named_pair", tracked)
    monkeypatch.setattr("specstop.pair.load_named_pair", tracked)
    assert main(["pipeline", "--config", str(path)]) == 0
    assert _stages(tmp_path / "run")["data"] == "ran"
    assert models  # the data stage loaded the pair ...
    gc.collect()
    assert all(ref() is None for ref in models)  # ... and nothing holds it after the stage


def test_pipeline_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: x\npair: y\nfamilys: []\n")
    assert main(["pipeline", "--config", str(bad)]) == 2


def test_every_shipped_pipeline_config_parses():
    import pathlib

    from specstop.pair.registry import KNOWN_PAIRS
    from specstop.pipeline import PipelineConfig

    root = pathlib.Path(__file__).resolve().parents[1] / "configs" / "pipelines"
    paths = sorted(root.glob("*.yaml"))
    assert paths
    for p in paths:
        cfg = PipelineConfig.from_yaml(p)
        assert cfg.pair in KNOWN_PAIRS or cfg.draft, p
        assert cfg.families, p
        for fam in cfg.families:
            assert (root.parents[1] / fam.config).is_file(), (p, fam.config)


def test_pipeline_tunes_the_policy_per_decoding_setting(pipeline_config, tmp_path, monkeypatch):
    """also_decoding: a dataset per extra setting, the run's predictor tuned on each, one export carrying
    every setting's numbers; a bad entry stops before any stage in one line."""
    import pathlib

    from specstop.export.runtime import StoppingPolicy
    from specstop.probs import DecodingConfig

    _, base = pipeline_config
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    cfg = {**base, "run_dir": str(tmp_path / "run"), "families": base["families"][:1], "cost_model": "llama2-7b-70b",
           "online_prompts": 0, "also_decoding": [{"temperature": 1.0}]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "--config", str(path)]) == 0
    run_dir = tmp_path / "run"
    st = _stages(run_dir)
    assert st["data_t1"] == "ran" and st["tune_t1"] == "ran" and st["export"] == "ran", st
    hot = json.loads((run_dir / "data_t1" / "manifest.json").read_text())["generation"]
    assert hot["temperature"] == 1.0 and hot["max_new_tokens"] == 16
    tuned = json.loads((run_dir / "tuned_t1.json").read_text())
    assert tuned["checkpoints"] == json.loads((run_dir / "tuned.json").read_text())["checkpoints"]
    export = json.loads((run_dir / "export" / "config.json").read_text())
    assert [e["decoding"]["temperature"] for e in export["by_decoding"]] == [0.0, 1.0]
    policy = StoppingPolicy.from_pretrained(run_dir / "export")
    assert policy.configure(DecodingConfig(temperature=1.0)).spec.to_dict() == export["by_decoding"][1]["policy"]
    md = (run_dir / "report.md").read_text()
    assert "## The exported policy per decoding setting" in md and "| T=1 | disco_ffn(" in md
    assert main(["pipeline", "--config", str(path)]) == 0
    assert set(_stages(run_dir).values()) == {"reused"}
    # A stage that runs again (its record lost) reruns its readers, though no configuration changed.
    (run_dir / "stages" / "data_t1.json").unlink()
    assert main(["pipeline", "--config", str(path)]) == 0
    st = _stages(run_dir)
    assert st["data_t1"] == "ran" and st["tune_t1"] == "ran" and st["export"] == "ran", st
    assert st["data"] == st["tune"] == st["eval"] == "reused", st

    bad = tmp_path / "bad.yaml"
    for entry, message in (({"temp": 1.0}, "also_decoding[0] must map some of temperature, top_k, top_p"),
                           ({"temperature": 0}, "also_decoding[0] (greedy) repeats the data section's setting")):
        bad.write_text(yaml.safe_dump({**cfg, "also_decoding": [entry]}))
        with pytest.raises(Exception, match=re.escape(message)):
            from specstop.pipeline import PipelineConfig

            PipelineConfig.from_yaml(bad)


def test_a_rerun_with_changed_label_settings_names_the_run_folder_not_a_data_flag(pipeline_config, tmp_path,
                                                                                  monkeypatch, capsys):
    """The data stage's folder is RUN/data, chosen by the pipeline: a rerun whose data section would mix
    label settings into it is refused with advice about the run (its config, --run-dir, or deleting
    RUN/data), never `--data`, which the pipeline does not take as a folder. Its shards are kept."""
    import pathlib

    _, cfg = pipeline_config
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    run_dir = tmp_path / "run"
    # No families and a cost file that is not there: the run stops right after its data stage.
    cfg = {**cfg, "run_dir": str(run_dir), "families": [], "online_prompts": 0,
           "cost_model": str(tmp_path / "missing_cost.json")}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "--config", str(path)]) == 2
    shards = {p.name: p.stat().st_mtime for p in complete_shards(run_dir / "data")}
    assert shards
    capsys.readouterr()
    assert main(["pipeline", "--config", str(path), "--data.labels.rollouts.length", "10"]) == 2
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln)
    assert "other label settings" in line and "--data folder" not in line, line
    assert f"give a new run_dir (--run-dir), or delete {run_dir / 'data'} to make that data again" in line, line
    assert {p.name: p.stat().st_mtime for p in complete_shards(run_dir / "data")} == shards


def test_pipeline_levels_tunes_and_exports_the_stack(pipeline_config, tmp_path, monkeypatch):
    """levels: the tune stage also tunes the stack's rules jointly and RUN/export_levels carries them."""
    import pathlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_multilevel import _noisy_copy

    _, base = pipeline_config
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    middle = tmp_path / "middle"
    target = pathlib.Path(base["pair"]) / "target"
    _noisy_copy(AutoModelForCausalLM.from_pretrained(target), 0.05, seed=1).save_pretrained(middle)
    AutoTokenizer.from_pretrained(target).save_pretrained(middle)
    cfg = {**base, "run_dir": str(tmp_path / "run"), "families": [], "cost_model": "llama2-7b-70b",
           "online_prompts": 0, "export_policy": "best", "levels": str(middle),
           "tune_args": ["--level-grid", "static:1,static:2", "--level-grid", "static:3", "--level-prompts", "2",
                         "--level-budget-s", "0"]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "--config", str(path)]) == 0
    run_dir = tmp_path / "run"
    assert _stages(run_dir)["export_levels"] == "ran"
    entry = json.loads((run_dir / "tuned.json").read_text())["levels"]
    assert entry["models"] == [str(middle)] and entry["policies"][1] == "static:3"
    exported = json.loads((run_dir / "export_levels" / "config.json").read_text())["levels"]
    assert exported["policies"] == entry["policies"] and exported["models"] == entry["models"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg, "levels": " , "}))
    with pytest.raises(Exception, match="levels is empty"):
        from specstop.pipeline import PipelineConfig

        PipelineConfig.from_yaml(bad)
