"""Flag value conventions shared by the specstop subcommands.

``--checkpoint`` is ``[NAME=]PATH`` everywhere (:func:`split_checkpoint_arg`). The flags themselves
come from each command's settings dataclass (:mod:`specstop.config_cli`).
"""

from __future__ import annotations


def split_checkpoint_arg(text: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; a bare ``PATH`` -> ``(None, PATH)`` (the caller names it)."""
    name, sep, path = text.partition("=")
    if sep and name and "/" not in name and "\\" not in name:
        return name, path
    return None, text
