"""Arguments of the scripts in ``benchmarks/``: one parser, one set of value types, one result writer.

The scripts are user programs like the ``specstop`` commands, so they follow the same rules:

* :class:`ScriptParser` reports a bad flag as one line (argparse's own prints the usage too);
* the value types (:func:`positive_int`, :func:`existing_file`, :func:`python_executable`, ...)
  refuse a bad value while the arguments are parsed, before any model loads or timing starts. The
  paths are checked once the whole command line has parsed (:meth:`ScriptParser.parse_args`), so a
  usage line parses without its files being there (the scripts' documented examples are parsed so);
* :func:`result_file` checks a JSON result's path then (writable, and not a file the script did
  not write), and :func:`write_result` writes it once, whole (temporary file, then rename), when
  there is a result: a run that fails leaves no empty or half file behind.

A result carries ``"written_by": "<script>.py"``; a rerun replaces the script's own earlier result,
and any other existing file is refused with one line instead of being overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specstop.config_io import check_range
from specstop.errors import MissingInputError, UserError

#: The key that marks a JSON result as written by a script (its file name).
WRITTEN_BY = "written_by"


class PathCheck:
    """argparse type of a path: parsing keeps the text; :meth:`ScriptParser.parse_args` then runs
    ``check`` on it (and keeps what ``check`` returns, e.g. a program's resolved path)."""

    def __init__(self, check: Callable[[str], Any], name: str) -> None:
        self.check = check
        self.__name__ = name  # argparse names the type by it in its messages

    def __call__(self, text: str) -> str:
        return text


class ScriptParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``SCRIPT: error: MESSAGE ...``), exit 2,
    and whose path arguments (:class:`PathCheck` types) are checked once parsing is done."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's, then the path checks
        parsed = super().parse_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if not isinstance(action.type, PathCheck) or value is None:
                continue
            try:
                if isinstance(value, list):  # nargs / append
                    checked = [action.type.check(v) for v in value]
                else:
                    checked = action.type.check(value)
            except UserError as err:
                self.error(f"argument {'/'.join(action.option_strings) or action.dest}: {err}")
            setattr(parsed, action.dest, checked)
        return parsed


def _as_type(check: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``check`` as an argparse type: argparse shows an ``ArgumentTypeError``'s own message (a
    ``ValueError``'s, ours included, it replaces with "invalid VALUE"), prefixed with the flag."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except UserError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = name
    return parse


def _bounded(convert: type, low: float, *, above: bool, need: str) -> Callable[[str], Any]:
    noun = "an integer" if convert is int else "a number"

    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise UserError(f"{text!r} is not {noun}; give {need}") from None
        try:  # the one range rule of every setting (finite, the bound open or closed)
            check_range("value", value, low=low, low_open=above)
        except UserError:
            raise UserError(f"{text} is out of range; give {need}") from None
        return value

    return check


#: A count of at least one (prompts, repeats, tokens, processes).
positive_int = _as_type(_bounded(int, 1, above=False, need="an integer >= 1"), "positive_int")
#: A count that may be zero (warm-up rounds, a top-k of 0 = off).
nonnegative_int = _as_type(_bounded(int, 0, above=False, need="an integer >= 0"), "nonnegative_int")
#: A finite number above zero (a budget in seconds, a timeout).
positive_float = _as_type(_bounded(float, 0.0, above=True, need="a number > 0"), "positive_float")
#: A finite number of at least zero (a temperature, a rate).
nonnegative_float = _as_type(_bounded(float, 0.0, above=False, need="a number >= 0"), "nonnegative_float")


def _positive_ints(text: str) -> list[int]:
    check = _bounded(int, 1, above=False, need="comma-separated integers >= 1, e.g. 1,2,4")
    values = [check(part.strip()) for part in str(text).split(",") if part.strip()]
    if not values:
        raise UserError(f"{text!r} holds no integers; give comma-separated integers >= 1, e.g. 1,2,4")
    return values


#: A comma list of counts (batch sizes, row counts), in the order given.
positive_int_list = _as_type(_positive_ints, "positive_int_list")


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1] (a probability or a rate)."""
    value = nonnegative_float(text)
    try:
        check_range("value", value, high=1.0)
    except UserError:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a number from 0 to 1") from None
    return value


def check_path(text: str | os.PathLike, *, kind: str = "file", flag: str = "") -> Path:
    """``text`` as a Path, refused with one line unless it is an existing file (``kind="file"``),
    folder (``"folder"``) or either (``"path"``).

    Raises:
        MissingInputError: naming the path, what it is, and what was needed.
    """
    path = Path(text).expanduser()
    where = f"{flag} {text}" if flag else str(text)
    if not path.exists():
        raise MissingInputError(f"{where}: no such {'file or folder' if kind == 'path' else kind}; check the path")
    if kind == "file" and not path.is_file():
        raise MissingInputError(f"{where} is a folder; give a file")
    if kind == "folder" and not path.is_dir():
        raise MissingInputError(f"{where} is a file; give a folder")
    return path


def check_executable(text: str, *, flag: str = "", fix: str = "") -> str:
    """The program ``text`` names (a path, or a name on PATH), refused with one line unless it exists
    and may be executed.

    Args:
        text: a path or a command name.
        flag: how the user named it (``--vllm-python``), for the message.
        fix: how to get one, appended to the message.

    Returns:
        The program's path.

    Raises:
        MissingInputError: the program is not there or not executable.
    """
    where = f"{flag} {text}" if flag else str(text)
    tail = f"; {fix}" if fix else ""
    path = Path(text).expanduser()
    if os.sep not in str(text) and not path.exists():
        found = shutil.which(str(text))
        if found:
            return found
    if not path.exists():
        raise MissingInputError(f"{where}: no such program{tail or '; check the path'}")
    if path.is_dir() or not os.access(path, os.X_OK):
        raise MissingInputError(f"{where} is not an executable program{tail or '; check the path'}")
    return str(path)


def _existing(kind: str) -> PathCheck:
    def check(text: str) -> str:
        check_path(text, kind=kind)
        return text  # as given: the scripts record their arguments as typed

    return PathCheck(check, f"existing_{kind}")


#: argparse types of inputs that must exist: a file, a folder, either.
existing_file, existing_dir, existing_path = _existing("file"), _existing("folder"), _existing("path")
#: argparse type of a program to run (a path or a name on PATH).
executable = PathCheck(check_executable, "executable")
#: argparse type of a Python interpreter to run (another virtualenv's).
python_executable = PathCheck(
    lambda text: check_executable(text, fix="give the path of a Python executable, e.g. VENV/bin/python"),
    "python_executable")


def written_by(path: Path) -> str | None:
    """The script that wrote the JSON result at ``path`` (its ``written_by``), else None."""
    from specstop.jsonio import read_json_or_none

    doc = read_json_or_none(path)
    return doc.get(WRITTEN_BY) if isinstance(doc, dict) else None


def check_result_path(text: str | os.PathLike, script: str, *, flag: str = "--out") -> Path:
    """Refuse, before any work, a result path ``script`` cannot or must not write.

    Args:
        text: the path the user named.
        script: the writing script's ``__file__``.
        flag: how the user named it, for the message.

    Raises:
        UserError: the location cannot be written, or a file is there that ``script`` did not write.
    """
    from specstop.outputs import check_writable

    name = Path(script).name
    path = check_writable(text, flag or "result", kind="file")
    if path.exists() and written_by(path) != name:
        raise UserError(f"{f'{flag} ' if flag else ''}{text} already exists and {name} did not write it; give a new path "
                        f"(or move the file away: a rerun replaces only {name}'s own results)")
    return path


def result_file(script: str) -> PathCheck:
    """argparse type of a JSON result file ``script`` writes with :func:`write_result`.

    Args:
        script: the script's ``__file__``.
    """

    def check(text: str) -> str:
        check_result_path(text, script, flag="")  # argparse names the flag
        return text

    return PathCheck(check, "result_file")


def result_dir(script: str, *results: str) -> PathCheck:
    """argparse type of a folder ``script`` writes its results into (created when they are written).

    Args:
        script: the script's ``__file__``.
        results: the JSON results it writes there with :func:`write_result` (each checked as
            :func:`result_file` checks one).
    """
    from specstop.outputs import check_writable

    def check(text: str) -> str:
        folder = check_writable(text, "folder", kind="folder")
        for name in results:
            check_result_path(folder / name, script, flag="")
        return text

    return PathCheck(check, "result_dir")


def write_result(path: str | os.PathLike, doc: dict, script: str, *, indent: int = 2) -> Path:
    """Write ``doc`` as JSON to ``path`` whole (a temporary file, then a rename), marked as ``script``'s.

    Args:
        path: the result file (its folder is created).
        doc: the result; numpy values and paths are written as JSON values, anything else JSON
            cannot hold (a dtype, a device) as ``str(value)``.
        script: the writing script's ``__file__``.
        indent: JSON indentation.

    Returns:
        ``path`` as a Path.
    """
    from specstop.outputs import atomic_write_text

    marked = {**doc, WRITTEN_BY: Path(script).name}
    return atomic_write_text(path, json.dumps(marked, indent=indent, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    from specstop.jsonio import _json_default

    try:
        return _json_default(value)
    except TypeError:  # a record of what ran, not an input read back: its text is what matters
        return str(value)
