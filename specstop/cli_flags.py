"""Shared flag conventions of the specstop subcommands.

* The dataset folder is ``--data`` everywhere; older spellings stay as hidden aliases that
  print a deprecation note (:func:`add_deprecated_alias`).
* ``--checkpoint`` is ``[NAME=]PATH`` everywhere (:func:`split_checkpoint_arg`).
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


class _DeprecatedAlias(argparse.Action):
    """Stores like the new flag and tells the user the new spelling once (a log line, not an error)."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        log.warning("%s: note: %s is deprecated; use %s", parser.prog, option_string, self.new_flag)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    """Accept ``old`` as a hidden spelling of ``new`` (same ``dest``), printing a deprecation note."""
    parser.add_argument(old, dest=dest, action=_DeprecatedAlias, new_flag=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)


def split_checkpoint_arg(text: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; a bare ``PATH`` -> ``(None, PATH)`` (the caller names it)."""
    name, sep, path = text.partition("=")
    if sep and name and "/" not in name and "\\" not in name:
        return name, path
    return None, text


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default in ``--help``, except where there is none to show.

    Flags whose default is None (the value then comes from the config file or is decided at run
    time, which their help says), False switches, and helps that already name their default are
    left as written.
    """

    def _get_help_string(self, action):
        help_ = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in help_ or not action.option_strings:
            return help_
        return super()._get_help_string(action)
