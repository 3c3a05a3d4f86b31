"""CLI smoke tests: the entry point, fetch-pair and info."""

from __future__ import annotations

import json
import subprocess
import sys

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
