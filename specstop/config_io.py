"""Reading user configs: YAML with file:line errors, and typed dataclass construction.

Every config we own (``configs/data``, ``configs/pipelines``, tuned-policy files) goes through
:func:`read_yaml` and :func:`dataclass_from_dict`, so a malformed file or a value of the wrong type
is one :class:`~specstop.errors.UserError` naming the file, the key, the value and the expected
type - never a traceback from deep inside a run, and never a silent ``str()`` of the wrong thing.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

from specstop.errors import MissingInputError, UserError


def not_a_file(path: str | Path, what: str, fix: str) -> MissingInputError:
    """The error for a named input that is not a regular file, saying what it is instead
    (a folder or a named pipe is not "missing")."""
    import stat

    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        return MissingInputError(f"{what} {p} does not exist; {fix}")
    kind = ("a folder" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")
    return MissingInputError(f"{what} {p} is {kind}, not a file; {fix}")


def read_yaml(path: str | Path, what: str = "config") -> Any:
    """Parse a YAML file.

    Raises:
        MissingInputError: no such file.
        UserError: malformed YAML (names the file, line and column and the parser's problem).
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        raise not_a_file(p, f"{what} file", "give the path of a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{p}: not a UTF-8 text file ({err.reason} at byte {err.start}); give a YAML file") from None
    try:
        return load_yaml_text(text, p)
    except RecursionError:
        import sys

        raise UserError(f"{p}: YAML nested deeper than {sys.getrecursionlimit()} levels cannot be read; give the "
                        f"intended {what} file") from None
    except DuplicateKeyError as err:
        raise UserError(
            f"{p}:{err.line}: duplicate {'section' if err.is_section else 'key'} {err.key!r} (first at line "
            f"{err.first_line}); YAML keeps only the last one, silently dropping the first: merge them into one"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise UserError(f"{where}: malformed YAML: {detail}; fix the file at that line") from None


class DuplicateKeyError(ValueError):
    """A mapping in a YAML file names the same key twice (PyYAML would keep the last silently)."""

    def __init__(self, key: Any, line: int, first_line: int, is_section: bool) -> None:
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first_line})")
        self.key, self.line, self.first_line, self.is_section = key, line, first_line, is_section


def _unique_key_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader that refuses duplicate keys in any mapping (with both lines)."""

        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges are not duplicates
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # SafeLoader reports unhashable keys itself
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(key, line, seen[key], isinstance(value_node, yaml.MappingNode))
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_yaml_text(text: str, source: str | Path = "<string>") -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (:class:`DuplicateKeyError`).

    Every user YAML (data, pipeline and train configs, tuned files) goes through it: a repeated
    ``generation:`` section would otherwise silently drop the first section's settings.
    """
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass


def check_yaml_file(path: str | Path, what: str = "config") -> None:
    """Parse ``path`` only to refuse malformed YAML and duplicate keys with file:line (for files
    another library reads afterwards, e.g. LightningCLI's ``--config``)."""
    read_yaml(path, what)


def short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: an echoed value (a YAML alias bomb expands to
    megabytes) must not flood the one error line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def describe_type(hint: Any) -> str:
    """A reader's name for a type hint (``an integer``, ``a list of strings`` ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        names = [describe_type(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in args else text
    if origin in (list, tuple):
        return f"a list of {_plural(describe_type(args[0]))}" if args else "a list"
    if origin is dict:
        return f"a mapping of {_plural(describe_type(args[0]))} to {_plural(describe_type(args[1]))}" if args else "a mapping"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            dict: "a mapping", type(None): "null", Any: "any value"}.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(text: str) -> str:
    """``an integer or a string`` -> ``integers or strings``; ``a mapping of X to Y`` -> ``mappings of X to Y``."""
    if " or " in text and not text.startswith("a mapping"):
        return " or ".join(_plural(part) for part in text.split(" or "))
    if text.startswith("a mapping of "):
        return "mappings of " + text[len("a mapping of "):]
    for article in ("an ", "a "):
        if text.startswith(article):
            text = text[len(article):]
    return {"integer": "integers", "number": "numbers", "string": "strings", "mapping": "mappings",
            "true or false": "booleans", "list": "lists"}.get(text, text)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    )


def check_type(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against ``hint``; returns it (ints become floats where a float is expected).

    Booleans are not integers here and floats are not integers (``4.5`` for a count is an error).

    Raises:
        UserError: naming ``key``, the value and the expected type.
    """
    ok, converted = _matches(value, hint)
    if not ok:
        raise UserError(
            f"config key {key!r} must be {describe_type(hint)}, got {short(value)} ({_kind(value)})"
        )
    return converted


def check_flag_value(value: Any, hint: Any, flag: str) -> Any:
    """:func:`check_type` for a value given as a flag: the message names the flag as it was spelt.

    Raises:
        UserError: ``--also_decoding must be a list of mappings ..., got ... (a string)``.
    """
    ok, converted = _matches(value, hint)
    if not ok:
        raise UserError(f"{flag} must be {describe_type(hint)}, got {short(value)} ({_kind(value)})")
    return converted


def _matches(value: Any, hint: Any) -> tuple[bool, Any]:
    if hint is Any:
        return True, value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            ok, conv = _matches(value, a)
            if ok:
                return True, conv
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if hint is str:
        return isinstance(value, str), value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            return False, value
        if not args:
            return True, value
        out = []
        for v in value:
            ok, conv = _matches(v, args[0])
            if not ok:
                return False, value
            out.append(conv)
        return True, out
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False, value
        if not args:
            return True, value
        out = {}
        for k, v in value.items():
            ok_k, _ = _matches(k, args[0])
            ok_v, conv = _matches(v, args[1])
            if not (ok_k and ok_v):
                return False, value
            out[k] = conv
        return True, out
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint)), value
    return isinstance(value, hint), value


def dataclass_from_dict(cls: type, data: Any, where: str = "", source: str | None = None) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and value types at every level.

    Args:
        cls: the dataclass; nested dataclass fields are built recursively.
        data: the mapping (e.g. parsed YAML).
        where: dotted prefix of this section (``generation.``), for messages.
        source: the file it came from, prefixed to messages.

    Raises:
        UserError: an unknown key (listing the valid ones), a section that is not a mapping, or a
            value of the wrong type.
    """
    prefix = f"{source}: " if source else ""
    if not isinstance(data, dict):
        raise UserError(
            f"{prefix}config section {where.rstrip('.') or 'top level'} must be a mapping of keys to values, "
            f"got {short(data)} ({_kind(data)})"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise UserError(
                f"{prefix}unknown config key {short(where + str(key))}; valid keys"
                f"{' in ' + where.rstrip('.') if where else ''}: {', '.join(names)}"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = dataclass_from_dict(hint, {} if value is None else value, f"{where}{key}.", source)
            continue
        try:
            kwargs[key] = check_type(value, hint, where + key)
        except UserError as err:
            raise UserError(f"{prefix}{err}") from None
    return cls(**kwargs)


def check_range(
    key: str,
    value: float | int | None,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
) -> None:
    """Raise a :class:`UserError` naming ``key`` unless ``value`` is finite and within the bounds.

    ``None`` passes (optional settings). ``low_open``/``high_open`` exclude the bound itself.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{key} must be a number, got {short(value)} ({_kind(value)})")
    bad = not math.isfinite(value)
    if low is not None:
        bad = bad or (value <= low if low_open else value < low)
    if high is not None:
        bad = bad or (value >= high if high_open else value > high)
    if bad:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        need = " and ".join(p for p in (lo, hi) if p) or "finite"
        raise UserError(f"{key} must be {need} (and finite), got {value!r}{'; ' + fix if fix else ''}")


#: Seeds every command and decoder accepts: torch generators take 64 bits (numpy's any non-negative
#: integer), and PEARL offsets a seed per worker, so 0 .. 2**63 - 1 always fits.
MAX_SEED = 2**63 - 1
#: A sampling temperature is 0 (greedy) or within this range: beyond it the tempered distribution is
#: one-hot or uniform to float32 precision (and far below it logits / T overflow).
TEMPERATURE_RANGE = (1e-4, 1e4)


def check_seed(seed: Any, key: str = "seed") -> int | None:
    """``seed`` as an int (None stays None), refused in one line unless it is an integer in
    0 .. 2**63 - 1 (torch raises an overflow deep inside for more, numpy for negative ones)."""
    if seed is None:
        return None
    value = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    if value is None and getattr(seed, "ndim", None) == 0 and hasattr(seed, "item"):
        item = seed.item()
        value = item if isinstance(item, int) and not isinstance(item, bool) else None
    if value is None or not 0 <= value <= MAX_SEED:
        raise UserError(f"{key} must be an integer from 0 to 2**63 - 1, got {short(seed)}")
    return int(value)


def check_temperature(value: Any, key: str = "temperature") -> None:
    """0 (greedy) or a finite temperature within :data:`TEMPERATURE_RANGE`."""
    check_range(key, value, low=0.0)
    low, high = TEMPERATURE_RANGE
    if value != 0 and not low <= value <= high:
        raise UserError(f"{key} must be 0 (greedy) or from {low:g} to {high:g}, got {value!r}")


def check_decoding(temperature: Any, top_k: Any, top_p: Any, prefix: str = "") -> None:
    """The decoding transform's settings: temperature (:func:`check_temperature`), top_k an integer
    >= 0 (0 disables), top_p in (0, 1] (1 disables)."""
    check_temperature(temperature, f"{prefix}temperature")
    check_top_k(top_k, f"{prefix}top_k")
    check_range(f"{prefix}top_p", top_p, low=0.0, high=1.0, low_open=True)


def check_top_k(value: Any, key: str = "top_k") -> None:
    """An integer >= 0 (0 disables): ``2.5``, ``"5"`` and ``True`` are refused, not truncated or parsed."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise UserError(f"{key} must be an integer >= 0 (0 disables), got {short(value)}")


def check_named_settings(values: dict[str, Any], spelled: Any = None) -> None:
    """Settings that mean the same in every command get one rule each, whatever dataclass declares
    them: ``seed`` (:func:`check_seed`), ``temperature`` (:func:`check_temperature`), ``top_k``
    (an integer >= 0) and ``top_p`` (in (0, 1]).

    Args:
        values: ``{dotted path: value}`` of every leaf setting (:func:`specstop.config_cli.leaf_values`).
        spelled: ``spelled(path) -> str``, how the user named the setting (its flag); default: the path.

    Raises:
        UserError: naming the setting, the value and the allowed range.
    """
    for path, value in values.items():
        name = path.rpartition(".")[2]
        if value is None or name not in ("seed", "temperature", "top_k", "top_p"):
            continue
        key = spelled(path) if spelled is not None else path
        if name == "seed":
            check_seed(value, key)
        elif name == "temperature":
            check_temperature(value, key)
        elif name == "top_k":
            check_top_k(value, key)
        else:
            check_range(key, value, low=0.0, high=1.0, low_open=True)


def resolve_recorded_path(value: str | None, recorded_in: str | Path) -> str | None:
    """A path recorded in a file (tuned.json's ``checkpoints``/``dataset``), as the reader must open it.

    Absolute paths stay. A relative path is relative to the file that records it (so a tuned file
    works from any directory); files written by older versions recorded paths relative to the
    directory they ran in, which is used only when nothing exists beside the file.
    """
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    beside = Path(recorded_in).resolve().parent / p
    if beside.exists() or not p.exists():
        return str(beside)
    return str(p.resolve())


def resolve_tuned_paths(tuned: dict, path: str | Path) -> dict:
    """``tuned`` with its ``dataset`` and ``checkpoints`` paths resolved against the tuned file ``path``."""
    out = dict(tuned)
    if isinstance(out.get("dataset"), str):
        out["dataset"] = resolve_recorded_path(out["dataset"], path)
    if isinstance(out.get("checkpoints"), dict):
        out["checkpoints"] = {
            n: resolve_recorded_path(c, path) if isinstance(c, str) else c for n, c in out["checkpoints"].items()
        }
    return out
