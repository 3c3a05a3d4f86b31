"""Fault injection, bad input: every bad config, flag, prompt file or export edit is one line naming
the problem (never a traceback, never silently accepted), and a bug is never dressed up as one.

docs/errors.md lists each probe with its message; these tests pin them.
"""

from __future__ import annotations

import json
import logging
import math

import pytest

from specstop.cli import main
from specstop.errors import UserError


def one_line_error(capsys, rc: int, *fragments: str) -> str:
    """Assert ``rc`` is the user-error status and stderr is one error line (with the debug hint on it)."""
    err = capsys.readouterr().err
    # Log lines (ours, Lightning's "INFO: Seed set to 0") and progress bars are not error output.
    lines = [ln for ln in err.splitlines()
             if ln.strip() and not ln.startswith(("[specstop]", "INFO:", "Seed set to")) and "it/s]" not in ln]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("specstop ") and ": error: " in lines[0], err
    assert lines[0].endswith("(SPECSTOP_DEBUG=1 shows a traceback)"), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def _prompts(tmp_path, text: str, name: str = "p.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _generate(tmp_path, *extra: str) -> list[str]:
    return ["generate", "--pair", str(tmp_path / "no-pair-needed"), "--out", str(tmp_path / "ds"), "--no-progress", *extra]


# ------------------------------------------------------------------------------ the CLI itself
def test_bug_keeps_its_traceback_and_user_error_is_one_line(monkeypatch, capsys):
    from specstop.eval import eval_cli

    def bug(_args):
        raise ValueError("internal invariant broken")

    monkeypatch.setattr(eval_cli, "run", bug)
    with pytest.raises(ValueError, match="internal invariant"):  # not printed as a user error
        main(["eval", "--data", "x", "--tuned", "y", "--out", "z"])

    def user(_args):
        raise UserError("the thing you gave is wrong; give another")

    monkeypatch.setattr(eval_cli, "run", user)
    one_line_error(capsys, main(["eval", "--data", "x", "--tuned", "y", "--out", "z"]), "the thing you gave is wrong")
    monkeypatch.setenv("SPECSTOP_DEBUG", "1")
    with pytest.raises(UserError):
        main(["eval", "--data", "x", "--tuned", "y", "--out", "z"])


def test_logging_stays_in_our_namespace(monkeypatch, capsys):
    from specstop.eval import eval_cli

    root_handlers = list(logging.getLogger().handlers)
    monkeypatch.setattr(eval_cli, "run", lambda _a: logging.getLogger("specstop.x").info("ours") or 0)
    assert main(["eval", "--data", "x", "--tuned", "y", "--out", "z"]) == 0
    assert logging.getLogger().handlers == root_handlers  # the root logger is not taken over
    logging.getLogger("somelib").warning("theirs")
    err = capsys.readouterr().err
    assert "[specstop] ours" in err
    assert "[specstop] theirs" not in err


# ------------------------------------------------------------------------------ prompt files
@pytest.mark.parametrize(
    "text, fragments",
    [
        ("", ["is empty"]),
        ("\n\n", ["is empty"]),
        ('{"prompt": "a"}\n{"prompt": "b"\n', ["p.jsonl:2", "not valid JSON"]),
        ('{"prompt": "a"}\n[1, 2]\n', ["p.jsonl:2", "expected a JSON object"]),
        ('{"id": "x", "prompt": null}\n', ["prompt 'x'", "p.jsonl:1", "null, not text"]),
        ('{"id": "x", "prompt": ["a", "b"]}\n', ["prompt 'x'", "a list, not text"]),
        ('{"id": "x", "prompt": 42}\n', ["prompt 'x'", "a number (42), not text"]),
    ],
    ids=["empty", "blank", "malformed", "not-object", "null", "list", "number"],
)
def test_bad_prompt_files(tmp_path, capsys, text, fragments):
    p = _prompts(tmp_path, text)
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p))), *fragments)
    assert not (tmp_path / "ds").exists()  # a failed run leaves no output folder behind


def test_null_in_format_template_is_an_error(tmp_path):
    from specstop.prompts import PromptSetConfig, load_prompt_set

    p = _prompts(tmp_path, '{"id": "a", "q": "hi", "ctx": null}\n')
    with pytest.raises(UserError, match=r"prompt 'a' \(.*p.jsonl:1\).*null, not text"):
        load_prompt_set(PromptSetConfig(source=str(p), template="Q: {q}\n{ctx}", split_scheme="all:test"))


def test_negative_limit_is_refused_not_a_dropped_prompt(tmp_path, capsys):
    p = _prompts(tmp_path, "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p), "--limit", "-1")), "prompts.limit", ">= 0")


@pytest.mark.parametrize(
    "source, fragments",
    [
        ("builtin:nope", ["unknown builtin prompt set 'builtin:nope'", "builtin:mbpp"]),
        ("mbpp.jsonl", ["does not exist", "use `source: builtin:mbpp`"]),
    ],
)
def test_shipped_prompt_set_mistakes_are_one_line(tmp_path, monkeypatch, capsys, source, fragments):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", source)), *fragments)


def test_damaged_gzip_prompt_file_names_the_line(tmp_path, capsys):
    import gzip

    p = tmp_path / "p.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write('{"prompt": "a"}\n{"prompt": \n')
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p))), f"{p}:2", "not valid JSON")
    p.write_bytes(b"not gzip at all")
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p))), "not a readable gzip file")


@pytest.mark.parametrize("flag", ["--feature-topk", "--topk"])  # the new name and its deprecated alias
def test_renamed_flags_keep_their_range_checks(tmp_path, capsys, flag):
    p = _prompts(tmp_path, '{"prompt": "a"}\n')
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p), flag, "0")), "labels.topk_k must be >= 1")


# ------------------------------------------------------------------------------ configs
def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("generation:\n  max_new_tokens: 8\n   temperature: 0\n")
    line = one_line_error(capsys, main(["generate", "--config", str(y)]), f"{y}:3", "malformed YAML")
    assert "mapping values are not allowed" in line


@pytest.mark.parametrize(
    "yaml_text, fragments",
    [
        ("generation:\n  max_new_tokens: eight\n", ["'generation.max_new_tokens' must be an integer", "'eight'"]),
        ("generation:\n  max_new_tokens: 4.5\n", ["'generation.max_new_tokens' must be an integer", "4.5"]),
        ("generation:\n  temperature: hot\n", ["'generation.temperature' must be a number", "'hot'"]),
        ("labels:\n  hidden_states: maybe\n", ["'labels.hidden_states' must be true or false"]),
        ("labels:\n  mixing:\n    splits: train\n", ["'labels.mixing.splits' must be a list of strings"]),
        ("prompts:\n  split_sizes: {train: ten}\n", ["'prompts.split_sizes' must be a mapping of strings to integers"]),
        ("generation: 5\n", ["config section generation must be a mapping"]),
        ("- a\n- b\n", ["config section top level must be a mapping"]),
        ("generation:\n  temperature: -1\n", ["generation.temperature must be >= 0"]),
        ("generation:\n  top_p: 1.5\n", ["generation.top_p must be > 0 and <= 1"]),
        ("labels:\n  mixing:\n    rate: .nan\n", ["labels.mixing.rate must be >= 0 and <= 1", "nan"]),
        ("labels:\n  rollouts:\n    batch_size: 0\n", ["labels.rollouts.batch_size must be >= 1"]),
        ("dtype: float64\n", ["unknown dtype 'float64'"]),
    ],
)
def test_data_config_types_and_ranges(tmp_path, capsys, yaml_text, fragments):
    y = tmp_path / "c.yaml"
    y.write_text(yaml_text)
    one_line_error(capsys, main(["generate", "--config", str(y), "--prompts", "x.jsonl", "--out", "o"]), *fragments)


def test_pipeline_config_types(tmp_path, capsys):
    y = tmp_path / "p.yaml"
    for text, fragment in [
        ("online_prompts: two\n", "'online_prompts' must be an integer"),
        ("fetch: 1\n", "'fetch' must be true or false"),
        ("families: [{name: ../../escape}]\n", "family name '../../escape' is not a plain name"),
        ("families: [{name: disco_ffn, args: {a: 1}}]\n", "'families.args' must be a list"),
        ("data:\n  generation: {max_new_tokens: eight}\n", "section data: config key 'generation.max_new_tokens'"),
        ("online_max_new_tokens: 0\n", "online_max_new_tokens must be >= 1"),
        ("run_dir: [a]\n  b: c\n", "malformed YAML"),
    ]:
        y.write_text(text)
        one_line_error(capsys, main(["pipeline", "--config", str(y)]), fragment)


# ------------------------------------------------------------------------------ names that become paths
@pytest.mark.parametrize("scheme", ["all:../../../victim", "all:a/b", "all:..", "all:/abs"])
def test_split_names_cannot_escape_the_dataset(tmp_path, capsys, scheme):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    p = _prompts(tmp_path, '{"prompt": "hello"}\n')
    one_line_error(capsys, main(_generate(tmp_path, "--prompts", str(p), "--split-scheme", scheme)), "is not a plain name")
    assert (victim / "keep.txt").read_text() == "precious"


def test_split_names_checked_in_library_calls():
    from specstop.data_gen.storage import shard_name
    from specstop.prompts import assign_splits

    with pytest.raises(UserError, match="not a plain name"):
        shard_name("../x", 0)
    with pytest.raises(UserError, match="not a plain name"):
        assign_splits(4, "random", {"train": 2, "../up": 2})


# ------------------------------------------------------------------------------ policy parameters
@pytest.mark.parametrize(
    "policy, fragment",
    [
        ("confidence:2", "0 < TAU <= 1"),
        ("confidence:-1", "0 < TAU <= 1"),
        ("confidence:nan", "0 < TAU <= 1"),
        ("confidence:0", "0 < TAU <= 1"),
        ("heuristic:0", "heuristic start length must be >= 1"),
        ("static:0", "static speculation length must be >= 1"),
        ("static:abc", "K must be an integer"),
        ("confidence:x", "TAU must be a number"),
        ("greedy", "unknown policy 'greedy'"),
        ("tree:4", "'tree:4' is a token-tree policy, which runs its own decoder"),
    ],
)
def test_policy_strings_are_range_checked(policy, fragment):
    from specstop.policy import parse_policy_string

    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_policy_string(policy)


def test_decode_names_every_policy_form_it_runs(capsys):
    """An unknown --policy is refused before any model loads, naming rules, folders, hub ids, trees and pearl."""
    from specstop.cli import main

    assert main(["decode", "--pair", "nowhere", "--prompt", "hi", "--policy", "confidnce:0.4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown policy 'confidnce:0.4'" in err
    for form in ("confidence[:TAU]", "export folder", "hub id OWNER/NAME", "mcsd:K1,K2", "tree:N", "pearl[:GAMMA]"):
        assert form in err, form


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"kind": "predictor", "family": "disco_ffn", "threshold": 5.0}, "must be in [0, 1], got 5.0"),
        ({"kind": "predictor", "rule": "cumprod", "threshold": -0.5}, "h (stop when 1 - prod(scores) > h)"),
        ({"kind": "confidence", "threshold": math.inf}, "finite number"),
        ({"kind": "confidence", "threshold": "0.4"}, "finite number"),
        ({"kind": "static", "k": 2.5}, "k must be an integer"),
        ({"kind": "static", "sl_max": 0}, "sl_max must be >= 1"),
        ({"kind": "pearl", "gamma": 0}, "gamma must be an integer >= 1"),
        ({"kind": "predictor", "reads": "logits"}, "'reads' must be one of"),
    ],
)
def test_policy_specs_from_files_are_range_checked(spec, fragment):
    from specstop.policy import PolicySpec

    with pytest.raises(UserError) as info:
        PolicySpec.from_dict(spec)
    assert fragment in str(info.value)


def test_decode_flags_are_range_checked(tmp_path, capsys):
    one_line_error(capsys, main(["decode", "--pair", "x", "--prompt", "hi", "--max-new-tokens", "0"]), "--max-new-tokens")
    one_line_error(capsys, main(["decode", "--pair", "x", "--prompt", "hi", "--top-p", "0"]), "--top-p")
    one_line_error(capsys, main(["eval", "--data", "d", "--tuned", "t", "--out", "o", "--mc-repeats", "0"]), "--mc-repeats")


def test_errors_wrapped_by_libraries_stay_user_errors(tmp_path, capsys):
    """jsonargparse wraps what our constructors raise; the user still gets our one line."""
    from specstop.errors import find_user_error

    cfg = "configs/train/disco_ffn.yaml"
    from pathlib import Path

    cfg = str(Path(__file__).resolve().parents[1] / cfg)
    one_line_error(capsys, main(["train", "--config", cfg, "--data.data_dir", str(tmp_path / "nope")]),
                   "has no manifest.json")
    try:
        try:
            raise UserError("bad input")
        except UserError:
            raise KeyError("a bug while handling it") from None  # context only: still a bug
    except KeyError as err:
        assert find_user_error(err) is None
    try:
        try:
            raise UserError("bad input")
        except UserError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as err:
        assert str(find_user_error(err)) == "bad input"


def test_tune_grid_beyond_the_rollouts_is_one_line(synth_dir, tmp_path, capsys):
    rc = main(["tune", "--data", str(synth_dir), "--cost-model", "reference-cpu", "--sl-max-grid", "4,40",
               "--out", str(tmp_path / "t.json")])
    one_line_error(capsys, rc, "--sl-max-grid", "SL_max 40")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--data.batch_size", "eight"], "config key 'data.batch_size': Expected a <class 'int'>. Got value: eight"),
        (["--model.init_args.lr", "fast"], "config key 'model.lr': Expected a <class 'float'>. Got value: fast"),
        (["--model.init_args.nonsense", "1"], "config key 'model.nonsense' is unknown"),
        (["--model.init_args.lr", "0"], "model.lr must be > 0"),
    ],
)
def test_train_config_errors_are_one_line(synth_dir, tmp_path, monkeypatch, capsys, extra, fragment):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    cfg = str(Path(__file__).resolve().parents[1] / "configs" / "train" / "disco_ffn.yaml")
    one_line_error(capsys, main(["train", "--config", cfg, "--data.data_dir", str(synth_dir), *extra]), fragment)
