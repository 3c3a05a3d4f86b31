"""JSON files, one way: the reader for files a user hands us, the tolerant reader for our own
records, and the atomic writer every command uses (a crash or a full disk never leaves half a file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specstop.errors import UserError

__all__ = ["atomic_write_json", "loads", "read_json", "read_json_or_none"]


def loads(text: str, where: str) -> Any:
    """``json.loads`` for text from a file: JSON nested deeper than Python's recursion limit (a few
    thousand ``[``, which json would meet with a RecursionError) is one line naming ``where``.

    Raises:
        json.JSONDecodeError: malformed JSON (callers name the file and line).
        UserError: nested too deeply.
    """
    import sys

    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: JSON nested deeper than {sys.getrecursionlimit()} levels cannot be read; no file "
                        "specstop reads nests that deep - give the intended file") from None


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file we or the user wrote (tuned policies, cost models, manifests).

    Args:
        path: the file.
        what: what it is, for messages (``"cost model file"``).

    Raises:
        MissingInputError: no such file (or a folder, a pipe ... where a file was expected).
        UserError: not UTF-8 or not valid JSON (names the file and line).
    """
    from specstop.config_io import not_a_file

    p = Path(path)
    if not p.is_file():
        raise not_a_file(p, what, "give the path of a JSON file")
    try:
        return loads(p.read_text(encoding="utf-8"), str(p))
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a UTF-8 text file; give the {what} (JSON)") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{p}:{err.lineno}: not valid JSON ({err.msg}); fix or regenerate the {what}") from None


def read_json_or_none(path: str | Path) -> Any | None:
    """The JSON at ``path``, or None when it is missing or unreadable (e.g. a record cut off by a
    crash, which the caller then treats as absent)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        return loads(p.read_text(), str(p))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UserError):
        return None


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON through a temporary file and ``os.replace``.

    numpy scalars and arrays and paths are written as their plain JSON values.
    """
    from specstop.outputs import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o)}")
