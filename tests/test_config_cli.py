"""The typed settings mechanism: one dataclass field gives the YAML key, the flags and the help."""

from __future__ import annotations

import argparse
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


class _Parsed(Exception):
    """Raised instead of parsing: carries the command's parser out of its ``main``."""


def _typed_command(name: str, monkeypatch) -> TypedCommand:
    """The :class:`TypedCommand` that ``specstop NAME`` parses its arguments with (nothing runs)."""
    import importlib

    from specstop.cli import COMMANDS

    def parse(self, argv):
        raise _Parsed(self)

    monkeypatch.setattr(TypedCommand, "parse", parse)
    with pytest.raises(_Parsed) as caught:
        importlib.import_module(COMMANDS[name][0]).main([])
    return caught.value.args[0]


def _printed_default(help_text: str) -> str | None:
    """The ``default: X`` jsonargparse appends to a flag's help, or None when it prints none."""
    tail = help_text.rsplit("(", 1)[-1]
    return tail.split("default: ", 1)[1].rstrip(")") if "default: " in tail else None


_TYPED_COMMANDS = [name for name in __import__("specstop.cli", fromlist=["COMMANDS"]).COMMANDS if name != "train"]


@pytest.mark.parametrize("name", _TYPED_COMMANDS)
def test_every_command_setting_has_help(name, monkeypatch):
    """Every flag of every command has help text, and --help prints the default the command really uses:
    the dataclass default, or "required" for a setting the command refuses to run without."""
    from specstop.config_cli import leaf_values

    cmd = _typed_command(name, monkeypatch)
    defaults = leaf_values(cmd.root())
    required = {leaf.path for leaf in cmd.leaves if leaf.required}
    formatter = cmd.parser._get_formatter()
    undocumented, wrong = [], []
    for action in cmd.parser._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue  # hidden (kept for old scripts) or argparse's own
        if not action.help:
            undocumented.append(action.dest)
        if action.dest not in defaults:
            continue
        text = " ".join(formatter._expand_help(action).split())
        printed = _printed_default(text)
        if action.dest in required:
            if printed is not None or "(required" not in text:
                wrong.append(f"{action.dest}: {text!r} (a required setting)")
            continue
        value = defaults[action.dest]
        if action.dest.rsplit(".", 1)[-1] == "seed" and not isinstance(value, int):
            wrong.append(f"{action.dest}: prints {printed!r}; a null seed means seed 0, so the default is 0")
        if printed != ("null" if value is None else str(value)):
            wrong.append(f"{action.dest}: prints {printed!r}, the default is {value!r}")
    assert not undocumented, f"specstop {name}: flags without help: {undocumented}"
    assert not wrong, f"specstop {name}: --help describes the wrong default: {wrong}"


def _specstop_train_classes() -> list[type]:
    """The model and data-module classes ``specstop train`` configs may name (defined in specstop.train)."""
    import importlib
    import inspect
    import pkgutil

    import lightning as L

    import specstop.train

    found = []
    for info in pkgutil.iter_modules(specstop.train.__path__):
        module = importlib.import_module(f"specstop.train.{info.name}")
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == module.__name__
                  and issubclass(cls, (L.LightningModule, L.LightningDataModule))]
    return found


def test_train_arguments_specstop_adds_or_changes_have_help_stating_its_defaults(monkeypatch):
    """``specstop train`` is LightningCLI: every argument of specstop's own classes and flags has help, and
    an argument whose default specstop changes states specstop's default, never Lightning's."""
    import re

    import jsonargparse
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from specstop.train import cli as train_cli

    def parse_arguments(self, parser, args):
        raise _Parsed(parser)

    monkeypatch.setattr(train_cli.SpecstopCLI, "parse_arguments", parse_arguments)
    with pytest.raises(_Parsed) as caught:
        train_cli.build_cli(["fit"], run=True)
    fit = caught.value.args[0]._subcommands_action._name_parser_map["fit"]
    actions = {a.dest: a for a in fit._actions}
    assert actions["evaluate_after_fit"].help

    plain = jsonargparse.ArgumentParser()
    plain.add_class_arguments(ModelCheckpoint, "checkpoint")
    plain.add_class_arguments(L.Trainer, "trainer")
    lightning_default = {a.dest: a.default for a in plain._actions if "." in a.dest}
    changed = [a for dest, a in actions.items() if dest in lightning_default and a.default != lightning_default[dest]]
    assert {"checkpoint.monitor", "checkpoint.save_last", "checkpoint.filename", "trainer.logger"} <= {
        a.dest for a in changed}
    wrong = []
    for action in changed:
        stated = re.findall(r"[Dd]efault[^`.]{0,30}``([^`]+)``", action.help or "")  # Lightning's "Default: ``X``"
        if any(s.strip("'\"") != str(action.default) for s in stated):
            wrong.append(f"--{action.dest}: help says the default is {stated}, specstop's is {action.default!r}")
        elif isinstance(action.default, (str, int, float, bool)) and str(action.default) not in action.help:
            wrong.append(f"--{action.dest}: help does not state specstop's default {action.default!r}")
    assert not wrong, wrong

    for cls in _specstop_train_classes():
        parser = jsonargparse.ArgumentParser()
        parser.add_class_arguments(cls, "x")
        params = [a.dest[2:] for a in parser._actions if a.dest.startswith("x.")]
        undocumented = [p for p in params if not parser._option_string_actions[f"--x.{p}"].help]
        # "lr: Adam learning rate. weight_decay: ..." on one docstring line documents two as one
        glued = [p for p in params for q in params
                 if q != p and f"{q}:" in (parser._option_string_actions[f"--x.{p}"].help or "")]
        assert not undocumented and not glued, f"{cls.__name__}: no help: {undocumented}; help of two in one: {glued}"


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


def test_a_key_of_a_mapping_setting_merges_into_the_files_mapping(tmp_path):
    """`--data.generation.temperature 1.0` sets one key inside the config file's `data` mapping (typed as
    YAML) and keeps the rest; a whole `--data` replaces the file's, and keys after it merge over it."""
    from specstop.pipeline.cli import command

    cfg = tmp_path / "p.yaml"
    cfg.write_text("pair: p\ndata:\n  generation: {max_new_tokens: 64, temperature: 0.7, top_p: 0.9}\n"
                   "  prompts: {source: builtin:mbpp}\n")
    settings, _ = command().parse(["--config", str(cfg), "--data.generation.temperature", "1.0",
                                   "--data.generation.top_p=1", "--data.labels.topk_k", "10"])
    assert settings.data == {"generation": {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1},
                             "prompts": {"source": "builtin:mbpp"}, "labels": {"topk_k": 10}}
    settings, _ = command().parse(["--config", str(cfg), "--data", "{prompts: {source: x.jsonl}}",
                                   "--data.generation.temperature", "0"])
    assert settings.data == {"prompts": {"source": "x.jsonl"}, "generation": {"temperature": 0}}
    settings, _ = command().parse(["--config", str(cfg)])
    assert settings.data["generation"]["temperature"] == 0.7  # the file's values, as read
    with pytest.raises(UserError, match="data.generation.max_new_tokens is not a mapping"):
        command().parse(["--config", str(cfg), "--data.generation.max_new_tokens.x", "1"])
    with pytest.raises(UserError, match="--data 'abc': give a mapping"):
        command().parse(["--config", str(cfg), "--data", "abc"])


def test_a_list_setting_is_one_flag_in_yaml_list_syntax(tmp_path):
    """`--also_decoding '[...]'` gives the whole list (it replaces the file's), typed like the file's."""
    from specstop.pipeline.cli import command

    cfg = tmp_path / "p.yaml"
    cfg.write_text("pair: p\ndata: {generation: {temperature: 0.7}}\nalso_decoding: [{temperature: 1.0}]\n")
    settings, _ = command().parse(["--config", str(cfg), "--also-decoding", "[{temperature: 0.5, top_p: 0.9}]"])
    assert settings.also_decoding == [{"temperature": 0.5, "top_p": 0.9}]
    settings, _ = command().parse(["--config", str(cfg), '--also_decoding=[{"temperature": 0}]', "--tune_args", "[a, 1]"])
    assert settings.also_decoding == [{"temperature": 0}] and settings.tune_args == ["a", "1"]
    with pytest.raises(UserError, match=r"^--also_decoding '\{temperature: 1\}': give the whole list, e\.g\. "):
        command().parse(["--config", str(cfg), "--also_decoding", "{temperature: 1}"])
    with pytest.raises(UserError, match=r"^--also_decoding must be a list of mappings of strings to any value, got \[1\]"):
        command().parse(["--config", str(cfg), "--also_decoding", "[1]"])
    with pytest.raises(UserError, match=r"^--also_decoding '\[\{': not a YAML value"):
        command().parse(["--config", str(cfg), "--also_decoding", "[{"])
    assert "A list setting takes the whole list in YAML" in " ".join(command().parser.format_help().split())


@pytest.mark.parametrize("argv, message", [
    (["--online_prompts.x", "1"], "--online_prompts.x: online_prompts is an integer, which has no key 'x'; give "
                                  "--online_prompts VALUE"),
    (["--tune.split.x", "a"], "--tune.split.x: tune.split is a string, which has no key 'x'"),
    (["--fetch.x", "1"], "--fetch.x: fetch is a switch, which has no key 'x'"),
    (["--also_decoding.temperature", "0.7"], "--also_decoding.temperature: also_decoding is a list, which has no "
                                             "key 'temperature'; give --also_decoding '[{key: value}, ...]'"),
])
def test_a_dotted_key_below_a_setting_that_is_no_mapping_is_one_line(argv, message):
    from specstop.pipeline.cli import command

    with pytest.raises(UserError) as err:
        command().parse(argv)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("flags", [
    ["--data.generation.temperature", "hot"], ["--data.generation.temperature", "[1]"], ["--data.generation", "3"],
    ["--also_decoding", "[{temperature: hot}]"], ["--also_decoding", "[{temperature: [1]}]"],
])
def test_a_wrongly_typed_decoding_value_in_a_pipeline_section_is_one_line(flags, tmp_path):
    """Each data section is checked as a generate config before its decoding settings are compared."""
    from specstop.pipeline.cli import command

    cfg = tmp_path / "p.yaml"
    cfg.write_text("pair: p\ndata: {generation: {temperature: 0.7}}\n")
    settings, _ = command().parse(["--config", str(cfg), *flags])
    with pytest.raises(UserError, match=r"section (data|also_decoding\[0\]): config (key 'generation.temperature' "
                                        r"must be a number|section generation must be a mapping)"):
        settings.validate(str(cfg))


def test_a_stray_value_is_named_as_a_value_and_only_current_spellings_are_offered():
    from specstop.data_gen.cli import command as generate
    from specstop.pipeline.cli import command as pipeline

    with pytest.raises(UserError, match=r"^unexpected value 'stray': no flag takes it"):
        pipeline().parse(["--online-prompts", "2", "stray"])
    with pytest.raises(UserError, match=r"^unexpected value 'yes': no flag takes it .*a switch takes none"):
        pipeline().parse(["--force", "yes"])
    # --out and --topk are deprecated spellings: the current ones are offered
    with pytest.raises(UserError, match=r"^unknown flag --outt \(did you mean --data\?\)"):
        generate().parse(["--outt", "x"])
    with pytest.raises(UserError, match=r"^unknown flag --topkk \(did you mean --feature-topk\?\)"):
        generate().parse(["--topkk", "3"])


def test_a_pipeline_section_value_from_a_flag_names_the_flag_with_the_file(tmp_path, capsys):
    from specstop.cli import main

    cfg = tmp_path / "p.yaml"
    cfg.write_text("pair: p\ndata: {generation: {temperature: 0.7}}\n")
    assert main(["pipeline", "--config", str(cfg), "--run-dir", str(tmp_path / "run"),
                 "--data.generation.temperature", "hot"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"specstop pipeline: error: {cfg} with --data.generation.temperature: section data: "
                           "config key 'generation.temperature' must be a number, got 'hot'"), line
    assert not (tmp_path / "run").exists()


def test_a_mapping_inside_a_section_takes_one_key_as_a_flag(tmp_path):
    """The same rule below a section: `--prompts.split_sizes.validation 5` keeps the file's other sizes."""
    from specstop.data_gen.cli import command

    cfg = tmp_path / "d.yaml"
    cfg.write_text("prompts: {source: builtin:mbpp, split_sizes: {validation: 80, test: 80}}\n")
    settings, _ = command().parse(["--config", str(cfg), "--prompts.split_sizes.validation", "5"])
    assert settings.prompts.split_sizes == {"validation": 5, "test": 80}
    with pytest.raises(UserError, match=r"^--prompts.limit.x: prompts.limit is an integer or null, which has no key"):
        command().parse(["--prompts.limit.x", "3"])
