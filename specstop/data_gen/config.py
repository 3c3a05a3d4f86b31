"""The `specstop generate` configuration: nested dataclasses, a strict YAML loader, flag overrides.

A YAML file mirrors the dataclasses below (sections ``prompts``, ``generation``, ``labels`` with
``mixing`` and ``rollouts``, plus top-level run settings). Unknown keys are an error that names the
key and lists the valid ones, because a misspelt key silently falling back to a default would
produce a dataset with the wrong labels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from specstop.probs import DecodingConfig
from specstop.prompts.sources import PromptSetConfig

PROMPT_OVERFLOW = ("truncate", "skip")


@dataclass
class PromptsConfig(PromptSetConfig):
    """Where prompts come from: ``specstop.prompts.PromptSetConfig`` whose ``source`` may come from
    the ``--prompts`` flag instead of the YAML (so it may be unset while the config is assembled)."""

    source: str | None = None
    split_sizes: Any = None


@dataclass
class GenerationConfig:
    """How the target writes responses (and the decoding transform used for every label).

    ``max_prompt_tokens`` None means the model context minus ``max_new_tokens``.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    max_prompt_tokens: int | None = None
    prompt_overflow: str = "truncate"

    def decoding(self) -> DecodingConfig:
        return DecodingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class MixingConfig:
    """SpecDec++ token mixing: keep X_i with probability ``rate``, else the draft sample Y_i."""

    rate: float = 0.15
    draws: int = 1
    splits: list[str] = field(default_factory=lambda: ["train"])


@dataclass
class RolloutsConfig:
    """Greedy draft continuations after every mismatch (exact replay needs them)."""

    length: int = 20
    splits: list[str] = field(default_factory=lambda: ["validation", "test"])
    batch_size: int = 64  # mismatch prefixes rolled out together


@dataclass
class LabelsConfig:
    topk_k: int = 10
    hidden_states: bool = False
    mixing: MixingConfig = field(default_factory=MixingConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    # Response positions turned into float32 distributions at once (bounds memory: rows x vocab x 4 B).
    chunk_rows: int = 1024


@dataclass
class DataGenConfig:
    """Everything `specstop generate` needs."""

    pair: str | None = None
    draft: str | None = None
    target: str | None = None
    dtype: str = "auto"
    device: str | None = None
    target_device_map: str | None = None
    out: str | None = None
    prompts_per_shard: int = 64
    num_shards: int | None = None
    shard_index: int | None = None
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    labels: LabelsConfig = field(default_factory=LabelsConfig)

    def validate(self) -> None:
        g, lab = self.generation, self.labels
        g.decoding()  # validates temperature/top_k/top_p
        if g.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {g.max_new_tokens}")
        if g.batch_size < 1:
            raise ValueError(f"generation.batch_size must be >= 1, got {g.batch_size}")
        if g.prompt_overflow not in PROMPT_OVERFLOW:
            raise ValueError(f"generation.prompt_overflow must be one of {PROMPT_OVERFLOW}, got {g.prompt_overflow!r}")
        if lab.topk_k < 1:
            raise ValueError(f"labels.topk_k must be >= 1, got {lab.topk_k}")
        if not 0.0 <= lab.mixing.rate <= 1.0:
            raise ValueError(f"labels.mixing.rate must be in [0, 1], got {lab.mixing.rate}")
        if lab.mixing.draws < 0 or lab.rollouts.length < 0:
            raise ValueError("labels.mixing.draws and labels.rollouts.length must be >= 0")
        if self.prompts_per_shard < 1:
            raise ValueError(f"prompts_per_shard must be >= 1, got {self.prompts_per_shard}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def label_fingerprint(self) -> str:
        """Hash of every setting that changes a shard's content (recorded per shard for resume)."""
        d = self.to_dict()
        keep = {"generation": d["generation"], "labels": d["labels"], "prompts": d["prompts"]}
        # Which prompts a shard holds is checked separately (its recorded prompt ids), so a quick
        # --limit run can grow into the full run; batching does not change labels (per-prompt seeds).
        keep["prompts"].pop("limit")
        keep["generation"].pop("batch_size")
        keep["labels"].pop("chunk_rows")
        keep["labels"]["rollouts"].pop("batch_size")
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or 'top level'} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(
                f"unknown config key {where + key!r}; valid keys{' in ' + where.rstrip('.') if where else ''}: "
                f"{', '.join(names)}"
            )
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            value = _from_dict(sub, value or {}, f"{where}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: dict) -> DataGenConfig:
    """Build a :class:`DataGenConfig`, rejecting unknown keys at every level."""
    cfg = _from_dict(DataGenConfig, data or {}, "")
    return cfg


def load_config(path: str | Path) -> DataGenConfig:
    """Read a YAML config (see ``configs/data/``)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found (configs live in configs/data/*.yaml)")
    with open(p) as f:
        data = yaml.safe_load(f) or {}
    try:
        return config_from_dict(data)
    except ValueError as err:
        raise ValueError(f"{p}: {err}") from None


def set_path(cfg: DataGenConfig, dotted: str, value: Any) -> None:
    """Override one setting by dotted name (``generation.temperature``); used for CLI flags."""
    obj = cfg
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    if not hasattr(obj, last):
        raise ValueError(f"unknown config key {dotted!r}")
    setattr(obj, last, value)
