"""Prompt sets shipped inside the package, named ``builtin:<name>`` in configs.

The recipes must run from a bare clone (no ``../shared``) and offline, so the prompt files they
use travel as package data (``specstop/prompts/data/*.jsonl.gz``, provenance and licences in the
README there). Each builtin also names the hub dataset it was taken from, so a user with network
can switch a recipe to the original (``source: <hub_id>``, ``hub_config``, ``hub_split``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specstop.errors import MissingInputError, UserError
from specstop.prompts.jsonfile import read_json_records

PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinPromptSet:
    """A shipped prompt file and the hub original it comes from.

    Attributes:
        name: the name after ``builtin:``.
        file: file name under ``specstop/prompts/data``.
        records: number of records in the file.
        licence: the data's licence (see the data README).
        hub_id, hub_config, hub_split: the hub original (``hub_split`` selects the same records
            where the hub layout allows it).
        note: how the shipped file relates to the hub original.
    """

    name: str
    file: str
    records: int
    licence: str
    hub_id: str
    hub_config: str | None
    hub_split: str
    note: str


BUILTINS: dict[str, BuiltinPromptSet] = {
    s.name: s
    for s in (
        BuiltinPromptSet(
            "mbpp", "mbpp.jsonl.gz", 974, "CC-BY-4.0", "google-research-datasets/mbpp", "full",
            "prompt+test+validation+train",
            "all 974 tasks, byte-identical to google-research mbpp/mbpp.jsonl; the hub's four splits "
            "joined give the same records (the `mbpp` split scheme splits by task_id)",
        ),
        BuiltinPromptSet(
            "alpaca", "alpaca.jsonl.gz", 5000, "CC-BY-NC-4.0", "tatsu-lab/alpaca", None, "train[:5000]",
            "the first 5,000 of the 52,002 Stanford Alpaca records, in order",
        ),
        BuiltinPromptSet(
            "cnn_dailymail", "cnn_dailymail.jsonl.gz", 997, "Apache-2.0 (articles (c) CNN / Daily Mail; research only)",
            "abisee/cnn_dailymail", "3.0.0", "test[:1000]",
            "997 articles from the start of the CNN/DM test split (3 that also occur in Spec-Bench removed); "
            "the hub split is a close, not identical, set",
        ),
    )
}


def is_builtin(source: str) -> bool:
    return source.startswith(PREFIX)


def builtin_spec(source: str) -> BuiltinPromptSet:
    """The shipped set named by ``builtin:<name>``.

    Raises:
        UserError: an unknown name (the message lists the known ones).
    """
    name = source[len(PREFIX) :] if is_builtin(source) else source
    if name not in BUILTINS:
        raise UserError(
            f"unknown builtin prompt set {source!r}; choose one of "
            f"{', '.join(PREFIX + n for n in BUILTINS)} or `humaneval`, or give a .jsonl path / hub id"
        )
    return BUILTINS[name]


def builtin_path(source: str) -> Path:
    """Path of the shipped file of ``builtin:<name>`` (inside the installed package)."""
    spec = builtin_spec(source)
    path = Path(str(resources.files("specstop.prompts") / "data" / spec.file))
    if not path.is_file():
        raise MissingInputError(
            f"{path} is missing from the installed specstop package; reinstall it (`pip install -e .`)"
        )
    return path


def read_jsonl_gz(path: str | Path) -> list[dict]:
    """Records of a gzip-compressed JSON Lines file, in file order (errors name the file and line)."""
    return [rec for _, rec in read_json_records(path)]


def load_builtin(source: str) -> list[dict]:
    """The records of ``builtin:<name>``, in file order."""
    return read_jsonl_gz(builtin_path(source))
