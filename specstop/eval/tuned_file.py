"""Reading a tuned-policy file (``specstop tune``'s output; docs/design.md "Tuned-policy files")."""

from __future__ import annotations

from pathlib import Path

from specstop.config_io import resolve_tuned_paths
from specstop.errors import MissingInputError, UserError
from specstop.jsonio import read_json


def read_tuned(path: str | Path) -> dict:
    """The tuned-policy file at ``path``, its relative paths resolved and its own path under ``_path``.

    Raises:
        MissingInputError: no such file. UserError: not a tuned-policy file of schema version 1.
    """
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"no tuned-policy file at {p}; run `specstop tune ... --out {p}` first")
    tuned = read_json(p, "tuned-policy file")
    if not isinstance(tuned, dict) or tuned.get("schema_version") != 1 or not isinstance(tuned.get("policies"), dict):
        raise UserError(f"{p} is not a specstop tuned-policy file (schema_version 1 with 'policies')")
    tuned = resolve_tuned_paths(tuned, p)
    tuned["_path"] = str(p)
    return tuned
