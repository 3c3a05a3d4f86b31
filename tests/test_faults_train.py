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


def _approx_equal(a, b, path="") -> None:
    """Nested metrics (dicts, lists, numbers) equal within float tolerance."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _approx_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _approx_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6, nan_ok=True), path
    else:
        assert a == b, path


def test_interrupted_train_resumes_from_its_last_epoch(synth_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C in epoch 5: last.ckpt holds epoch 4 (not the best one, epoch 3) and the hint says so; the
    command it prints finishes the run with the metrics and weights of a run that was never interrupted."""
    import re
    import shlex
    import signal
    from pathlib import Path

    from lightning.pytorch.callbacks import Callback

    from specstop.cli import main
    from specstop.train import cli as train_cli

    cfg = Path(__file__).resolve().parents[1] / "configs" / "train" / "disco_ffn.yaml"
    args = ["train", "--config", str(cfg), "--data", str(synth_dir), "--trainer.max_epochs", "6",
            "--data.batch_size", "512", "--model.init_args.lr", "1.0", "--trainer.enable_progress_bar", "false"]
    monkeypatch.chdir(tmp_path)

    def best_of(out: str) -> Path:
        return Path(out.split("best checkpoint: ")[1].splitlines()[0])

    assert main([*args, "--trainer.default_root_dir", "full"]) == 0
    full_best = best_of(capsys.readouterr().out)
    full_last = torch.load(full_best.parent / "last.ckpt", map_location="cpu", weights_only=True)
    assert full_last["epoch"] == 5
    steps_per_epoch = full_last["global_step"] // 6
    # At this learning rate validation AUROC peaks in epoch 3: the run must remember its best across the resume.
    assert re.search(r"best-(\d+)-", full_best.name).group(1) == "03"

    class CtrlC(Callback):  # the user presses Ctrl-C during the second batch of epoch 5
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 5 and batch_idx == 1:
                raise KeyboardInterrupt

    plain = train_cli.SpecstopCLI.before_fit

    def before_fit(self):
        plain(self)
        self.trainer.callbacks.append(CtrlC())

    monkeypatch.setattr(train_cli.SpecstopCLI, "before_fit", before_fit)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning shuts down and exits after Ctrl-C
            main([*args, "--trainer.default_root_dir", "part"])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-C while it shuts down
    monkeypatch.setattr(train_cli.SpecstopCLI, "before_fit", plain)
    hint = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("specstop train: interrupted"))
    said = re.search(r"epoch (\d+) \(step (\d+)\) is saved in (\S+): resume with `(.+)`$", hint)
    assert said, hint
    saved = torch.load(said.group(3), map_location="cpu", weights_only=True)
    assert Path(said.group(3)).name == "last.ckpt"
    # The hint tells the truth: the file holds the last finished epoch, not the best or the current one.
    assert saved["epoch"] == int(said.group(1)) == 4
    assert saved["global_step"] == int(said.group(2)) == 5 * steps_per_epoch

    cmd = shlex.split(said.group(4))
    assert cmd[:2] == ["specstop", "train"] and cmd[-2:] == ["--ckpt_path", str(Path(said.group(3)).resolve())]
    assert main(cmd[1:]) == 0
    resumed_best = best_of(capsys.readouterr().out)
    full_metrics = json.loads((full_best.parent / "metrics.json").read_text())
    resumed_metrics = json.loads((resumed_best.parent / "metrics.json").read_text())
    assert resumed_metrics["best_score"] == pytest.approx(full_metrics["best_score"], abs=1e-6)
    assert re.search(r"best-(\d+)-", resumed_best.name).group(1) == re.search(r"best-(\d+)-", full_best.name).group(1)
    _approx_equal(full_metrics["validation"], resumed_metrics["validation"])
    resumed_last = torch.load(next(Path("part").rglob("version_1/**/last.ckpt")), map_location="cpu", weights_only=True)
    assert resumed_last["epoch"] == 5 and resumed_last["global_step"] == full_last["global_step"]
    for name, a in full_last["state_dict"].items():
        assert torch.allclose(a, resumed_last["state_dict"][name], atol=1e-6), name
