"""Which parts of a dataset folder ``specstop generate`` wrote, so it never cleans, overwrites or
deletes anything else.

``generate --data DIR`` may be pointed at a folder that holds the user's own files. It only ever
removes or replaces:

* ``shards/.tmp-<shard>-<8 hex>`` folders (its own interrupted writes);
* ``shards/<split>-<NNNNN>`` folders that look like a shard it wrote: nothing in them but the four
  table folders (holding only what ``datasets.save_to_disk`` writes) and ``_COMPLETE.json``;
* ``manifest.json`` and ``README.md`` when they are its own manifest and dataset card.

Anything else under ``shards/``, or a foreign ``manifest.json``/``README.md``, is refused before
any work starts, in one line naming the path.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from specstop.data_gen.schema import TABLES
from specstop.data_gen.storage import COMPLETE_MARKER, MANIFEST, read_shard_record, shards_root, verify_shard
from specstop.errors import UserError

CARD = "README.md"
CARD_SIGNATURE = "written by `specstop generate`"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+-\d{5}$")
_TMP_NAME = re.compile(r"^\.tmp-[A-Za-z0-9_.-]+-\d{5}-[0-9A-Za-z]{1,32}$")
_TABLE_FILE = re.compile(r"^(data-\d{5}-of-\d{5}\.arrow|state\.json|dataset_info\.json)$")


class ForeignFilesError(UserError):
    """The output folder holds files specstop did not write where it would write its own."""


def is_tmp_shard(path: Path) -> bool:
    """A ``.tmp-<shard>-<uuid8>`` folder of an interrupted shard write."""
    return path.is_dir() and bool(_TMP_NAME.match(path.name))


def is_own_shard(path: Path) -> bool:
    """Does ``path`` look like a shard folder specstop wrote (complete or damaged)?"""
    if not path.is_dir() or not _SHARD_NAME.match(path.name):
        return False
    recorded = set((read_shard_record(path) or {}).get("files") or {})
    for entry in path.iterdir():
        if entry.name == COMPLETE_MARKER and entry.is_file():
            continue
        if entry.name not in TABLES or not entry.is_dir():
            return False
        for f in entry.rglob("*"):
            rel = str(f.relative_to(path))
            if f.is_dir() or (rel not in recorded and not _TABLE_FILE.match(f.name)):
                return False
    return True


def is_own_manifest(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "schema_version" in doc and "labels" in doc and "splits" in doc


def is_own_card(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return False
    return text.startswith("---") and CARD_SIGNATURE in text


def foreign_paths(out_dir: str | Path) -> list[Path]:
    """Paths in ``out_dir`` that ``generate`` would write over or clean but did not write."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    bad = []
    for name, own in ((MANIFEST, is_own_manifest), (CARD, is_own_card)):
        p = out / name
        if p.exists() and not (p.is_file() and own(p)):
            bad.append(p)
    root = shards_root(out)
    if root.exists() and not root.is_dir():
        bad.append(root)
    elif root.is_dir():
        bad += [p for p in sorted(root.iterdir()) if not (is_tmp_shard(p) or is_own_shard(p))]
    return bad


def check_no_foreign_files(out_dir: str | Path) -> None:
    """Refuse a ``--data`` folder where ``generate`` would overwrite or delete the user's files.

    Raises:
        ForeignFilesError: naming the first such path (and how many there are).
    """
    bad = foreign_paths(out_dir)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ForeignFilesError(
            f"--data {out_dir} holds {bad[0]}{more}, which specstop generate did not write and would overwrite or "
            "delete; nothing was changed. Use a new --data folder, or move those files away"
        )


def _tmp_owner(name: str) -> str:
    """The shard a ``.tmp-<shard>-<uuid8>`` folder was being written for."""
    return name[len(".tmp-"):].rsplit("-", 1)[0]


def clean_partial_shards(out_dir: str | Path, names: Iterable[str] | None = None) -> list[str]:
    """Remove ``.tmp-*`` leftovers of crashed writes and final-named shards that fail verification
    (only folders specstop wrote: :func:`is_tmp_shard`, :func:`is_own_shard`).

    Args:
        out_dir: dataset folder.
        names: only touch these shards (a worker cleans its own; others may be writing theirs).
    """
    removed = []
    root = shards_root(out_dir)
    if not root.is_dir():
        return removed
    mine = None if names is None else set(names)
    for p in sorted(root.iterdir()):
        owner = _tmp_owner(p.name) if p.name.startswith(".tmp-") else p.name
        if mine is not None and owner not in mine:
            continue
        # Only folders specstop wrote: a folder of the user's under a shard's name is never deleted.
        if is_tmp_shard(p) or (is_own_shard(p) and not verify_shard(p)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
