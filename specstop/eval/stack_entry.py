"""A multi-level stack as files name it: its models and one rule per gap (the *stack entry*).

A stack is the pair's draft at the bottom, the level models above it (smallest first, each a local
folder or a hub id, as ``--draft`` / ``--target`` are) and the pair's target on top; one rule per gap,
bottom first, decides how many tokens each level drafts for the next
(:class:`~specstop.decode.multilevel.MultiLevelDecoder`). The stack entry carries a tuned stack from
``specstop tune --levels`` (tuned.json ``levels``) through ``specstop export --policy levels`` (the
export's config.json ``levels``) to ``specstop decode --policy EXPORT``; :func:`check_stack_entry` is its
one reader, so every file that holds one is checked by the same rule (docs/schemas.md "Multi-level stacks").
"""

from __future__ import annotations

import json
from pathlib import Path

from specstop.errors import UserError

#: The version of the stack entry; a reader refuses any other.
STACK_SCHEMA_VERSION = 1
#: Default rules of a level drafting for a middle model, and of the level drafting for the target.
LOWER_GRID = "static:1,static:2,static:3,confidence:0.5,confidence:0.7"
TOP_GRID = "static:4,static:6,static:8,confidence:0.4,confidence:0.6"

__all__ = ["LOWER_GRID", "STACK_SCHEMA_VERSION", "TOP_GRID", "check_stack_entry", "level_grids", "parse_level_models",
           "parse_level_rules", "stack_entry", "stack_from_export"]


def parse_level_models(text: str, flag: str = "--levels") -> list[str]:
    """The models of a comma list, smallest first (``MODEL_A,MODEL_B``); local paths become absolute.

    Absolute because the names travel in tuned files and exports read from other directories.
    """
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise UserError(f"{flag} is empty: give the models between the draft and the target, smallest first "
                        "(MODEL_A,MODEL_B: local folders or hub ids)")
    return [str(Path(n).expanduser().resolve()) if Path(n).expanduser().exists() else n for n in names]


def parse_level_rules(text: str, gaps: int, flag: str = "--policy") -> list[str]:
    """``gaps`` rules of a comma list, bottom first (e.g. ``static:2,confidence:0.6``), each checked."""
    from specstop.eval.levels import level_grid

    rules = level_grid(text)
    if len(rules) != gaps:
        raise UserError(f"{flag} {text!r}: a stack of {gaps + 1} models needs {gaps} rules, bottom first "
                        f"(e.g. {','.join(['static:2'] * (gaps - 1) + ['static:6'])}); got {len(rules)}")
    return rules


def level_grids(given: list[str], gaps: int) -> list[list[str]]:
    """One grid of rules per gap, bottom first: ``given`` (one comma list per gap) or the defaults."""
    from specstop.eval.levels import level_grid

    if not given:
        given = [LOWER_GRID] * (gaps - 1) + [TOP_GRID]
    if len(given) != gaps:
        raise UserError(f"--level-grid: a stack of {gaps + 1} models has {gaps} gaps; give --level-grid once per gap, "
                        f"bottom first (got {len(given)}), or leave it out for the defaults")
    return [level_grid(g) for g in given]


def stack_entry(models: list[str], policies: list[str], **extra) -> dict:
    """A stack entry: ``{"schema_version", "models" (between draft and target, smallest first),
    "policies" (one rule per gap, bottom first), **extra}``, checked before it is written."""
    return check_stack_entry({"schema_version": STACK_SCHEMA_VERSION, "models": list(models),
                              "policies": list(policies), **extra}, "the stack")


def check_stack_entry(entry, source: str) -> dict:
    """``entry`` if it is a stack entry of this version with one rule per gap, else one line naming ``source``."""
    from specstop.eval.levels import level_grid

    fix = "rerun `specstop tune --levels ...` (and export it again)"
    if not isinstance(entry, dict) or entry.get("schema_version") != STACK_SCHEMA_VERSION:
        got = entry.get("schema_version") if isinstance(entry, dict) else type(entry).__name__
        raise UserError(f"{source}: its multi-level stack is not schema_version {STACK_SCHEMA_VERSION} (got {got!r}); "
                        f"{fix}")
    models, policies = entry.get("models"), entry.get("policies")
    if (not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models)
            or not isinstance(policies, list) or not all(isinstance(p, str) for p in policies)):
        raise UserError(f"{source}: a multi-level stack names its models and rules as lists of strings; {fix}")
    if len(policies) != len(models) + 1:
        raise UserError(f"{source}: a stack of {len(models) + 2} models needs {len(models) + 1} rules, got "
                        f"{len(policies)}; {fix}")
    try:
        level_grid(",".join(policies))
    except UserError as err:
        raise UserError(f"{source}: {err}; {fix}") from None
    return entry


def stack_from_export(folder) -> dict | None:
    """The checked stack entry of an export folder's config.json, or None (no folder, or no stack)."""
    if folder is None:
        return None
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # not readable here: the policy loader says what is wrong with it
    if not isinstance(config, dict) or "levels" not in config:
        return None
    return check_stack_entry(config["levels"], str(folder))
