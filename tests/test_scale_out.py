"""Scale-out that runs as documented, checked on CPU with 2 processes (gloo): rank-local devices,
sharded generation merged by the last worker, DDP training from `specstop train`, DeepSpeed
checkpoint folders, memory-mapped hidden states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from specstop.cli import main
from specstop.data_gen import ownership, storage
from specstop.data_gen.schema import TABLES
from specstop.testing import save_tiny_pair

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---- devices ---------------------------------------------------------------------------------


def test_each_rank_gets_its_own_gpu(monkeypatch):
    from specstop.distributed import rank_local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_local_device("cuda") == "cuda"  # no launcher: as given
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_local_device("cuda") == "cuda:1" and chosen == [1]
    assert rank_local_device(None) == "cuda:1"
    assert rank_local_device("cpu") == "cpu" and rank_local_device("cuda:0") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="2 CUDA device"):
        rank_local_device("cuda")


def test_requested_processes_reads_config_and_flags(tmp_path):
    from specstop.train.launch import requested_processes

    cfg = tmp_path / "t.yaml"
    cfg.write_text("trainer:\n  accelerator: cpu\n  devices: 2\n")
    assert requested_processes(["--config", str(cfg)]) == 2
    assert requested_processes(["--config", str(cfg), "--trainer.devices", "1"]) == 1
    assert requested_processes(["--config", str(cfg), "--trainer.devices=[0, 1, 2]", "--trainer.num_nodes", "2"]) == 6
    assert requested_processes(["--trainer.accelerator", "cpu"]) == 1  # devices auto on CPU: one process


# ---- sharded generation ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    pair_dir = save_tiny_pair(root / "pair", seed=3)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write function number {i} in Python."}) + "\n"
                               for i in range(9)))
    conf = {
        "pair": str(pair_dir), "dtype": "float32", "device": "cpu", "prompts_per_shard": 2,
        "prompts": {"source": str(prompts), "template": "field:prompt", "id_field": "id", "split_scheme": "random",
                    "split_sizes": {"train": 5, "validation": 2, "test": 2}},
        "generation": {"max_new_tokens": 10, "batch_size": 2},
        "labels": {"hidden_states": True, "rollouts": {"length": 4, "splits": ["test"]}},
    }
    path = root / "gen.yaml"
    path.write_text(yaml.safe_dump(conf))
    return root, path


def _flat(column) -> np.ndarray:
    """Every number of a (possibly ragged, nested) column, in order."""
    parts = [np.ravel(np.asarray(v, dtype=np.float64)) for v in column]
    return np.concatenate(parts) if parts else np.zeros(0)


def test_torchrun_generation_equals_a_single_run(gen_setup):
    root, cfg = gen_setup
    single, sharded = root / "single", root / "sharded"
    assert main(["generate", "--config", str(cfg), "--data", str(single), "--no-progress"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
         "-m", "specstop.cli", "generate", "--config", str(cfg), "--data", str(sharded), "--no-progress"],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No --merge: the last worker to finish wrote the manifest and the card.
    assert (sharded / "manifest.json").is_file() and (sharded / "README.md").is_file()
    a, b = storage.read_manifest(single), storage.read_manifest(sharded)
    assert a["splits"] == b["splits"]
    for table in TABLES:
        ta, tb = storage.load_table(single, table), storage.load_table(sharded, table)
        assert ta["prompt_id"] == tb["prompt_id"], table
        for col in ta.column_names:
            if "float" in str(ta.features[col]):  # labels and features: same math, other batch shapes
                np.testing.assert_allclose(_flat(ta[col]), _flat(tb[col]), atol=1e-3, err_msg=f"{table}.{col}")
            else:
                assert ta[col] == tb[col], f"{table}.{col}"


# ---- training --------------------------------------------------------------------------------


def test_ddp_training_from_specstop_train(synth_dir, tmp_path):
    """`specstop train --trainer.devices 2` on CPU: Lightning relaunches the command per rank (gloo)."""
    root = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "specstop.cli", "train", "--config", "configs/train/disco_ffn.yaml",
         "--data", str(synth_dir), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
         "--trainer.strategy", "ddp", "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root),
         "--data.init_args.batch_size", "64", "--trainer.enable_progress_bar", "false"],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "MEMBER: 2/2" in out  # rank 1 ran in its own process
    assert "LightningCLI's args parameter" not in out
    metrics = json.loads(next(root.rglob("metrics.json")).read_text())
    from specstop.models.checkpoint import load_predictor

    predictor, _ = load_predictor(metrics["best_checkpoint"])
    assert predictor.family == "disco_ffn"


def test_deepspeed_checkpoint_folder_is_converted_once(tmp_path, monkeypatch):
    """A ZeRO checkpoint folder loads through Lightning's converter into <name>.fp32.ckpt."""
    import lightning.pytorch.utilities.deepspeed as ds_utils

    from specstop.models import build_predictor
    from specstop.models.checkpoint import load_predictor, save_predictor_checkpoint

    predictor = build_predictor("disco_ffn", k=10)
    folder = tmp_path / "best-00.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    calls = []

    def fake_convert(checkpoint_dir, output_file, tag=None):  # what Lightning writes: the client state + weights
        calls.append(checkpoint_dir)
        save_predictor_checkpoint(output_file, predictor)

    monkeypatch.setattr(ds_utils, "convert_zero_checkpoint_to_fp32_state_dict", fake_convert)
    loaded, meta = load_predictor(folder)
    assert (tmp_path / "best-00.fp32.ckpt").is_file() and meta["family"] == "disco_ffn"
    for a, b in zip(loaded.state_dict().values(), predictor.state_dict().values()):
        assert torch.equal(a, b)
    load_predictor(folder)
    assert len(calls) == 1  # converted once, then reused


def test_deepspeed_folder_without_deepspeed_names_the_install(tmp_path):
    pytest.importorskip("lightning")
    try:
        import deepspeed  # noqa: F401

        pytest.skip("deepspeed is installed")
    except ImportError:
        pass
    from specstop.models.checkpoint import load_predictor

    folder = tmp_path / "best.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    with pytest.raises(ValueError, match="specstop\\[distributed\\]"):
        load_predictor(folder)


# ---- memory-mapped hidden states -------------------------------------------------------------


def test_hidden_states_stay_memory_mapped(synth_dir):
    from specstop.data_gen.storage import load_arrays, load_column_chunks
    from specstop.models import build_predictor
    from specstop.train.data import PredictorDataModule
    from specstop.train.mapped import MappedRows

    chunks = load_column_chunks(synth_dir, "tokens", "train", "hidden")
    assert chunks and all(not c.flags.owndata and not c.flags.writeable for c in chunks)  # views of the mapped file
    dm = PredictorDataModule(str(synth_dir), batch_size=32)
    spec = build_predictor("specdecpp_resnet", hidden_size=dm.hidden_size, depth=1).feature_spec
    dm.configure(spec, "accept_prob")
    split = dm.load_split("train")
    assert isinstance(split.columns["hidden"], MappedRows)
    dense = load_arrays(synth_dir, split.table, "train", columns=["hidden"])["hidden"]
    idx = torch.tensor([0, len(dense) - 1, 5, 3])
    assert torch.equal(split.features(spec, idx), torch.from_numpy(dense[idx.numpy()]).float())
    assert torch.equal(split.features(spec, None), torch.from_numpy(np.array(dense, dtype=np.float32)))


def test_small_splits_give_every_rank_a_batch(synth_dir, monkeypatch):
    """Fewer rows than ranks x batch: batches shrink so no rank has an empty loader (DDP)."""
    from specstop.models import build_predictor
    from specstop.train.data import PredictorDataModule, TensorBatches

    dm = PredictorDataModule(str(synth_dir), batch_size=32, max_rows=50)
    spec = build_predictor("disco_ffn", k=dm.k).feature_spec
    dm.configure(spec, "accept_prob")
    split = dm.load_split("validation")
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(TensorBatches, "_rank_world", staticmethod(lambda rank=rank: (rank, 2)))
        for train in (True, False):
            batches = list(TensorBatches(split, spec, 4096, shuffle=train, seed=0, drop_uneven=train))
            assert len(batches) >= 1, (rank, train)
            if not train:
                seen += [len(b[1]) for b in batches]
    assert sum(seen) == len(split)  # evaluation still covers every row exactly once


def test_a_starting_worker_leaves_other_workers_temporary_shards_alone(tmp_path):
    """Worker 1 starting while worker 0 is mid-write must not delete worker 0's .tmp folder."""
    root = storage.shards_root(tmp_path)
    (root / ".tmp-train-00000-abcd1234").mkdir(parents=True)  # worker 0, writing
    (root / ".tmp-train-00001-ffff0000").mkdir()  # worker 1's own leftover from a crash
    removed = ownership.clean_partial_shards(tmp_path, ["train-00001"])
    assert removed == [".tmp-train-00001-ffff0000"]
    assert (root / ".tmp-train-00000-abcd1234").is_dir()


def test_sweep_trains_multi_device_points_in_their_own_process(synth_dir, tmp_path):
    base = yaml.safe_load((REPO / "configs/train/disco_ffn.yaml").read_text())
    base["trainer"] = {**(base.get("trainer") or {}), "accelerator": "cpu", "devices": 2, "strategy": "ddp"}
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(yaml.safe_dump(base))
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "specstop.cli", "sweep", "--config", str(cfg), "--data", str(synth_dir),
         "--w-rej", "1", "--max-epochs", "1", "--out", str(out), "--no-baselines"],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "MEMBER: 2/2" in log and log.count("sweep: training") == 1
    rows = json.loads((out / "sweep.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert len(rows) == 1 and Path(rows[0]["checkpoint"]).is_file()


def test_each_rank_asks_for_its_own_gpu_on_real_processes(tmp_path):
    """torchrun starts two real processes (gloo, nothing mocked): each reads its own LOCAL_RANK, and the
    rule gives rank r ``cuda:r`` where the node has that GPU and refuses, in one line naming LOCAL_RANK
    and the device count, where it has not (here, on CPUs: no GPU for either rank); ``cpu`` stays ``cpu``."""
    import json
    import subprocess
    import sys

    from _snippets import REPO

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29533", str(REPO / "scripts" / "rank_device_check.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(r["local_rank"] for r in ranks) == [0, 1] and all(r["cpu"] == "cpu" for r in ranks)
    for r in ranks:
        if r["local_rank"] < r["visible_gpus"]:
            assert r["cuda"] == f"cuda:{r['local_rank']}" and r["allocated_on"] == r["cuda"]
        else:
            assert r["cuda"].startswith(f"refused: LOCAL_RANK={r['local_rank']} but this node has "
                                        f"{r['visible_gpus']} CUDA device(s)")
