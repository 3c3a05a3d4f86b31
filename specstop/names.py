"""Names that become paths: plain names only, and files confined to their folder.

Split names become shard folders (``shards/<split>-00000``), family names become run folders
(``train/<family>``), and an export's ``config.json`` names its weights file. A name holding a
path separator or ``..`` would write (or read, or delete) outside the folder the user chose, so
every such name is checked here. Only the standard library is imported (the export runtime uses it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specstop.errors import UserError

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def check_plain_name(name: object, what: str) -> str:
    """Return ``name`` when it is a plain name (letters, digits, ``_``, ``-``, ``.``; no ``..``).

    Args:
        name: the candidate (from a config, flag or file).
        what: what it names, for the message (e.g. ``split name``).

    Raises:
        UserError: a non-string, an empty name, a path separator, ``..`` or other characters.
    """
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or ".." in name:
        raise UserError(
            f"{what} {name!r} is not a plain name: use letters, digits, '_', '-' and '.' only "
            "(no path separators, no '..', not empty)"
        )
    return name


def confined_file(root: str | Path, relative: object, what: str, *, links_into: str | Path | None = None) -> Path:
    """``root / relative`` when it stays inside ``root`` (no absolute paths, no ``..`` escapes).

    Args:
        root: the folder the file must be in.
        relative: the file's name as a file or config gives it.
        what: what names it, for the message.
        links_into: one more folder the file may lie in once symlinks are followed (a Hugging Face
            cache snapshot's files are links into its repository's ``blobs/``). The name itself
            must still stay inside ``root``.

    Raises:
        UserError: ``relative`` is not a string, is absolute, or resolves outside ``root`` (and
            outside ``links_into``).
    """
    root = Path(root)
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute():
        raise UserError(f"{what} {relative!r} must be a file name inside {root}, not an absolute or empty path")
    path = root / relative
    real = path.resolve()
    inside_root = _inside(real, root.resolve())
    if not inside_root and links_into is not None:
        # Through a link only: the name may not climb out of root ('..') on its way there.
        inside_root = _inside(Path(os.path.normpath(path)), Path(os.path.normpath(root))) and _inside(
            real, Path(links_into).resolve())
    if not inside_root:
        if _inside(Path(os.path.normpath(path)), Path(os.path.normpath(root))):
            # The name is fine; a symbolic link on the way leads out: blame the link, not what named it.
            allowed = f" (a link may lead only into {links_into})" if links_into is not None else ""
            raise UserError(
                f"{path} is a symbolic link that points outside {root}, to {real}{allowed}; copy the file into "
                "the folder instead of linking it"
            )
        raise UserError(f"{what} {relative!r} points outside {root}; it must name a file inside that folder")
    return path


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True
