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

from specstop.config_cli import comma_list, leaf_settings, leaf_values, setting
from specstop.config_io import check_named_settings, check_range, check_type, dataclass_from_dict, read_yaml
from specstop.errors import MissingInputError, UserError
from specstop.names import check_plain_name
from specstop.pair.preflight import check_dtype_name
from specstop.pair.settings import PairSettings
from specstop.probs import DecodingConfig
from specstop.prompts.sources import PromptSetConfig

PROMPT_OVERFLOW = ("truncate", "skip")


@dataclass
class PromptsConfig(PromptSetConfig):
    """Where prompts come from and how they are rendered and split.

    ``specstop.prompts.PromptSetConfig`` whose ``source`` may come from the ``--prompts`` flag
    instead of the YAML (so it may be unset while the config is assembled).
    """

    source: str | None = setting(None, flags=("--prompts",))
    """Prompt source: a JSON/JSONL file, a hub id or a named source (humaneval, builtin:NAME)."""


@dataclass
class GenerationConfig:
    """How the target writes responses (and the decoding transform used for every label)."""

    max_new_tokens: int = setting(128, flags=("--max-new-tokens",))
    """Tokens each response may have."""
    temperature: float = setting(0.0, flags=("--temperature",))
    """Sampling temperature; 0 = greedy."""
    top_k: int = setting(0, flags=("--top-k",))
    """Sampling: keep the k most likely tokens (0 disables)."""
    top_p: float = setting(1.0, flags=("--top-p",))
    """Sampling: nucleus mass (1.0 disables)."""
    seed: int = setting(0, flags=("--seed",))
    """Seed of sampling, draft samples, verified outcomes and mixing."""
    batch_size: int = setting(8, flags=("--batch-size",))
    """Prompts per batch."""
    max_prompt_tokens: int | None = setting(None, flags=("--max-prompt-tokens",))
    """Longest prompt in tokens; null = the model context minus max_new_tokens."""
    prompt_overflow: str = setting("truncate", flags=("--prompt-overflow",))
    """Longer prompts: ``truncate`` (cut from the left) or ``skip``."""

    def decoding(self) -> DecodingConfig:
        return DecodingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class MixingConfig:
    """SpecDec++ token mixing: keep X_i with probability ``rate``, else the draft sample Y_i."""

    rate: float = setting(0.15, flags=("--mixing-rate",))
    """Probability of keeping the target token."""
    draws: int = setting(1, flags=("--mixing-draws",))
    """Mixed sequences per response."""
    splits: list[str] = setting(default_factory=lambda: ["train"], flags=("--mixing-on",), parse=comma_list)
    """Splits with token mixing (comma-separated on the command line; ``none`` for none)."""


@dataclass
class RolloutsConfig:
    """Greedy draft continuations after every mismatch (exact replay needs them)."""

    length: int = setting(20, flags=("--rollout-length",))
    """Rollout steps L."""
    splits: list[str] = setting(default_factory=lambda: ["validation", "test"], flags=("--rollouts-on",),
                                parse=comma_list)
    """Splits with rollouts (comma-separated on the command line; ``none`` for none)."""
    batch_size: int = setting(64, flags=("--rollout-batch-size",))
    """Mismatch prefixes rolled out together."""


@dataclass
class LabelsConfig:
    """What every draft position is labelled with, beyond the labels themselves."""

    topk_k: int = setting(10, flags=("--feature-topk",), deprecated=("--topk",))
    """Features: how many top draft probabilities each row stores."""
    hidden_states: bool = setting(False, flags=("--hidden-states",))
    """Store the draft's final hidden states (float16)."""
    mixing: MixingConfig = field(default_factory=MixingConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    # Small blocks stay in cache: measured 1.7x faster label math at 16 rows than at 1024 with a
    # 152k vocabulary.
    chunk_rows: int = 16
    """Response positions turned into float32 distributions at once."""


@dataclass
class DataGenConfig(PairSettings):
    """Everything `specstop generate` needs."""

    target_device_map: str | None = setting(None, flags=("--target-device-map",))
    """e.g. auto: spread a target larger than one GPU."""
    out: str | None = setting(None, flags=("--data",), deprecated=("--out",), metavar="DIR")
    """Dataset folder to write (the --data of train/tune/eval)."""
    prompts_per_shard: int = setting(64, flags=("--prompts-per-shard",))
    """Prompts in each shard (the unit of resuming)."""
    num_shards: int | None = setting(None, flags=("--num-shards",))
    """Number of workers; null = $WORLD_SIZE or 1."""
    shard_index: int | None = setting(None, flags=("--shard-index",))
    """This worker; null = $RANK or 0."""
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    labels: LabelsConfig = field(default_factory=LabelsConfig)

    def validate(self) -> None:
        """Check every setting's range (types were checked when the config was read).

        Raises:
            UserError: naming the key, the value and the allowed range.
        """
        g, lab, pc = self.generation, self.labels, self.prompts
        values = leaf_values(self)
        for leaf in leaf_settings(type(self)):
            check_type(values[leaf.path], leaf.hint, leaf.path)  # programmatic edits bypass the YAML reader
        check_range("generation.temperature", g.temperature, low=0.0)
        check_range("generation.top_p", g.top_p, low=0.0, high=1.0, low_open=True)
        for key, value, low in (
            ("generation.max_new_tokens", g.max_new_tokens, 1),
            ("generation.batch_size", g.batch_size, 1),
            ("generation.top_k", g.top_k, 0),
            ("generation.max_prompt_tokens", g.max_prompt_tokens, 1),
            ("labels.topk_k", lab.topk_k, 1),
            ("labels.chunk_rows", lab.chunk_rows, 1),
            ("labels.mixing.draws", lab.mixing.draws, 0),
            ("labels.rollouts.length", lab.rollouts.length, 0),
            ("labels.rollouts.batch_size", lab.rollouts.batch_size, 1),
            ("prompts_per_shard", self.prompts_per_shard, 1),
            ("num_shards", self.num_shards, 1),
            ("shard_index", self.shard_index, 0),
            ("prompts.limit", pc.limit, 0),
        ):
            check_range(key, value, low=low)
        check_range("labels.mixing.rate", lab.mixing.rate, low=0.0, high=1.0)
        check_named_settings(values)  # seeds, temperature, top_k, top_p: one rule in every command
        if g.prompt_overflow not in PROMPT_OVERFLOW:
            raise UserError(f"generation.prompt_overflow must be one of {PROMPT_OVERFLOW}, got {g.prompt_overflow!r}")
        for split in [*lab.mixing.splits, *lab.rollouts.splits, *(pc.split_sizes or {})]:
            check_plain_name(split, "split name")
        if pc.split_scheme.startswith("all:"):
            check_plain_name(pc.split_scheme[4:], "split name (in split_scheme)")
        check_dtype_name(self.dtype)

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
        from specstop.data_gen.labels import LABELS_VERSION

        keep["labels_version"] = LABELS_VERSION
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def config_from_dict(data: dict, source: str | None = None) -> DataGenConfig:
    """Build a :class:`DataGenConfig`, rejecting unknown keys and wrongly typed values at every level."""
    return dataclass_from_dict(DataGenConfig, {} if data is None else data, "", source)


def load_config(path: str | Path) -> DataGenConfig:
    """Read a YAML config (see ``configs/data/``); errors name the file and the key or line."""
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"config file {p} not found (configs live in configs/data/*.yaml)")
    return config_from_dict(read_yaml(p), source=str(p))
