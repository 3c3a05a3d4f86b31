"""The pipeline YAML: one typed mapping per stage, checked before any stage runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specstop.config_cli import setting
from specstop.config_io import check_range, check_type, dataclass_from_dict, read_yaml
from specstop.errors import UserError
from specstop.eval.eval_cli import EvalOptions
from specstop.eval.tune_cli import TuneOptions
from specstop.measure.calibrate_cli import CalibrateOptions
from specstop.names import check_plain_name
from specstop.pair.settings import PairSettings


def settings_flags(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    """A nested mapping of settings as dotted flags: ``{"trainer": {"max_epochs": 30}}`` ->
    ``["--trainer.max_epochs=30"]`` (values as JSON, which jsonargparse reads as YAML)."""
    flags = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value and "class_path" not in value:
            flags += settings_flags(value, f"{prefix}{key}.")
        else:
            flags.append(f"--{prefix}{key}={value if isinstance(value, str) else json.dumps(value)}")
    return flags


@dataclass
class FamilySpec:
    """One predictor family to train."""

    name: str
    """Registry name (disco_ffn, specdecpp_resnet, mcsd_hidden_mlp, mcsd_topk_mlp); a plain name, since
    it names the run folder RUN/train/<name>."""
    config: str | None = None
    """A configs/train/*.yaml LightningCLI config; null = configs/train/<name>.yaml."""
    train: dict[str, Any] = field(default_factory=dict)
    """LightningCLI settings over that config, as a mapping: {trainer: {max_epochs: 30}, model:
    {init_args: {lr: 1.0e-3}}} (checked by LightningCLI when the family trains)."""
    args: list[str | int | float | bool] = field(default_factory=list)
    """The same as command-line arguments (older configs): [--trainer.max_epochs, "30"]."""

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = f"configs/train/{self.name}.yaml"
        self.args = [str(a) for a in self.args]

    def train_args(self) -> list[str]:
        """Everything handed to ``specstop train`` after the config (the ``args`` list, then ``train``)."""
        return [*self.args, *settings_flags(self.train)]


DECODING_KEYS = frozenset({"temperature", "top_k", "top_p"})


def decoding_slug(generation: dict) -> str:
    """A folder-safe name of a decoding setting: ``greedy``, ``t1``, ``t0.7_p0.9``, ``t0.7_k50``."""
    from specstop.probs import DecodingConfig

    d = DecodingConfig.from_generation(generation)
    t, k, p = d.temperature, d.top_k, d.top_p
    if not t:
        return "greedy"
    return f"t{t:g}" + (f"_k{k}" if k else "") + (f"_p{p:g}" if p < 1.0 else "")


@dataclass
class PipelineConfig(PairSettings):
    """A pipeline run (YAML keys mirror these settings; unknown keys are an error)."""

    run_dir: str = setting("runs/pipeline", flags=("--run-dir",))
    """Output folder (resumable: rerun the same config to continue)."""
    fetch: bool = True
    """Run `specstop fetch-pair` first when pair is a known, unconverted name."""
    data: dict[str, Any] = field(default_factory=dict)
    """The dataset: a `specstop generate` config (configs/data/*.yaml keys) without pair/out, checked
    as one when the file is read."""
    also_decoding: list[dict[str, Any]] = field(default_factory=list)
    """Other decoding settings to tune the policies for, e.g. [{temperature: 1.0}, {temperature: 0.7, top_p:
    0.9}]: each gets its own dataset (the data section with these generation keys), the run's predictors
    tuned on it, and the export carries each setting's numbers, used for requests at that setting
    (specstop.export.by_decoding)."""
    test_data: dict[str, Any] | None = None
    """Optional second generate config evaluated for transfer (e.g. HumanEval)."""
    families: list[FamilySpec] = field(default_factory=list)
    """Predictor families to train (a name, or a mapping of FamilySpec keys)."""
    cost_model: str = "calibrate"
    """calibrate (measure this machine with calibrate-cost at the dataset's decoding context), a path
    to a cost.json, or a preset name (reports then say in their first line that it is not this machine)."""
    calibrate_budget: float = 60.0
    """Seconds of measuring for calibrate."""
    calibrate: CalibrateOptions = field(default_factory=CalibrateOptions)
    """What `specstop calibrate-cost` measures (cost_model: calibrate): no_pearl_split (no room to
    share the weights with PEARL's workers), batch_grid (a batch schedule in the tuned file and the engine settings), k_grid,
    no_tree, context_tokens."""
    force_cost: bool = False
    """Price with a measured cost table even when it fails its check (erratic or unordered K;
    specstop.eval.cost_check); otherwise tune refuses it."""
    tune: TuneOptions = field(default_factory=TuneOptions)
    """How `specstop tune` searches (split, sl_max_grid, heuristic_starts, repeats)."""
    eval: EvalOptions = field(default_factory=EvalOptions)
    """How `specstop eval` replays (split, mc_repeats)."""
    tune_args: list[str | int | float] = field(default_factory=list)
    """Extra `specstop tune` arguments (older configs; prefer the tune section)."""
    eval_args: list[str | int | float] = field(default_factory=list)
    """Extra `specstop eval` arguments (older configs; prefer the eval section)."""
    online_prompts: int = 8
    """Test prompts the online check decodes (real decoding, interleaved and repeated:
    specstop.measure.online); 0 disables it."""
    online_repeats: int = 2
    """Repeats of the online check (sampled data: each repeat decodes with its own seed)."""
    online_max_new_tokens: int | None = None
    """Tokens per prompt in the online check; null = the dataset's."""
    online_hf_default: bool = True
    """Include HF's default assisted generation in the online check."""
    online_budget: float | None = None
    """Seconds for the online check; when set, prompts and then tokens are cut until the cost model's
    estimate fits (specstop.measure.online_budget); null = as configured."""
    export_policy: str = "best"
    """Which tuned policy to export (best = the tuned file's best learned one)."""
    levels: str | None = None
    """Multi-level speculation: the models between the pair's draft and target, smallest first, as a comma
    list (local folders or hub ids). The tune stage then also tunes the stack's rules jointly (`specstop
    tune --levels`) and RUN/export_levels carries them (`specstop decode --policy RUN/export_levels`)."""

    def __post_init__(self) -> None:
        self.tune_args = [str(a) for a in self.tune_args]
        self.eval_args = [str(a) for a in self.eval_args]

    def stage_args(self, stage: str) -> list[str]:
        """The extra arguments of the ``tune``, ``eval`` or ``calibrate`` stage: its section's settings
        that differ from the command's defaults, then the older ``*_args`` list (an old config's argv
        is unchanged)."""
        section = getattr(self, stage)
        defaults = type(section)()
        changed = {f.name: getattr(section, f.name) for f in fields(section)
                   if getattr(section, f.name) != getattr(defaults, f.name)}
        return [*settings_flags(changed), *getattr(self, f"{stage}_args", [])]

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        """Read and check a pipeline YAML: keys, value types, family names, ranges and the data sections.

        Raises:
            UserError: naming the file and the key (or the line of malformed YAML).
        """
        raw = read_yaml(path, "pipeline config")
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise UserError(f"{path}: a pipeline config must be a mapping of keys to values, got {type(raw).__name__}")
        fams_raw = raw.pop("families", None) or []
        cfg = dataclass_from_dict(cls, raw, "", str(path))
        check_type(fams_raw, list, "families")
        for f in fams_raw:
            if isinstance(f, str):
                f = {"name": f}
            cfg.families.append(dataclass_from_dict(FamilySpec, f, "families.", str(path)))
        try:
            cfg.validate(str(path))
        except UserError as err:  # every value checked here is the file's: name it
            text = str(err)
            raise type(err)(text if text.startswith(f"{path}:") else f"{path}: {text}") from None
        return cfg

    def validate(self, source: str = "the pipeline config") -> None:
        """Check ranges, family names and the generate configs before any stage runs."""
        from specstop.data_gen.config import config_from_dict
        from specstop.pair.preflight import check_dtype_name

        check_range("online_prompts", self.online_prompts, low=0)
        check_range("online_repeats", self.online_repeats, low=1)
        check_range("calibrate_budget", self.calibrate_budget, low=0, low_open=True)
        check_range("online_max_new_tokens", self.online_max_new_tokens, low=1)
        check_range("online_budget", self.online_budget, low=0, low_open=True)
        check_range("tune.repeats", self.tune.repeats, low=1)
        check_range("eval.mc_repeats", self.eval.mc_repeats, low=1)
        check_range("calibrate.context_tokens", self.calibrate.context_tokens, low=1)
        if self.calibrate.batch_grid is not None:
            from specstop.measure.batch_cost import parse_batch_grid

            parse_batch_grid(self.calibrate.batch_grid)
        check_dtype_name(self.dtype)
        if self.levels is not None:
            from specstop.eval.stack_entry import parse_level_models

            parse_level_models(self.levels, "levels")
        seen = set()
        for fam in self.families:
            check_plain_name(fam.name, "family name")  # it names RUN/train/<family>
            if fam.name in seen:
                raise UserError(f"{source}: family {fam.name!r} is listed twice; give each family once")
            seen.add(fam.name)
        sections = [("data", self.data), ("test_data", self.test_data)]
        for i, entry in enumerate(self.also_decoding):
            where = f"also_decoding[{i}]"
            if not isinstance(entry, dict) or not entry or set(entry) - DECODING_KEYS:
                raise UserError(f"{source}: {where} must map some of {', '.join(sorted(DECODING_KEYS))} to values, "
                                f"e.g. {{temperature: 1.0}}; got {entry!r}")
            sections.append((where, self.decoding_data(entry)))
        # Every section is checked as a generate config first, so a decoding value of the wrong type
        # is one line naming its section before the settings are compared below.
        for key, section in sections:
            if section is None:
                continue
            conf = {k: v for k, v in section.items() if k not in ("pair", "draft", "target", "out")}
            try:
                config_from_dict(conf).validate()
            except UserError as err:
                raise UserError(f"{source}: section {key}: {err}") from None
        seen_settings = {decoding_slug((self.data or {}).get("generation") or {})}
        for i, entry in enumerate(self.also_decoding):
            slug = decoding_slug(entry)
            if slug in seen_settings:
                raise UserError(f"{source}: also_decoding[{i}] ({slug}) repeats the data section's setting or "
                                "another entry's")
            seen_settings.add(slug)

    def decoding_data(self, setting: dict) -> dict:
        """The data section with ``setting``'s generation keys (an ``also_decoding`` entry's dataset); a
        sampled setting leaves top-k / top-p off unless it names them."""
        data = json.loads(json.dumps(self.data or {}))
        gen = data.setdefault("generation", {})
        gen.update({"top_k": 0, "top_p": 1.0})
        gen.update(setting)
        return data
