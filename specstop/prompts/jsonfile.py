"""Reading prompt records from a local ``.json``, ``.jsonl`` or ``.jsonl.gz`` file with file:line errors.

A ``.jsonl`` file (or its gzip-compressed ``.jsonl.gz``, the form of the shipped prompt sets) holds
one JSON object per line (blank lines are skipped); a ``.json`` file holds
a list of objects (or, as many dataset dumps do, JSON Lines under a ``.json`` name). Anything else -
an empty file, a line that is not JSON, a record that is not an object - is one
:class:`~specstop.errors.UserError` naming the file and the line, instead of a parser traceback.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from specstop.config_io import not_a_file
from specstop.errors import UserError
from specstop.jsonio import loads

#: A prompt record and the 1-based line it starts on.
Located = tuple[int, dict]


def _object_or_error(value, path: Path, line: int) -> dict:
    if not isinstance(value, dict):
        kind = "null" if value is None else type(value).__name__
        raise UserError(
            f"{path}:{line}: expected a JSON object (a record with fields such as \"prompt\"), got {kind}; "
            "each record must be one {...} object"
        )
    return value


def _read_lines(path: Path, text: str) -> list[Located]:
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = loads(line, f"{path}:{n}")
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno}); each line of a .jsonl file "
                "must be one JSON object"
            ) from None
        out.append((n, _object_or_error(value, path, n)))
    return out


def is_gzip_jsonl(path: str | Path) -> bool:
    return str(path).endswith(".jsonl.gz")


def _read_text(path: Path) -> str:
    if not is_gzip_jsonl(path):
        return path.read_text(encoding="utf-8")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return fh.read()
    except (OSError, EOFError, zlib.error) as err:  # not gzip, or truncated
        raise UserError(f"{path}: not a readable gzip file ({err}); give a .jsonl.gz written by gzip") from None


def read_json_records(path: str | Path) -> list[Located]:
    """The records of a ``.json``/``.jsonl``/``.jsonl.gz`` file with their line numbers, in file order.

    Raises:
        MissingInputError: no such file.
        UserError: the file is empty, not UTF-8 (or not gzip), malformed JSON, or holds something
            other than objects (names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, "prompt file", "give a .json, .jsonl or .jsonl.gz file")
    try:
        text = _read_text(path)
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start}); give a JSON/JSONL file") from None
    if not text.strip():
        raise UserError(f"{path} is empty: a prompt file needs at least one JSON record")
    if path.suffix == ".json":
        try:
            value = loads(text, str(path))
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": JSON Lines under a .json name
                raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        else:
            if not isinstance(value, list):
                raise UserError(f"{path}: expected a list of JSON objects (or one object per line), got {type(value).__name__}")
            # json.loads keeps no line numbers; count records instead ("line" = record number here).
            return [(i + 1, _object_or_error(v, path, i + 1)) for i, v in enumerate(value)]
    return _read_lines(path, text)
