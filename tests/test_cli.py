"""CLI smoke tests: the entry point, fetch-pair and info."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specstop.cli import main


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "specstop.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("fetch-pair", "info", "generate", "train"):
        assert cmd in out.stdout


def test_fetch_pair_help(capsys):
    try:
        main(["fetch-pair", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-1.5b" in out and "--delete-gguf" in out


def test_info_json(tiny_pair_dir, capsys):
    assert main(["info", "--pair", str(tiny_pair_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "tiny"
    assert info["draft"]["architecture"] == info["target"]["architecture"] == "Qwen2ForCausalLM"
    assert info["tokenizer"]["len"] == info["vocab"]["shared_vocab_size"] == 259
    assert info["tokenizer"]["chat_template"] is True and info["tokenizer"]["eos_token"] == "<|im_end|>"
    assert info["vocab"]["target_logits_size"] == 275 and info["draft"]["dtype"] == "float32"
    assert info["cache"]["local"] is True


def test_info_text_and_bf16(tiny_pair_dir, capsys):
    assert main(["info", "--draft", str(tiny_pair_dir / "draft"), "--target", str(tiny_pair_dir / "target"),
                 "--dtype", "bfloat16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in out and "bfloat16" in out and "chat template: yes" in out and "cache:" in out


def test_info_bad_pair_is_a_clear_error(tmp_path, capsys):
    assert main(["info", "--pair", "no-such-pair"]) == 2
    assert "unknown pair 'no-such-pair'" in capsys.readouterr().err


# ---- one spelling per flag (issue 16) -----------------------------------------------------------


def test_generate_help_uses_the_common_spellings(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--data DIR" in text and "--feature-topk" in text and "--top-k" in text
    assert "--out" not in text and "--topk " not in text  # old spellings are hidden aliases
    assert "(default: None)" not in text  # config-driven flags show no fake default


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: validation)" in text and "default: 4,8,12,16,20)" in text


def test_old_spellings_still_work_with_a_note(capsys):
    from specstop.data_gen.cli import build_config
    from specstop.log import setup_logging

    setup_logging()  # the note is a log line of the `specstop` logger (as `specstop.cli.main` sets it up)
    cfg, _ = build_config(["--out", "x", "--topk", "7", "--prompts", "builtin:mbpp"])
    assert cfg.out == "x" and cfg.labels.topk_k == 7
    err = capsys.readouterr().err
    assert "--out is deprecated; use --data" in err and "--topk is deprecated; use --feature-topk" in err


def test_train_accepts_data_dir_shorthand(tmp_path):
    from specstop.train.cli import with_data_shorthand

    (tmp_path / "manifest.json").write_text("{}")
    assert with_data_shorthand(["--config", "c.yaml", "--data", str(tmp_path)]) == [
        "--config", "c.yaml", "--data.data_dir", str(tmp_path)]
    # a data-module class path is left to LightningCLI
    assert with_data_shorthand(["--data", "specstop.train.data.PredictorDataModule"])[0] == "--data"


def test_checkpoint_is_name_equals_path_or_path():
    from specstop.cli_flags import split_checkpoint_arg

    assert split_checkpoint_arg("disco=runs/a/best.ckpt") == ("disco", "runs/a/best.ckpt")
    assert split_checkpoint_arg("runs/a=b/best.ckpt") == (None, "runs/a=b/best.ckpt")
    assert split_checkpoint_arg("best.ckpt") == (None, "best.ckpt")
