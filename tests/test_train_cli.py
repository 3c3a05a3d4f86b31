"""``specstop train`` / ``specstop sweep`` through LightningCLI, and every shipped config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning")

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "train").glob("*.yaml"))


def _args(cfg: Path, data_dir, pair_dir) -> list[str]:
    args = ["--config", str(cfg), "--data.data_dir", str(data_dir), "--trainer.logger", "false"]
    if "online" in cfg.read_text() or "OnlineMixing" in cfg.read_text():
        args += ["--model.draft", str(pair_dir / "draft"), "--model.draft_dtype", "float32"]
    return args


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"disco_ffn", "disco_ffn_hard", "disco_ffn_state", "specdecpp_resnet", "mcsd_hidden_mlp", "mcsd_topk_mlp",
            "specdecpp_online_mixing", "specdecpp_deepspeed"} <= names  # fmt: skip


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda p: p.stem)
def test_every_config_parses_and_instantiates(cfg, synth_dir, tiny_pair_dir, tmp_path, monkeypatch):
    from specstop.cli import UserError
    from specstop.train.cli import build_cli
    from specstop.train.module import PredictorModule

    monkeypatch.chdir(tmp_path)
    if "deepspeed" in cfg.read_text().split("strategy:")[-1].splitlines()[0]:
        if _has_deepspeed():
            pytest.skip("deepspeed is installed: its strategy needs GPUs to instantiate")
        with pytest.raises(UserError, match=r"pip install 'specstop\[distributed\]'"):
            build_cli(_args(cfg, synth_dir, tiny_pair_dir), run=False)
        return
    cli = build_cli(_args(cfg, synth_dir, tiny_pair_dir), run=False)
    assert isinstance(cli.model, PredictorModule)
    spec = cli.model.predictor.feature_spec
    if spec.needs_hidden:  # linked from the manifest / the draft, never written in the YAML
        assert spec.hidden_size in (16, 32)
    else:
        assert spec.k == 10


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def test_missing_deepspeed_message_via_specstop_cli(synth_dir, tiny_pair_dir, tmp_path, monkeypatch, capsys):
    from specstop.cli import main

    if _has_deepspeed():
        pytest.skip("deepspeed is installed here")
    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "specdecpp_deepspeed")
    rc = main(["train", *_args(cfg, synth_dir, tiny_pair_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'specstop[distributed]'" in err and "deepspeed" in err


def test_unknown_key_rejected(synth_dir, tmp_path, monkeypatch):
    from specstop.train.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "disco_ffn")
    with pytest.raises(SystemExit):
        build_cli(["--config", str(cfg), "--data.data_dir", str(synth_dir), "--model.init_args.nonsense", "1"], run=False)


def test_print_config(synth_dir, tmp_path, monkeypatch, capsys):
    from specstop.train.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "mcsd_topk_mlp")
    with pytest.raises(SystemExit) as ex:
        main(["--config", str(cfg), "--data.data_dir", str(synth_dir), "--print_config"])
    assert ex.value.code in (0, None)
    out = capsys.readouterr().out
    assert "family: mcsd_topk_mlp" in out and "class_path: specstop.train.data.PredictorDataModule" in out


def test_specstop_train_end_to_end(synth_dir, tmp_path, monkeypatch, capsys):
    from specstop.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "disco_ffn")
    rc = main(["train", "--config", str(cfg), "--data.data_dir", str(synth_dir), "--trainer.max_epochs", "1",
               "--data.batch_size", "512", "--trainer.enable_progress_bar", "false"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    best = Path(out.split("best checkpoint: ")[1].splitlines()[0])
    assert best.is_file() and best.suffix == ".ckpt"
    metrics = json.loads((best.parent / "metrics.json").read_text())
    val = metrics["validation"]
    assert {"auroc", "f1", "kl", "ece", "ap"} <= set(val)
    assert val["baselines"]["logistic_regression"]["auroc"] > 0.8
    assert len(val["baselines"]["static_sl"]) == 10 and val["on_tokens"]["cumprod_calibration"][0]["length"] == 1
    run_dir = best.parent.parent  # CSV and TensorBoard share one version folder
    assert (run_dir / "metrics.csv").is_file() and list(run_dir.glob("events.out.tfevents*"))
    from specstop.models.checkpoint import load_predictor

    predictor, meta = load_predictor(best)
    assert meta["family"] == "disco_ffn" and meta["dataset"]["pair"]["name"] == "synthetic"


def test_sweep_tiny_grid(synth_dir, tmp_path, monkeypatch):
    from specstop.pipeline import sweep

    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "specdecpp_resnet")
    args, _ = sweep.command().parse(["--config", str(cfg), "--data-dir", str(synth_dir), "--w-rej", "1,6", "--depth", "0",
                                     "--lr", "3e-3", "--max-epochs", "1", "--out", str(tmp_path / "sw"), "--no-baselines"])  # fmt: skip
    assert sweep.run(args) == 0
    rows = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [r["w_rej"] for r in rows] == [1.0, 6.0] and all(r["val_kl"] is not None for r in rows)
    md = (tmp_path / "sw" / "sweep.md").read_text()
    assert "| w_rej | D |" in md and "\n| 1 | 0 | 0.003 |" in md and "\n| 6 | 0 | 0.003 |" in md


@pytest.mark.parametrize("kind", ["folder", "json", "text", "missing"])
def test_ckpt_path_of_the_wrong_kind_is_one_line_before_any_epoch(kind, synth_dir, tmp_path, monkeypatch, capsys):
    """`--ckpt_path` names a training checkpoint file: a folder, a JSON file, a file torch cannot read or
    a missing path is refused in one line naming the flag, before the data is read."""
    from specstop.cli import main

    monkeypatch.chdir(tmp_path)
    target = {"folder": tmp_path / "ckpts", "json": tmp_path / "tuned.json", "text": tmp_path / "last.ckpt",
              "missing": tmp_path / "nowhere.ckpt"}[kind]
    if kind == "folder":
        target.mkdir()
    elif kind == "json":
        target.write_text("{}")
    elif kind == "text":
        target.write_text("not a checkpoint")
    cfg = next(p for p in CONFIGS if p.stem == "disco_ffn")
    rc = main(["train", "--config", str(cfg), "--data.data_dir", str(synth_dir), "--trainer.max_epochs", "1",
               "--trainer.logger", "false", "--ckpt_path", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("specstop train: error: --ckpt_path: ") and str(target) in line
    assert not (tmp_path / "runs" / "train").exists()  # refused before the run wrote anything


def test_ckpt_path_of_a_saved_epoch_still_resumes(synth_dir, tmp_path, monkeypatch, capsys):
    """The check on --ckpt_path reads the file as every checkpoint reader does: last.ckpt passes it."""
    from specstop.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = next(p for p in CONFIGS if p.stem == "disco_ffn")
    args = ["train", "--config", str(cfg), "--data.data_dir", str(synth_dir), "--data.batch_size", "512",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    assert main([*args, "--trainer.max_epochs", "1"]) == 0
    last = next(tmp_path.rglob("last.ckpt"))
    assert main([*args, "--trainer.max_epochs", "2", "--ckpt_path", str(last)]) == 0
