"""Multi-level speculation from the command line: ``decode --levels`` runs a stack and its output is the
target's greedy output; ``tune --levels`` writes the jointly tuned rules as a versioned stack entry,
``export --policy levels`` carries them and ``decode --policy EXPORT`` rebuilds the same stack."""

from __future__ import annotations

import json

import pytest
import torch

from specstop.cli import main

PROMPT = ["--prompt", "def add(a, b):", "--max-new-tokens", "12", "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="module")
def middle_dir(tiny_pair_dir, tmp_path_factory):
    """A level model between the tiny pair's draft and target: a noisy copy of the target, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_multilevel import _noisy_copy

    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target", dtype=torch.float32)
    out = tmp_path_factory.mktemp("levels") / "middle"
    _noisy_copy(target, 0.05, seed=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_pair_dir / "target").save_pretrained(out)
    return out


def _target_greedy(pair_dir, prompt_ids: list[int], n: int) -> list[int]:
    from specstop.pair import load_named_pair

    pair = load_named_pair(str(pair_dir), dtype="float32", device="cpu")
    padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
    with torch.no_grad():
        out = pair.target.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                   suppress_tokens=padded or None)
    return out[0, len(prompt_ids):].tolist()


def _decode(capsys, *argv) -> dict:
    assert main(["decode", *argv, *PROMPT, "--json"]) == 0
    captured = capsys.readouterr()
    return {**json.loads(captured.out.strip().splitlines()[-1]), "stderr": captured.err}


def test_decode_runs_a_stack_and_emits_the_targets_greedy_tokens(tiny_pair_dir, middle_dir, capsys):
    got = _decode(capsys, "--pair", str(tiny_pair_dir), "--levels", str(middle_dir), "--policy", "static:2,static:4")
    assert got["token_ids"] == _target_greedy(tiny_pair_dir, got["prompt_ids"], 12)
    levels = got["counters"]["levels"]
    assert len(levels) == 3 and levels[1]["drafted"] > 0 and levels[2]["drafted"] > 0
    assert got["counters"]["policy"] == "static:2 / static:4"
    assert str(middle_dir) in got["stderr"]  # it says which models the stack runs


@pytest.mark.parametrize("argv, message", [
    (["--policy", "static:2"], "needs 2 rules, bottom first"),
    (["--policy", "static:2,nonsense:1"], "unknown policy 'nonsense:1'"),
    (["--policy", "static:2,static:4", "--static-cache"], "--static-cache does not apply to a multi-level stack"),
    (["--policy", "static:2,static:4", "--levels", "/nowhere/model"], "level model /nowhere/model"),
])
def test_bad_stacks_are_one_line(tiny_pair_dir, middle_dir, capsys, argv, message):
    levels = [] if "--levels" in argv else ["--levels", str(middle_dir)]
    assert main(["decode", "--pair", str(tiny_pair_dir), *levels, *argv, *PROMPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.fixture(scope="module")
def tuned_stack(tiny_pair_dir, middle_dir, tmp_path_factory):
    """A tuned.json written by `specstop tune --levels` on a dataset whose manifest names the tiny pair."""
    from specstop.data_gen.storage import read_manifest
    from specstop.jsonio import atomic_write_json
    from specstop.pair import load_named_pair
    from specstop.testing import write_synthetic_dataset

    root = tmp_path_factory.mktemp("tune")
    data = write_synthetic_dataset(root / "data", {"train": 4, "validation": 4, "test": 2}, 16, vocab_size=60,
                                   with_rollouts=True)
    manifest = read_manifest(data)
    manifest["pair"] = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu").to_dict()
    atomic_write_json(data / "manifest.json", manifest)  # the dataset of this pair: tune stacks the levels on it
    tuned = root / "tuned.json"
    assert main(["tune", "--data", str(data), "--cost-model", "llama2-7b-70b",
                 "--out", str(tuned), "--sl-max-grid", "4,8", "--levels", str(middle_dir), "--level-grid", "static:1,static:3",
                 "--level-grid", "static:2,static:5", "--level-prompts", "2", "--level-budget-s", "0"]) == 0
    return tuned


def test_tune_export_decode_round_trip_the_stacks_rules(tiny_pair_dir, middle_dir, tuned_stack, tmp_path, capsys):
    entry = json.loads(tuned_stack.read_text())["levels"]
    assert entry["schema_version"] == 1 and entry["models"] == [str(middle_dir)]
    assert entry["policies"] == entry["ranked"][0]["policies"] and len(entry["ranked"]) == 4
    assert entry["policies"][0] in ("static:1", "static:3") and entry["policies"][1] in ("static:2", "static:5")
    out = tmp_path / "export"
    assert main(["export", "--tuned", str(tuned_stack), "--policy", "levels", "--out", str(out)]) == 0
    assert "multi-level stack" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["levels"]["policies"] == entry["policies"] and config["levels"]["models"] == entry["models"]
    got = _decode(capsys, "--pair", str(tiny_pair_dir), "--policy", str(out))
    assert got["counters"]["policy"] == " / ".join(entry["policies"])
    assert got["token_ids"] == _target_greedy(tiny_pair_dir, got["prompt_ids"], 12)
    # --levels replaces the export's models (the same count), e.g. with another copy of the middle model.
    got = _decode(capsys, "--pair", str(tiny_pair_dir), "--policy", str(out), "--levels", str(tiny_pair_dir / "target"))
    assert got["counters"]["policy"] == " / ".join(entry["policies"])
    assert got["token_ids"] == _target_greedy(tiny_pair_dir, got["prompt_ids"], 12)
    both = f"{middle_dir},{tiny_pair_dir / 'target'}"
    capsys.readouterr()
    assert main(["decode", "--pair", str(tiny_pair_dir), "--policy", str(out), "--levels", both, *PROMPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--levels names 2 models" in err[0] and str(middle_dir) in err[0]


def test_a_stack_entry_of_another_version_is_refused_in_one_line(tiny_pair_dir, tuned_stack, tmp_path, capsys):
    doc = json.loads(tuned_stack.read_text())
    doc["levels"]["schema_version"] = 2
    bad = tmp_path / "tuned.json"
    bad.write_text(json.dumps(doc))
    assert main(["export", "--tuned", str(bad), "--policy", "levels", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not schema_version 1" in err[0] and "specstop tune --levels" in err[0]
    assert not (tmp_path / "x").exists()


def test_tune_refuses_level_settings_without_levels(tmp_path, capsys):
    assert main(["tune", "--data", str(tmp_path), "--cost-model", "llama2-7b-70b", "--out", str(tmp_path / "t.json"),
                 "--level-grid", "static:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add --levels MODELS" in err[0]
