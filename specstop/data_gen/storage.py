"""Atomic, verifiable shard storage and fast read-back of specstop datasets.

Layout::

    OUT/manifest.json
    OUT/shards/<split>-<index:05d>/{sequences,tokens,mixed,rollouts}/   # datasets Arrow folders
    OUT/shards/<split>-<index:05d>/_COMPLETE.json                      # written last

A shard is written under a temporary name and renamed into place only when every table and its
``_COMPLETE.json`` (file sizes + sha256) exist, so a crash can leave a ``.tmp-*`` folder but never
a half-written shard under its final name. :func:`verify_shard` re-checks sizes (and optionally
hashes) before a resumed run trusts a shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from specstop.data_gen.schema import TABLES, features_for
from specstop.errors import MissingInputError, UserError
from specstop.names import check_plain_name

COMPLETE_MARKER = "_COMPLETE.json"
MANIFEST = "manifest.json"


def shards_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "shards"


def shard_name(split: str, index: int) -> str:
    """``<split>-<index:05d>``; the split must be a plain name (the shard folder stays inside the dataset)."""
    return f"{check_plain_name(split, 'split name')}-{index:05d}"


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_records(folder: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != COMPLETE_MARKER:
            out[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return out


def write_shard(
    out_dir: str | Path,
    name: str,
    tables: Mapping[str, Mapping[str, Any]],
    *,
    k: int,
    hidden_size: int | None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write one shard atomically.

    Args:
        out_dir: dataset folder.
        name: shard name (see :func:`shard_name`).
        tables: ``{table: {column: list | np.ndarray}}`` for every table in ``TABLES`` (empty
            tables are allowed: give empty lists).
        k: top-k feature size. hidden_size: stored hidden width, or None when not stored.
        meta: extra facts recorded in ``_COMPLETE.json`` (e.g. the shard's prompt ids).

    Returns:
        The final shard path.
    """
    from datasets import Dataset

    root = shards_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    try:
        rows = {}
        for table in TABLES:
            cols = tables.get(table, {})
            feats = features_for(table, k, hidden_size)
            data = {c: _as_list_or_array(cols.get(c, [])) for c in feats}
            n = {len(v) for v in data.values()}
            if len(n) > 1:
                raise ValueError(f"shard {name} table {table}: columns have different lengths {sorted(n)}")
            ds = Dataset.from_dict(data, features=feats)
            ds.save_to_disk(str(tmp / table))
            rows[table] = len(ds)
        record = {"name": name, "rows": rows, "files": _file_records(tmp), "meta": dict(meta or {})}
        atomic_write_json(tmp / COMPLETE_MARKER, record)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _as_list_or_array(v):
    if isinstance(v, np.ndarray) and v.ndim >= 1:
        return v
    return list(v)


def read_json_or_none(path: str | Path) -> dict | None:
    """The JSON at ``path``, or None when it is missing or unreadable (e.g. cut off by a crash)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_shard_record(path: str | Path) -> dict | None:
    return read_json_or_none(Path(path) / COMPLETE_MARKER)


def verify_shard(path: str | Path, *, check_hashes: bool = False) -> bool:
    """True when the shard's marker exists and every recorded file has its recorded size (and hash)."""
    path = Path(path)
    rec = read_shard_record(path)
    if rec is None:
        return False
    for rel, info in rec.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["bytes"]:
            return False
        if check_hashes and _sha256(f) != info["sha256"]:
            return False
    return True


def clean_partial_shards(out_dir: str | Path) -> list[str]:
    """Remove ``.tmp-*`` leftovers of crashed writes and final-named shards that fail verification."""
    removed = []
    root = shards_root(out_dir)
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        if p.name.startswith(".tmp-") or (p.is_dir() and not verify_shard(p)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def complete_shards(out_dir: str | Path, split: str | None = None) -> list[Path]:
    """Verified shard folders, sorted by name, optionally of one split."""
    root = shards_root(out_dir)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or not p.is_dir():
            continue
        if split is not None and not p.name.startswith(f"{split}-"):
            continue
        if verify_shard(p):
            out.append(p)
    return out


def read_manifest(out_dir: str | Path) -> dict:
    p = Path(out_dir) / MANIFEST
    if not p.is_file():
        raise MissingInputError(
            f"{out_dir} has no {MANIFEST}: not a specstop dataset, or `specstop generate` has not finished "
            "(rerun it: finished shards are kept)"
        )
    return json.loads(p.read_text())


def load_table(out_dir: str | Path, table: str, split: str | None = None):
    """All verified shards' ``table`` as one ``datasets.Dataset`` (memory-mapped)."""
    from datasets import concatenate_datasets, load_from_disk

    if table not in TABLES:
        raise UserError(f"unknown table {table!r}; tables are {TABLES}")
    parts = []
    for p in complete_shards(out_dir, split):
        # An empty table is saved without any .arrow file, which load_from_disk cannot open:
        # skip tables whose shard record says they have no rows.
        if (read_shard_record(p) or {}).get("rows", {}).get(table, 1) == 0:
            continue
        parts.append(load_from_disk(str(p / table)))
    parts = [d for d in parts if len(d)]
    if not parts:
        man = read_manifest(out_dir)
        feats = features_for(table, man["labels"]["topk_k"], man["labels"].get("hidden_size"))
        from datasets import Dataset

        return Dataset.from_dict({c: [] for c in feats}, features=feats)
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def load_arrays(
    out_dir: str | Path, table: str, split: str | None = None, columns: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Columns of ``table`` as numpy arrays, straight from Arrow (no per-row Python).

    Fixed-size list columns (topk, hidden) come back 2-D ``[rows, width]``; variable-length list
    columns come back as ``(flat_values, offsets)`` tuples; strings as object arrays.
    """
    import pyarrow as pa

    ds = load_table(out_dir, table, split)
    tbl = ds.data.table
    if ds._indices is not None:  # pragma: no cover - we never select before this
        tbl = tbl.take(ds._indices.column(0))
    names = list(columns) if columns is not None else tbl.column_names
    out: dict[str, Any] = {}
    for c in names:
        if c not in tbl.column_names:
            raise KeyError(f"table {table!r} has no column {c!r} (columns: {tbl.column_names})")
        col = tbl.column(c).combine_chunks() if tbl.num_rows else tbl.column(c)
        typ = col.type
        if pa.types.is_fixed_size_list(typ):
            width = typ.list_size
            flat = col.flatten().to_numpy(zero_copy_only=False) if tbl.num_rows else np.zeros(0)
            out[c] = flat.reshape(-1, width)
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
            if tbl.num_rows:
                arr = col if not isinstance(col, pa.ChunkedArray) else col.combine_chunks()
                out[c] = (arr.flatten().to_numpy(zero_copy_only=False), arr.offsets.to_numpy())
            else:
                out[c] = (np.zeros(0), np.zeros(1, dtype=np.int64))
        elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
            out[c] = np.asarray(col.to_pylist(), dtype=object)
        else:
            out[c] = col.to_numpy(zero_copy_only=False)
    return out
