"""The typed settings mechanism: one dataclass field gives the YAML key, the flags and the help."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specstop.config_cli import TypedCommand, comma_list, setting
from specstop.config_io import dataclass_from_dict, read_yaml
from specstop.errors import UserError


@dataclass
class Sampling:
    """How tokens are drawn."""

    temperature: float = setting(0.0, flags=("--temperature",))
    """0 = greedy."""
    splits: list[str] = setting(default_factory=lambda: ["train"], flags=("--splits-on",), parse=comma_list)
    """Splits it applies to."""


@dataclass
class Settings:
    """A command's settings."""

    out: str | None = setting(None, flags=("--data",), deprecated=("--out",), metavar="DIR")
    """Folder to write."""
    hidden: bool = setting(False, flags=("--hidden",))
    """Keep hidden states."""
    sampling: Sampling = field(default_factory=Sampling)


@dataclass
class SamplingWithANewSetting(Sampling):
    """How tokens are drawn (with one more setting)."""

    min_new_tokens: int = setting(0, flags=("--min-new-tokens",))
    """Tokens before EOS may end a response."""


@dataclass
class SettingsWithANewSetting(Settings):
    sampling: SamplingWithANewSetting = field(default_factory=SamplingWithANewSetting)


def _command(root=Settings) -> TypedCommand:
    def load(path):
        return dataclass_from_dict(root, read_yaml(path) or {}, "", str(path))

    cmd = TypedCommand(root, prog="specstop demo", load_file=load)
    cmd.add_argument("--dry-run", action="store_true")
    return cmd


def test_one_field_is_a_yaml_key_a_dotted_flag_a_short_flag_and_help(tmp_path, capsys):
    """Adding a setting is one field (with its docstring) in one dataclass."""
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sampling:\n  min_new_tokens: 3\n")
    cfg, _ = _command(SettingsWithANewSetting).parse(["--config", str(yaml_file)])
    assert cfg.sampling.min_new_tokens == 3
    cfg, _ = _command(SettingsWithANewSetting).parse(["--sampling.min_new_tokens", "4"])
    assert cfg.sampling.min_new_tokens == 4
    cfg, _ = _command(SettingsWithANewSetting).parse(["--min-new-tokens=5"])
    assert cfg.sampling.min_new_tokens == 5
    with pytest.raises(SystemExit):
        _command(SettingsWithANewSetting).parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--min-new-tokens" in text and "--sampling.min_new_tokens" in text
    assert "Tokens before EOS may end a response." in text


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("out: a\nsampling:\n  temperature: 0.5\n  splits: [x, y]\n")
    cfg, flags = _command().parse(["--config", str(yaml_file), "--data", "b", "--dry-run"])
    assert (cfg.out, cfg.sampling.temperature, cfg.sampling.splits, flags.dry_run) == ("b", 0.5, ["x", "y"], True)
    cfg, flags = _command().parse([])
    assert (cfg.out, cfg.sampling.temperature, cfg.hidden, flags.dry_run) == (None, 0.0, False, False)


def test_switches_comma_lists_and_deprecated_spellings(caplog):
    cfg, _ = _command().parse(["--hidden", "--splits-on", "a,b"])
    assert cfg.hidden is True and cfg.sampling.splits == ["a", "b"]
    cfg, _ = _command().parse(["--no-hidden", "--splits-on", "none"])
    assert cfg.hidden is False and cfg.sampling.splits == []
    with caplog.at_level("WARNING"):
        cfg, _ = _command().parse(["--out", "x"])
    assert cfg.out == "x" and "--out is deprecated; use --data" in caplog.text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "warm"], "--temperature must be a number, got 'warm'"),
        (["--sampling.temperature=warm"], "--sampling.temperature must be a number, got 'warm'"),
        (["--temprature", "1"], "unknown flag --temprature (did you mean --temperature?)"),
        (["--data", "a", "--out", "b"], "give --data or --out, not both"),
        (["--splits-on"], "--splits-on needs a value"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(UserError) as err:
        _command().parse(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_file_names_the_file_and_key(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sampling:\n  temprature: 1\n")
    with pytest.raises(UserError, match=r"c.yaml: unknown config key 'sampling.temprature'"):
        _command().parse(["--config", str(yaml_file)])


def test_every_command_setting_has_help():
    """A setting without a docstring would reach --help as a bare type: every command documents its own."""
    from specstop.config_cli import leaf_settings
    from specstop.data_gen.config import DataGenConfig

    cmd = TypedCommand(DataGenConfig, prog="specstop generate")
    undocumented = [a.dest for a in cmd.parser._actions
                    if a.dest in {leaf.path for leaf in leaf_settings(DataGenConfig)} and not a.help]
    assert not undocumented, f"settings without a docstring: {undocumented}"


def test_dashes_spell_any_dotted_flag_and_shared_short_flags_are_left_out(tmp_path):
    from specstop.pipeline.cli import command

    cfg, _ = command().parse(["--online-prompts", "0", "--tune.sl-max-grid", "4,8", "--mc-repeats", "3"])
    assert cfg.online_prompts == 0 and cfg.tune.sl_max_grid == "4,8" and cfg.eval.mc_repeats == 3
    # tune.split and eval.split both declare --split: only the dotted flags name them
    with pytest.raises(UserError, match="unknown flag --split"):
        command().parse(["--split", "test"])


def test_pipeline_sections_are_typed_mappings(tmp_path):
    """Train settings as a mapping, tune/eval sections as their commands' own settings."""
    from specstop.pipeline.cli import command

    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(
        "pair: x\nfamilies:\n  - disco_ffn\n"
        "  - {name: mcsd_topk_mlp, train: {trainer: {max_epochs: 3}, model: {init_args: {schedule: constant}}}}\n"
        "  - {name: specdecpp_resnet, args: [--trainer.max_epochs, 2]}\n"
        "tune: {sl_max_grid: '4,8'}\neval: {mc_repeats: 4}\n")
    cfg, _ = command().parse(["--config", str(yaml_file)])
    assert [f.train_args() for f in cfg.families] == [
        [], ["--trainer.max_epochs=3", "--model.init_args.schedule=constant"], ["--trainer.max_epochs", "2"]]
    assert cfg.stage_args("tune") == ["--sl_max_grid=4,8"] and cfg.stage_args("eval") == ["--mc_repeats=4"]
    yaml_file.write_text("pair: x\ntune: {sl_max: 4}\n")
    with pytest.raises(UserError, match=r"unknown config key 'tune.sl_max'"):
        command().parse(["--config", str(yaml_file)])
