"""The interface every engine module fills in, and the small helpers they share.

An engine is one :class:`Engine`: which tuned policies it can express, how each becomes that engine's
settings, its batch schedule, how it re-prices with its own measured costs, and how a written file is
checked against what the engine reads. :mod:`specstop.export.engines.settings` drives them all the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstop.errors import UserError


@dataclass(frozen=True)
class Context:
    """What an engine's builders need besides the policy: the pair as commands name it, where the file goes.

    Attributes:
        draft, target: model names or files written into commands.
        folder: the folder the settings file is written to (side files are named by their path there),
            or None for bare file names.
        tuned: the whole ``tuned.json`` dict (cost model, dataset, per-K search results).
        draft_quant: vllm only: the scheme specstop's proposer quantizes the draft with, or None.
    """

    draft: str
    target: str
    folder: str | None
    tuned: dict
    draft_quant: str | None = None


def _same_names(draft: str, target: str) -> tuple[str, str]:
    return draft, target


@dataclass(frozen=True)
class Engine:
    """One engine's settings, schedule, costs and validation.

    Attributes:
        name: the ``--for`` name.
        policies: the tuned policies (``tuned.json`` names) it can express.
        option: ``(policy entry, context) -> option body`` (flags, config, command).
        check_option: ``(option, where)``; raises :class:`UserError` where the engine would refuse it.
        schedule: ``(batch schedule, draft, target, folder) -> body`` in the engine's per-batch-size form;
            None: the engine takes no batch schedule.
        check_schedule: ``(file's batch_schedule, where)``, after the shared row checks.
        learned: ``(policy entry, export folder, context) -> option body or None`` for a learned policy
            exported beside the file; None: the engine cannot run one.
        reprice: ``(options, batch schedule or None, context) -> batch schedule``: re-prices options (in place)
            and the schedule with costs measured in the engine itself; None: the tuned prices stand.
        names: ``(draft, target) -> (draft, target)`` as the engine's schedule commands name them.
        side_files: ``(folder, settings)``: writes the files the engine reads by path.
        extra: keys added to every settings file of this engine.
    """

    name: str
    policies: tuple[str, ...]
    option: Callable[[dict, Context], dict]
    check_option: Callable[[dict, str], None]
    schedule: Callable[[dict, str, str, str | None], dict] | None = None
    check_schedule: Callable[[dict, str], None] | None = None
    learned: Callable[[dict, str, Context], dict | None] | None = None
    reprice: Callable[[dict, dict | None, Context], dict | None] | None = None
    names: Callable[[str, str], tuple[str, str]] = _same_names
    side_files: Callable[[Path, dict], None] | None = None
    extra: dict = field(default_factory=dict)


def bad(engine: str, what: str) -> UserError:
    """The one-line error for a settings file an engine would refuse."""
    return UserError(f"{engine} settings: {what}; re-export with `specstop export --for {engine}` (do not edit by hand)")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN != NaN


def policy_entry(tuned: dict, name: str) -> dict | None:
    """``{"name", "spec", "validation"}`` of a tuned policy, or None when the tuned file has none by that name."""
    entry = (tuned.get("policies") or {}).get(name)
    if not entry:
        return None
    return {"name": name, "spec": entry["spec"], "validation": entry.get("validation") or {}}


def side_file(folder: str | None, name: str) -> str:
    """A file written beside the settings file, as commands name it: its path in ``folder`` (so a copied
    command runs from any directory), or the bare name when the folder is not known."""
    return str(Path(folder) / name) if folder else name


def flag_value(flags: list[str], flag: str, engine: str, where: str) -> str:
    """The value after ``flag`` in a flag list.

    Raises:
        UserError: the flag is missing or has no value.
    """
    if flag not in flags or flags.index(flag) + 1 >= len(flags):
        raise bad(engine, f"{where}: {flag} is missing")
    return flags[flags.index(flag) + 1]
