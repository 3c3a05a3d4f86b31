"""What specstop says advises the right fix: Ctrl-C says what each command kept, a long message keeps
its fix, and a bad value is blamed on the file it came from (config, tuned file), not on a flag
nobody gave or a checkpoint nobody named."""

from __future__ import annotations

import json

import pytest
from _export_fixtures import write_checkpoint, write_tuned
from test_faults_inputs import one_line_error

import specstop.cli as cli
from specstop.cli import COMMANDS, main
from specstop.errors import UserError
from specstop.policy import PolicySpec

RESUMING = {"fetch-pair", "generate", "pipeline"}  # a rerun picks up finished parts, shards or stages


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_says_what_was_kept_and_only_resuming_commands_promise_a_resume(name, monkeypatch, capsys):
    def interrupted(command, argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_command", interrupted)
    assert main([name]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specstop {name}: interrupted"), err
    line = err[0]
    promises = "rerun the same command to resume" in line or "rerun the same command to continue" in line
    assert promises == (name in RESUMING), line
    if name == "train":  # a rerun starts over; resuming needs Lightning's --ckpt_path
        assert "--ckpt_path" in line and "last.ckpt" in line
    if name == "sweep":  # its rerun retrains the whole grid
        assert "does not resume" in line


def test_a_long_message_keeps_its_fix(monkeypatch, capsys):
    def fails(command, argv):
        raise UserError("bad value " + "x" * 5000 + "; the fix: give a short one")

    monkeypatch.setattr(cli, "run_command", fails)
    line = one_line_error(capsys, main(["decode"]), "specstop decode: error: bad value xxx",
                          "characters left out", "; the fix: give a short one (SPECSTOP_DEBUG=1")
    assert len(line) < 2600


def test_an_unknown_config_key_is_echoed_short_and_the_valid_keys_follow(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"? {'k' * 3000}\n: 1\n")  # an explicit key: YAML's plain keys stop at 1024 characters
    line = one_line_error(capsys, main(["generate", "--config", str(cfg)]), f"{cfg}: unknown config key 'kkk",
                          "valid keys: pair, draft, target")
    assert len(line) < 700


def test_a_bad_value_from_the_config_file_names_the_file_not_a_flag(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("generation:\n  temperature: 99999\n")
    line = one_line_error(capsys, main(["generate", "--config", str(cfg), "--data", str(tmp_path / "d")]),
                          f"{cfg}: generation.temperature must be 0 (greedy)")
    assert "--generation.temperature" not in line
    # The same value given as a flag is named by the flag the user typed.
    one_line_error(capsys, main(["generate", "--config", str(cfg), "--data", str(tmp_path / "d"), "--temperature",
                                 "-1"]), "--temperature must be >= 0")


def test_a_pipeline_file_value_out_of_range_names_the_file(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("pair: x\ntune: {repeats: 0}\n")
    one_line_error(capsys, main(["pipeline", "--config", str(cfg)]), f"{cfg}: tune.repeats must be >= 1")


def _tuned_with_moved_checkpoint(tmp_path, data) -> tuple:
    spec = PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5)
    moved = tmp_path / "moved" / "best.ckpt"
    return write_tuned(tmp_path / "tuned.json", {"d": spec}, data, {"d": moved}, best="d"), moved


def test_eval_names_the_tuned_file_for_its_checkpoint_and_cost_model(synth_dir, tmp_path, capsys):
    tuned, moved = _tuned_with_moved_checkpoint(tmp_path, synth_dir)
    doc = json.loads(tuned.read_text())
    stale_cost = doc["cost_model"]  # an older tuned file's cost model: a key this version does not know
    doc["cost_model"] = {"t_draft": 0.01, "t_target": 0.03}
    tuned.write_text(json.dumps(doc))
    base = ["eval", "--data", str(synth_dir), "--tuned", str(tuned), "--out", str(tmp_path / "rep")]
    line = one_line_error(capsys, main(base), f"{tuned} names checkpoint d={moved}, which cannot be used",
                          "--checkpoint d=PATH")
    assert "that `specstop train` printed, or drop it" not in line  # nothing to drop: the tuned file named it
    # --checkpoint replaces it; a wrong path given there is the flag's, with the usual fix.
    line = one_line_error(capsys, main([*base, "--checkpoint", f"d={tmp_path / 'other.ckpt'}"]),
                          f"checkpoint d={tmp_path / 'other.ckpt'} cannot be used")
    assert str(tuned) not in line
    tuned.write_text(json.dumps({**doc, "cost_model": stale_cost}))
    line = one_line_error(capsys, main(base), f"{tuned}: its cost_model cannot be used: unknown cost model keys",
                          "pass --cost-model")
    assert "--cost-model (from the tuned file)" not in line


def test_export_names_the_tuned_file_for_its_checkpoint(tmp_path, capsys):
    tuned, moved = _tuned_with_moved_checkpoint(tmp_path, tmp_path / "data")
    one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(tmp_path / "e")]),
                   f"{tuned} names checkpoint {moved} for policy 'd', which cannot be used",
                   "--checkpoint PATH")


def test_data_without_hidden_states_is_the_datas_problem_not_the_checkpoints(tmp_path, capsys):
    from specstop.testing import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "data", {"train": 4, "validation": 4, "test": 2}, 16,
                                   with_rollouts=True)
    ckpt = tmp_path / "h.ckpt"
    write_checkpoint(ckpt, "specdecpp_resnet", hidden_size=16)
    line = one_line_error(capsys, main(["tune", "--data", str(data), "--checkpoint", f"h={ckpt}", "--cost-model",
                                        "reference-cpu", "--sl-max-grid", "4", "--out", str(tmp_path / "t.json")]),
                          f"predictor 'h' reads draft hidden states but {data} has none",
                          "regenerate with hidden states")
    assert "give the .ckpt" not in line  # the checkpoint is fine: another one would not help


def test_ctrl_c_in_train_before_any_checkpoint_names_no_file_to_resume_from(synth_dir, tmp_path, monkeypatch, capsys):
    """Interrupted while the run is set up, nothing is saved: the line says so and names no last.ckpt."""
    from pathlib import Path

    import specstop.train.cli as train_cli

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_cli, "check_train_outputs", interrupted)
    cfg = Path(__file__).resolve().parents[1] / "configs" / "train" / "disco_ffn.yaml"
    assert main(["train", "--config", str(cfg), "--data.data_dir", str(synth_dir), "--trainer.logger", "false"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("specstop train: interrupted before training started; nothing was saved: rerun the same "
                       "command"), err



@pytest.mark.parametrize("mixing, hidden, said", [
    ({}, False, True),  # asked for (the defaults) without hidden states: skipped, and said so
    ({}, True, False),
    ({"draws": 0}, False, False),
    ({"rate": 1.0}, False, False),  # a rate of 1 mixes nothing: mixing is off
    ({"splits": []}, False, False),  # `--mixing-on none`
])
def test_the_mixing_notice_speaks_only_of_mixing_that_was_asked_for(mixing, hidden, said, pair, tmp_path, caplog):
    import logging

    from _data_gen_helpers import make_render, records

    from specstop.data_gen.config import config_from_dict
    from specstop.data_gen.runner import generate_dataset

    cfg = config_from_dict({"prompts_per_shard": 2, "generation": {"max_new_tokens": 4, "batch_size": 2},
                            "labels": {"hidden_states": hidden, "mixing": mixing, "rollouts": {"length": 0}}})
    with caplog.at_level(logging.INFO, logger="specstop"):
        generate_dataset(pair, records(3), cfg, tmp_path / "ds", render=make_render(pair.tokenizer), progress=False)
    notes = [r.getMessage() for r in caplog.records if "token mixing" in r.getMessage()]
    assert notes == (["token mixing skipped: it produces hidden-state rows and labels.hidden_states is off"]
                     if said else []), notes


def test_a_response_that_fills_the_context_window_is_refused_with_both_numbers(pair, tmp_path, capsys):
    """max_new_tokens at or beyond the window leaves no prompt budget: one line naming the window and the
    setting, never a negative number of tokens."""
    from _data_gen_helpers import make_render, records

    from specstop.data_gen.config import config_from_dict
    from specstop.data_gen.runner import generate_dataset
    from specstop.pair.context import context_window

    window = context_window(pair)
    cfg = config_from_dict({"generation": {"max_new_tokens": window + 5}})
    with pytest.raises(UserError) as err:
        generate_dataset(pair, records(3), cfg, tmp_path / "ds", render=make_render(pair.tokenizer), progress=False)
    text = str(err.value)
    assert text.startswith(f"generation.max_new_tokens {window + 5} plus a prompt of at least one token needs "
                           f"{window + 6} positions but the models' context window is {window} tokens"), text
    assert "lower generation.max_new_tokens" in text and "-5" not in text
    assert not (tmp_path / "ds").exists()
