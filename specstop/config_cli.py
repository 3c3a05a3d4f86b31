"""One typed mechanism for every command's settings: a dataclass is the YAML schema and the flags.

A command's settings are one (nested) dataclass. From it, through jsonargparse (the parser
LightningCLI uses for ``specstop train``), come:

* the YAML keys of ``--config FILE`` (read by :mod:`specstop.config_io`, so a malformed file, a
  duplicate key, an unknown key or a wrongly typed value is one line naming the file and the key);
* a flag for every setting, spelt by its dotted path (``--generation.max_new_tokens 64``);
* short spellings declared on the field itself (:func:`setting`, e.g. ``--max-new-tokens``), with
  ``--no-NAME`` for switches and hidden deprecated spellings that print a note;
* the ``--help`` text, taken from the attribute docstrings under each field.

So adding a setting is one field, with its docstring, in one dataclass. Flags override the file;
the file overrides the dataclass defaults. Errors from the parser become one
:class:`~specstop.errors.UserError` line naming the flag.

Example::

    @dataclass
    class Generation:
        max_new_tokens: int = setting(128, flags=("--max-new-tokens",))
        \"\"\"Tokens each response may have.\"\"\"
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specstop.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["TypedCommand", "comma_list", "leaf_settings", "leaf_values", "read_settings_file", "setting"]


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    flags: Sequence[str] = (),
    deprecated: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    negatable: bool = True,
    repeatable: bool = False,
    required: bool = False,
    off_flags: Sequence[str] = (),
) -> Any:
    """A dataclass field that also declares its short command-line spellings.

    Args:
        default, default_factory: as for :func:`dataclasses.field`.
        flags: short spellings (``--max-new-tokens``); the dotted spelling always exists. A switch
            (``bool``) also gets ``--no-NAME``.
        deprecated: older spellings, accepted with a note naming the first of ``flags``.
        parse: turns the flag's text into the value (e.g. :func:`comma_list`); default: the
            setting's type, as the dotted flag parses it.
        metavar: the value's name in ``--help`` (``DIR``).
        negatable: a switch also gets ``--no-NAME`` (off for a switch already named as a negation,
            such as ``--pearl-no-pre-verify``).
        repeatable: a list setting whose short flag adds one item each time it is given
            (``--checkpoint A --checkpoint B``).
        required: the command refuses to run without it (the field's default is then None, so a
            config file may still give it).
        off_flags: switches only: spellings that turn it off (``--delete-gguf`` for ``keep_gguf``).
    """
    meta = {"flags": tuple(flags), "deprecated": tuple(deprecated), "parse": parse, "metavar": metavar,
            "negatable": negatable, "repeatable": repeatable, "required": required,
            "off_flags": tuple(off_flags)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"cli": meta})


def comma_list(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``; ``"none"`` or ``""`` -> ``[]``."""
    return [] if text.strip().lower() in ("", "none") else [s.strip() for s in text.split(",") if s.strip()]


def _non_null(hint: Any) -> tuple[Any, ...]:
    """The types a hint allows besides None (``dict | None`` -> ``(dict,)``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _shape(hint: Any) -> str:
    """``mapping``, ``list`` or ``scalar``: how a setting is given as a flag."""
    for h in _non_null(hint):
        if h is dict or typing.get_origin(h) is dict:
            return "mapping"
        if h in (list, tuple) or typing.get_origin(h) in (list, tuple):
            return "list"
    return "scalar"


def _example(hint: Any) -> str:
    """A value of the setting's shape, for a message's fix: ``'[{key: value}]'``, ``'[a, b]'``, ``VALUE``."""
    shape = _shape(hint)
    if shape == "mapping":
        return "'{key: value}'"
    if shape == "scalar":
        return "VALUE"
    items = [typing.get_args(h) for h in _non_null(hint)]
    item = next((a[0] for a in items if a), None)
    mapping = item is not None and (item is dict or typing.get_origin(item) is dict or dataclasses.is_dataclass(item))
    return "'[{key: value}, ...]'" if mapping else "'[a, b]'"


def _yaml_value(name: str, text: str) -> Any:
    """A flag's text read as YAML (JSON is YAML): ``1.0`` a float, ``[a, b]`` a list, ``{k: v}`` a mapping."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{name} {text!r}: not a YAML value ({problem}); quote it, e.g. {name} '[a, b]'") from None


@dataclass(frozen=True)
class _Leaf:
    """One setting: its dotted path, type hint and declared spellings."""

    path: str
    hint: Any
    flags: tuple[str, ...] = ()
    deprecated: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    negatable: bool = True
    repeatable: bool = False
    required: bool = False
    off_flags: tuple[str, ...] = ()

    @property
    def dotted_flag(self) -> str:
        return f"--{self.path}"

    @property
    def is_switch(self) -> bool:
        return self.hint is bool


def leaf_settings(cls: type, prefix: str = "") -> list[_Leaf]:
    """Every leaf setting of dataclass ``cls`` (nested dataclasses are walked), in field order."""
    hints = typing.get_type_hints(cls)
    out: list[_Leaf] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.extend(leaf_settings(hint, f"{prefix}{f.name}."))
            continue
        out.append(_Leaf(f"{prefix}{f.name}", hint, **f.metadata.get("cli", {})))
    return out


def _without_shared_spellings(leaves: list[_Leaf]) -> list[_Leaf]:
    """The leaves with every short spelling that two settings declare left out.

    A section reused twice in one command (a pipeline's ``tune.split`` and ``eval.split``) declares
    ``--split`` twice; the dotted flags tell the two apart, so neither gets the short one.
    """
    owners: dict[str, set[str]] = {}
    for leaf in leaves:
        for flag in (*leaf.flags, *(f"--no-{f[2:]}" for f in leaf.flags), *leaf.off_flags, *leaf.deprecated):
            owners.setdefault(flag, set()).add(leaf.path)
    shared = {flag for flag, paths in owners.items() if len(paths) > 1}

    def keep(flags: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f for f in flags if f not in shared)

    return [dataclasses.replace(leaf, flags=keep(leaf.flags), off_flags=keep(leaf.off_flags),
                                deprecated=keep(leaf.deprecated)) for leaf in leaves]


def leaf_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted path: value}`` of every leaf setting of a dataclass instance."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaf_values(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def _as_flag_text(value: Any) -> str:
    """A parsed value as jsonargparse reads a flag's text (JSON is YAML)."""
    import json

    return json.dumps(value)


def read_settings_file(root: type, path: str) -> Any:
    """A YAML file whose keys mirror dataclass ``root`` (errors name the file and the key or line)."""
    from specstop.config_io import dataclass_from_dict, read_yaml

    return dataclass_from_dict(root, read_yaml(path) or {}, "", str(path))


class TypedCommand:
    """The parser of one command whose settings are the dataclass ``root``.

    Args:
        root: the settings dataclass (nested dataclasses become sections).
        prog: ``specstop NAME``, for help and errors.
        description: the command's help text.
        load_file: reads ``--config FILE`` into a ``root`` instance; default: the YAML file's keys
            mirror the dataclass (:func:`read_settings_file`).
        config_help: help of ``--config``.
        config_flag: False for a command whose ``--config`` is a setting of its own (``specstop
            sweep``'s base train config): it then reads no settings file.
    """

    def __init__(
        self,
        root: type,
        *,
        prog: str,
        description: str = "",
        load_file: Callable[[str], Any] | None = None,
        config_help: str = "YAML config file; flags override it",
        config_flag: bool = True,
    ) -> None:
        import jsonargparse

        # Help text comes from the docstring under each field (litgpt-style).
        jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
        self.root, self.prog = root, prog
        self.load_file = load_file or (lambda path: read_settings_file(root, path))
        self.config_flag = config_flag
        usage = f"{prog} {'[--config FILE] ' if config_flag else ''}[--SETTING VALUE ...] [options]"
        epilog = "Every --a_b flag may also be spelt --a-b."
        shapes = {_shape(leaf.hint) for leaf in leaf_settings(root) if not (leaf.parse or leaf.repeatable)}
        if "mapping" in shapes:
            epilog += (" A mapping setting takes one key as --NAME.KEY VALUE, or the whole mapping as"
                       " --NAME '{key: value}'.")
        if "list" in shapes:
            epilog += (" A list setting takes the whole list in YAML (or JSON) list syntax, --NAME '[a, b]' or"
                       " --NAME '[{key: value}]', which replaces the file's list.")
        self.parser = jsonargparse.ArgumentParser(prog=prog, description=description, usage=usage, epilog=epilog,
                                                  exit_on_error=False, formatter_class=_short_flags_help())
        if config_flag:
            self.parser.add_argument("--config", metavar="FILE", help=config_help)
        self.parser.add_class_arguments(root, None, fail_untyped=False, sub_configs=False)
        self._drop_section_file_options()
        self.leaves = leaf_settings(root)
        self._by_dotted = {leaf.dotted_flag: leaf for leaf in self.leaves}
        self._typed: dict[str, tuple[str, str]] = {}
        self._section_flags: list[str] = []
        self._spellings: dict[str, tuple[_Leaf, bool | None, str | None]] = {}
        for leaf in _without_shared_spellings(self.leaves):
            self._declare(leaf)

    def add_argument(self, *args, **kwargs) -> None:
        """A command flag that is not a setting (``--merge``, ``--no-progress``)."""
        clash = [a for a in args if a in self._spellings]
        if clash:
            raise ValueError(f"{self.prog}: {clash[0]} is already a setting's flag")
        self.parser.add_argument(*args, **kwargs)
        if args and not str(args[0]).startswith("-"):  # a positional: the usage line names it
            self.parser.usage += f" {str(args[0]).upper()}"

    # -- building ------------------------------------------------------------------------------------

    def _drop_section_file_options(self) -> None:
        """jsonargparse gives every section a ``--SECTION FILE`` option; one ``--config`` is enough,
        and ``--prompts`` is a setting's short spelling here."""
        for action in list(self.parser._actions):
            if type(action).__name__ == "_ActionConfigLoad":
                self.parser._remove_action(action)
                for option in action.option_strings:
                    self.parser._option_string_actions.pop(option, None)
                for group in self.parser._action_groups:
                    if action in group._group_actions:
                        group._group_actions.remove(action)

    def _declare(self, leaf: _Leaf) -> None:
        action = next(a for a in self.parser._actions if a.dest == leaf.path)
        # A top-level ``pair`` is already ``--pair``; the spelling is kept only where the flag's text
        # needs rewriting (a bare switch, a parsed or a repeatable value).
        plain = not (leaf.is_switch or leaf.parse or leaf.repeatable)
        short = tuple(f for f in leaf.flags if f != leaf.dotted_flag or not plain)
        leaf = dataclasses.replace(leaf, flags=short)
        names = list(leaf.flags)
        if leaf.is_switch and leaf.negatable:
            names += [f"--no-{f[2:]}" for f in leaf.flags]
        names += list(leaf.off_flags)
        # Shown by --help only (_ShortFlagsHelp): argv is rewritten to the dotted flag before parsing.
        action.short_flags = names
        action.hidden_flags = leaf.deprecated  # a deprecated spelling may be the dotted one (``--out``)
        action.is_switch = leaf.is_switch
        action.required_setting = leaf.required  # --help says "required", not "default: null"
        if leaf.metavar:
            action.metavar = leaf.metavar
        for flag in leaf.flags:
            self._add_spelling(flag, leaf, True if leaf.is_switch else None, None)
            if leaf.is_switch and leaf.negatable:
                self._add_spelling(f"--no-{flag[2:]}", leaf, False, None)
        for off in leaf.off_flags:
            self._add_spelling(off, leaf, False, None)
        for old in leaf.deprecated:
            self._add_spelling(old, leaf, True if leaf.is_switch else None, leaf.flags[0] if leaf.flags else leaf.dotted_flag)

    def _add_spelling(self, flag: str, leaf: _Leaf, switch_value: bool | None, deprecated_for: str | None) -> None:
        taken = flag in self.parser._option_string_actions and flag != leaf.dotted_flag  # (--out of `out`)
        if flag in self._spellings or taken:
            raise ValueError(f"{self.prog}: the flag {flag} is declared twice")
        self._spellings[flag] = (leaf, switch_value, deprecated_for)

    # -- parsing -------------------------------------------------------------------------------------

    def _rewrite(self, argv: list[str]) -> list[str]:
        """Short and deprecated spellings -> the dotted flag, values already typed."""
        self._typed: dict[str, tuple[str, str]] = {}  # setting -> (spelling, text), for error messages
        out: list[str] = []
        given: dict[str, str] = {}
        items: dict[_Leaf, list] = {}  # repeatable settings, one item per occurrence
        i = 0
        while i < len(argv):
            arg = argv[i]
            name, eq, inline = arg.partition("=")
            found = self._spellings.get(name) if arg.startswith("--") else None
            underscored = "--" + name[2:].replace("-", "_")
            if found is None and arg.startswith("--") and underscored in self._by_dotted:
                # Every dotted flag may be spelt with dashes: --online-prompts = --online_prompts.
                name, arg = underscored, f"{underscored}{eq}{inline}"
            if found is None:
                dotted = self._by_dotted.get(name)
                if dotted is not None and (eq or i + 1 < len(argv)):
                    self._typed[dotted.path] = (name, inline if eq else argv[i + 1])
                out.append(arg)
                i += 1
                continue
            leaf, switch_value, deprecated_for = found
            if deprecated_for:
                log.warning("%s: note: %s is deprecated; use %s", self.prog, name, deprecated_for)
            if leaf.path in given and given[leaf.path] != name:
                raise UserError(f"give {given[leaf.path]} or {name}, not both")
            given[leaf.path] = name
            if switch_value is not None and not eq:
                value: Any = switch_value
                i += 1
            else:
                if eq:
                    text, i = inline, i + 1
                elif i + 1 < len(argv):
                    text, i = argv[i + 1], i + 2
                else:
                    raise UserError(f"{name} needs a value; see {self.prog} --help")
                self._typed[leaf.path] = (name, text)
                if leaf.repeatable:
                    items.setdefault(leaf, []).append(leaf.parse(text) if leaf.parse else text)
                    continue
                if leaf.parse is None:
                    out.append(f"{leaf.dotted_flag}={text}")
                    continue
                try:
                    value = leaf.parse(text)
                except UserError:
                    raise
                except (TypeError, ValueError) as err:
                    raise UserError(f"{name} {text!r}: {err}") from None
            out.append(f"{leaf.dotted_flag}={_as_flag_text(value)}")
        out += [f"{leaf.dotted_flag}={_as_flag_text(values)}" for leaf, values in items.items()]
        return out

    def _setting_of(self, name: str) -> tuple[_Leaf | None, str]:
        """The setting a flag names, and the dotted key below it: ``--data.generation.top_p`` ->
        (``data``, ``generation.top_p``); ``--online-prompts`` -> (``online_prompts``, ``""``); a name
        that is no setting's dotted flag (a short spelling, an unknown flag) -> (None, ``""``)."""
        if not name.startswith("--"):
            return None, ""
        dotted = name[2:].replace("-", "_")
        for leaf in self.leaves:
            if dotted == leaf.path:
                return leaf, ""
            if dotted.startswith(leaf.path + "."):
                return leaf, dotted[len(leaf.path) + 1:]
        return None, ""

    def _structured_flags(self, argv: list[str], file_values: dict[str, Any]) -> list[str]:
        """One rule for the flags of mapping and list settings, and for dotted keys below any setting.

        * A mapping setting (``data``): ``--data.generation.temperature 1.0`` sets one key inside the
          file's mapping (or the default's), the rest kept; a whole ``--data '{...}'`` replaces the
          file's, and keys given after it merge over it.
        * A list setting (``also_decoding``): the flag's value is the whole list in YAML (or JSON) list
          syntax, ``--also_decoding '[{temperature: 0.7}]'``; it replaces the file's list.
        * A dotted key below a setting that is not a mapping (``--online_prompts.x``) is refused.

        Values are read as YAML (``1.0`` a float, ``[a, b]`` a list) and a list is checked against the
        setting's type, so a misuse is one line naming the flag. The merged value goes on as one
        ``--NAME=JSON`` flag.
        """
        import json

        from specstop.config_io import check_flag_value, describe_type

        merged: dict[str, Any] = {}
        out: list[str] = []
        self._section_flags: list[str] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            name, eq, inline = arg.partition("=")
            leaf, key = self._setting_of(name)
            shape = _shape(leaf.hint) if leaf is not None else ""
            # A setting with its own text syntax (a comma list, a repeated flag) keeps it.
            if leaf is None or leaf.parse or leaf.repeatable or (shape == "scalar" and not key):
                out.append(arg)
                i += 1
                continue
            if key and shape != "mapping":
                what = {"list": "a list", "scalar": "a switch" if leaf.is_switch else describe_type(leaf.hint)}[shape]
                raise UserError(f"{name}: {leaf.path} is {what}, which has no key {key.split('.')[0]!r}; give "
                                f"{leaf.dotted_flag} {_example(leaf.hint)}")
            if not eq and i + 1 >= len(argv):
                raise UserError(f"{name} needs a value; see {self.prog} --help")
            text = inline if eq else argv[i + 1]
            i += 1 if eq else 2
            self._section_flags.append(name)
            value = _yaml_value(name, text)
            if shape == "list":
                if not isinstance(value, list) and not (value is None and _optional(leaf.hint)):
                    raise UserError(f"{name} {text!r}: give the whole list, e.g. {name} {_example(leaf.hint)}")
                merged[leaf.path] = check_flag_value(value, leaf.hint, name)
                continue
            if not key:  # the whole mapping
                if not isinstance(value, dict) and value is not None:
                    raise UserError(f"{name} {text!r}: give a mapping, e.g. {name} '{{key: value}}'")
                merged[leaf.path] = value
                continue
            if merged.get(leaf.path) is None:
                start = file_values[leaf.path] if leaf.path in file_values else self._default_of(leaf.path)
                merged[leaf.path] = json.loads(json.dumps(start or {}))  # a copy: the file's values stay as read
            node = merged[leaf.path]
            *parents, last = key.split(".")
            for depth, part in enumerate(parents):
                if not isinstance(node.get(part, {}), dict):
                    within = ".".join([leaf.path, *parents[: depth + 1]])
                    child = (parents[depth + 1:] or [last])[0]
                    raise UserError(f"{name}: {within} is not a mapping, so it has no key {child!r}")
                node = node.setdefault(part, {})
            node[last] = value
        return out + [f"--{path}={json.dumps(value)}" for path, value in merged.items()]

    @property
    def section_flags(self) -> list[str]:
        """The flags of the last :meth:`parse` that set mapping and list settings or keys inside them, as
        spelt (``--data.generation.temperature``): a later check of those sections can say that their values
        came from these flags as well as from the file."""
        return list(dict.fromkeys(self._section_flags))

    def _default_of(self, path: str) -> Any:
        """A setting's default value (``path`` dotted through nested sections)."""
        owner: Any = self.root
        *sections, name = path.split(".")
        for section in sections:
            owner = typing.get_type_hints(owner)[section]
        field = next(f for f in dataclasses.fields(owner) if f.name == name)
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else None

    def _config_path(self, argv: list[str]) -> str | None:
        for i, arg in enumerate(argv):
            if arg == "--config" and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith("--config="):
                return arg.partition("=")[2]
        return None

    def parse(self, argv: Sequence[str]) -> tuple[Any, argparse.Namespace]:
        """Parse ``argv`` into the settings and the command's other flags.

        Returns:
            ``(settings, flags)``: a ``root`` instance (file, then flags, over the defaults), and a
            namespace with the command flags added by :meth:`add_argument` (and ``config``).

        Raises:
            UserError: an unknown flag, a value of the wrong type, a bad config file.
        """
        argv = list(argv)
        path = self._config_path(argv) if self.config_flag else None
        file_values = leaf_values(self.load_file(path)) if path is not None else {}
        if path is not None:
            self.parser.set_defaults(file_values)
        argv = self._structured_flags(argv, file_values)
        try:
            ns = self.parser.parse_args(self._rewrite(argv))
            built = self.parser.instantiate(ns)
        except argparse.ArgumentError as err:
            raise UserError(self._message(str(err))) from None
        top = [f.name for f in dataclasses.fields(self.root)]
        settings = self.root(**{name: built[name] for name in top})
        values = leaf_values(settings)
        missing = [leaf.flags[0] if leaf.flags else leaf.dotted_flag for leaf in self.leaves
                   if leaf.required and values[leaf.path] is None]
        if missing and not getattr(built, "help", False):
            raise UserError(f"missing {', '.join(missing)}; see {self.prog} --help")
        from specstop.config_io import check_named_settings

        def spelled(key: str) -> str:  # the flag the user gave, else the config file the value came from
            if key in self._typed:
                return self._typed[key][0]
            return f"{path}: {key}" if path is not None else f"--{key}"

        check_named_settings(values, spelled)
        flags = argparse.Namespace(**{k: v for k, v in vars(built).items() if k not in top})
        return settings, flags


    def _message(self, text: str) -> str:
        """jsonargparse's error as one line in the user's own spelling of the flag."""
        import difflib
        import re

        from specstop.config_io import describe_type

        text = " ".join(part.strip() for part in text.splitlines() if part.strip())
        key = re.match(r'Parser key "([^"]+)"', text)
        leaf = next((lf for lf in self.leaves if key and lf.path == key.group(1)), None)
        if leaf is not None:
            spelled, value = self._typed.get(leaf.path, (leaf.dotted_flag, None))
            got = f", got {value!r}" if value is not None else ""
            return f"{spelled} must be {describe_type(leaf.hint)}{got}; see {self.prog} --help"
        unknown = re.match(r"unrecognized arguments: (\S+)", text)
        if unknown:
            token = unknown.group(1)
            if not token.startswith("-"):  # a value no flag took: a stray word, or a switch given a value
                return (f"unexpected value {token!r}: no flag takes it (each value follows its flag, and a "
                        f"switch takes none); see {self.prog} --help")
            # Only current spellings are offered: a near deprecated one is offered as its current name.
            current = {flag: instead for flag, (_, _, instead) in self._spellings.items() if instead}
            known = [*self._spellings, *(o for a in self.parser._actions for o in a.option_strings)]
            near = difflib.get_close_matches(token.split("=")[0], known, n=1)
            hint = f" (did you mean {current.get(near[0], near[0])}?)" if near else ""
            return f"unknown flag {token}{hint}; see {self.prog} --help"
        return f"{text}; see {self.prog} --help"


def _short_flags_help() -> type:
    """jsonargparse's help formatter, listing a setting's short spellings before its dotted flag."""
    from jsonargparse import DefaultHelpFormatter

    class ShortFlagsHelp(DefaultHelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str:
            # A required setting stays optional for argparse (a config file may give it), so it is
            # marked for the help only: "(required, type: ...)" instead of "default: null".
            if not getattr(action, "required_setting", False):
                return super()._get_help_string(action)
            action.required = True
            try:
                return super()._get_help_string(action)
            finally:
                action.required = False

        def _format_action_invocation(self, action: argparse.Action) -> str:
            short = list(getattr(action, "short_flags", ()))
            hidden = getattr(action, "hidden_flags", ())
            original = action.option_strings
            rest = [o for o in original if o not in short and o not in hidden]
            # A switch's short spellings take no value; only its dotted flag takes true/false.
            head = short if getattr(action, "is_switch", False) else []
            if head and not rest:
                return ", ".join(head)
            action.option_strings = rest if head else [*short, *rest]
            try:
                text = super()._format_action_invocation(action)
            finally:
                action.option_strings = original
            return ", ".join([*head, text])

    return ShortFlagsHelp
