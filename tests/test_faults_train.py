"""Fault injection, training: a run resumed from a checkpoint trains exactly like one that was
never interrupted, and training refuses damaged or mixed data."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from specstop.errors import UserError


def _trainer(root, max_epochs: int, **kw) -> L.Trainer:
    return L.Trainer(
        max_epochs=max_epochs, default_root_dir=str(root), logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", deterministic=True, num_sanity_val_steps=0, **kw,
    )


def _fit(data_dir, root, max_epochs: int, ckpt_path=None, save_every_epoch: bool = False):
    from specstop.train.data import PredictorDataModule
    from specstop.train.module import PredictorModule

    L.seed_everything(0)
    dm = PredictorDataModule(str(data_dir), batch_size=64, max_rows=640)
    model = PredictorModule("disco_ffn", {}, label="accept_expected", k=dm.k, lr=3e-3)
    callbacks = []
    if save_every_epoch:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, filename="e{epoch}"))
    trainer = _trainer(root, max_epochs, callbacks=callbacks, enable_checkpointing=save_every_epoch)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model


def test_resumed_training_shuffles_like_an_uninterrupted_run(synth_dir, tmp_path):
    full = _fit(synth_dir, tmp_path / "full", 3)
    _fit(synth_dir, tmp_path / "part", 1, save_every_epoch=True)  # "killed" after epoch 1
    ckpt = next((tmp_path / "part").glob("e*.ckpt"))
    resumed = _fit(synth_dir, tmp_path / "resumed", 3, ckpt_path=ckpt)
    for (name, a), b in zip(full.predictor.state_dict().items(), resumed.predictor.state_dict().values()):
        assert torch.equal(a, b), name


def test_shuffle_counter_is_saved_without_a_trainer(synth_dir):
    from specstop.train.data import PredictorDataModule

    dm = PredictorDataModule(str(synth_dir))
    assert [dm.next_shuffle_epoch() for _ in range(3)] == [0, 1, 2]
    state = dm.state_dict()
    dm2 = PredictorDataModule(str(synth_dir))
    dm2.load_state_dict(state)
    assert dm2.next_shuffle_epoch() == 3


def test_training_refuses_a_damaged_shard(tmp_path):
    from specstop.testing import write_synthetic_dataset
    from specstop.train.data import PredictorDataModule

    d = write_synthetic_dataset(tmp_path / "d", {"train": 4, "validation": 2, "test": 2}, 16, shards_per_split=2)
    arrow = next((d / "shards" / "train-00001" / "tokens").glob("*.arrow"))
    raw = bytearray(arrow.read_bytes())
    for i in range(4):  # four flipped bytes, same size
        raw[len(raw) // 2 + i] ^= 0xFF
    arrow.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"shard train-00001: file tokens/.*does not match its recorded sha256"):
        PredictorDataModule(str(d))


def test_training_refuses_a_missing_shard(tmp_path):
    import shutil

    from specstop.data_gen.storage import load_table
    from specstop.testing import write_synthetic_dataset

    d = write_synthetic_dataset(tmp_path / "d", {"train": 4, "validation": 2, "test": 2}, 16, shards_per_split=2)
    man = json.loads((d / "manifest.json").read_text())
    man["shards"] = sorted(p.name for p in (d / "shards").iterdir())
    (d / "manifest.json").write_text(json.dumps(man))
    shutil.rmtree(d / "shards" / "train-00001")
    with pytest.raises(UserError, match="shard train-00001: the shard folder is missing"):
        load_table(d, "tokens", "train")  # any reader, not only train


def test_resume_from_another_pairs_checkpoint_is_refused(synth_dir, tmp_path):
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint
    from specstop.train.cli import check_resume_pair
    from specstop.train.data import PredictorDataModule

    dm = PredictorDataModule(str(synth_dir))
    other = json.loads(json.dumps(dm.manifest["pair"]))
    other["draft"]["weights_sha256"] = "files-v1:" + "1" * 64
    dm.manifest["pair"]["draft"]["weights_sha256"] = "files-v1:" + "2" * 64
    ck = save_predictor_checkpoint(tmp_path / "c.ckpt", build_predictor("disco_ffn"), {"dataset": {"pair": other}})
    with pytest.raises(UserError, match="another model pair.*draft weights"):
        check_resume_pair(str(ck), dm)


def test_low_memory_during_training_is_one_line(synth_dir, tmp_path, monkeypatch, capsys):
    """The monitor thread stops `specstop train` inside Lightning's loop with the memory message."""
    from pathlib import Path

    from specstop import memory
    from specstop.cli import main

    real = memory.memory_status
    calls = {"n": 0}

    def low_soon():
        calls["n"] += 1
        status = real()
        return memory.MemoryStatus(1 << 20, status.total, status.rss) if calls["n"] > 3 else status

    monkeypatch.setattr(memory, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(memory, "memory_status", low_soon)
    monkeypatch.chdir(tmp_path)
    cfg = Path(__file__).resolve().parents[1] / "configs" / "train" / "disco_ffn.yaml"
    rc = main(["train", "--config", str(cfg), "--data.data_dir", str(synth_dir), "--trainer.max_epochs", "1000",
               "--data.batch_size", "64", "--trainer.enable_progress_bar", "false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = next(ln for ln in err.splitlines() if ": error: " in ln)
    assert line.startswith("specstop train: error: stopped in specstop train before the machine runs out of memory")
    assert "data.batch_size" in line and "Traceback" not in err
