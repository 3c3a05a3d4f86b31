"""Atomic, verifiable shard storage and fast read-back of specstop datasets.

Layout::

    OUT/manifest.json
    OUT/shards/<split>-<index:05d>/{sequences,tokens,mixed,rollouts}/   # datasets Arrow folders
    OUT/shards/<split>-<index:05d>/_COMPLETE.json                      # written last

A shard is written under a temporary name and renamed into place only when every table and its
``_COMPLETE.json`` (the tables it must hold, every file's size and sha256) exist, so a crash can
leave a ``.tmp-*`` folder but never a half-written shard under its final name.
:func:`shard_problem` re-checks the record - every expected table present, every file with its
size and sha256 - before a resumed run trusts a shard and whenever a finished dataset is read
(hashes are computed once per file and process). In a finished dataset (one with
``manifest.json``) a damaged or missing shard is an error, never silently skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from specstop.data_gen.schema import TABLES, features_for
from specstop.digest import sha256_file
from specstop.errors import MissingInputError, UserError
from specstop.jsonio import atomic_write_json, read_json_or_none
from specstop.names import check_plain_name
from specstop.outputs import naming_writes

COMPLETE_MARKER = "_COMPLETE.json"
MANIFEST = "manifest.json"


def shards_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "shards"


def shard_name(split: str, index: int) -> str:
    """``<split>-<index:05d>``; the split must be a plain name (the shard folder stays inside the dataset)."""
    return f"{check_plain_name(split, 'split name')}-{index:05d}"


_HASHES: dict[str, tuple[int, int, str]] = {}


def _sha256_cached(path: Path) -> str:
    """sha256 of ``path``, computed once per (size, mtime) in this process (readers call it often)."""
    st = path.stat()
    key = str(path.resolve())
    hit = _HASHES.get(key)
    if hit is not None and hit[:2] == (st.st_size, st.st_mtime_ns):
        return hit[2]
    digest = sha256_file(path)
    # A file modified within the filesystem's timestamp granularity of its last write keeps its
    # mtime: only remember hashes of files that have been quiet for a while.
    if time.time_ns() - st.st_mtime_ns > 2_000_000_000:
        _HASHES[key] = (st.st_size, st.st_mtime_ns, digest)
    return digest


def _file_records(folder: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != COMPLETE_MARKER:
            out[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
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
            with naming_writes(root / name / table):  # a full disk names the shard's table
                ds.save_to_disk(str(tmp / table))
            rows[table] = len(ds)
        files = _file_records(tmp)
        # Someone else deleting our temporary folder mid-write (a second writer without the lock)
        # must not produce a shard that lacks a table yet passes verification.
        lost = [t for t in TABLES if f"{t}/state.json" not in files]
        if lost:
            raise RuntimeError(f"shard {name}: tables {lost} vanished from {tmp} while it was written")
        record = {"name": name, "tables": list(TABLES), "rows": rows, "files": files, "meta": dict(meta or {})}
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


def read_shard_record(path: str | Path) -> dict | None:
    return read_json_or_none(Path(path) / COMPLETE_MARKER)


def shard_problem(path: str | Path, *, check_hashes: bool = True) -> str | None:
    """What is wrong with a shard folder, or None when it is complete and intact.

    Checks the completion record exists, lists every expected table, and that every recorded
    file has its recorded size (and sha256, with ``check_hashes``).
    """
    path = Path(path)
    if not path.is_dir():
        return "the shard folder is missing"
    rec = read_shard_record(path)
    if rec is None:
        return f"no readable {COMPLETE_MARKER} (the write was interrupted)"
    files = rec.get("files") or {}
    # Records from before "tables" existed must still hold all four tables.
    for table in rec.get("tables") or TABLES:
        if f"{table}/state.json" not in files:
            return f"table {table!r} is missing from its completion record"
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            return f"file {rel} is missing"
        if f.stat().st_size != info.get("bytes"):
            return f"file {rel} has {f.stat().st_size} bytes, its record says {info.get('bytes')}"
        if check_hashes and _sha256_cached(f) != info.get("sha256"):
            return f"file {rel} does not match its recorded sha256 (its bytes changed)"
    return None


def verify_shard(path: str | Path, *, check_hashes: bool = True) -> bool:
    """True when :func:`shard_problem` finds nothing wrong."""
    return shard_problem(path, check_hashes=check_hashes) is None


def shard_digest(record: Mapping[str, Any] | None) -> str | None:
    """One sha256 over a shard's recorded files (name, size, sha256) and prompt ids.

    The manifest keeps it per shard, which binds each shard to its dataset: a shard folder copied
    in from another dataset (another split seed, another prompt set) has another digest.
    """
    if not record:
        return None
    meta = record.get("meta") or {}
    body = {"files": record.get("files") or {}, "prompt_ids": meta.get("prompt_ids"), "split": meta.get("split")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def digest_problem(manifest: Mapping[str, Any] | None, name: str, record: Mapping[str, Any] | None) -> str | None:
    """What is wrong with shard ``name`` against the digest its dataset's manifest recorded, or None.

    A shard that checks out on its own (every file matches its completion record) can still be
    another shard: two shards swapped, one copied in from another dataset, or one rewritten with
    its record (a column re-typed). Manifests written before digests existed record none: None.
    """
    want = ((manifest or {}).get("shard_digests") or {}).get(name)
    if want is None or shard_digest(record) == want:
        return None
    return (
        "it is not the shard this dataset's manifest recorded (other files or prompts): swapped with another "
        "shard, rewritten, or a shard folder copied in from another dataset?"
    )


class DamagedDatasetError(UserError):
    """A finished dataset has a missing or damaged shard."""


def damaged_message(out_dir: str | Path, name: str, problem: str, *, substituted: bool = False) -> str:
    """The one line every reader prints for a missing, damaged or (``substituted``) wrong shard."""
    if substituted:  # intact on its own, so a rerun would keep it: it has to go first
        return (
            f"dataset {out_dir} is damaged: shard {name}: {problem}. Reading on would silently mix in rows that "
            f"are not this dataset's; delete (or move away) {shards_root(out_dir) / name} and rerun the "
            "`specstop generate` command that made it (same config and --data): it regenerates the missing shard "
            f"(`specstop generate --verify --data {out_dir}` lists every problem)"
        )
    return (
        f"dataset {out_dir} is damaged: shard {name}: {problem}. Reading on would silently drop its rows; "
        "rerun the `specstop generate` command that made it (same config and --data): it regenerates only "
        f"damaged shards (`specstop generate --verify --data {out_dir}` lists them all)"
    )


def table_schema(manifest: Mapping[str, Any] | None, table: str):
    """The ``datasets.Features`` ``table`` has in a finished dataset with this manifest, or None
    when the manifest does not say (no ``labels.topk_k``)."""
    labels = manifest.get("labels") if isinstance(manifest, Mapping) else None
    if not isinstance(labels, Mapping) or not isinstance(labels.get("topk_k"), int):
        return None
    hidden = labels.get("hidden_size")
    return features_for(table, labels["topk_k"], hidden if isinstance(hidden, int) else None)


def table_problem(table_dir: str | Path, table: str, schema: Mapping[str, Any] | None) -> str | None:
    """What keeps a shard's ``table`` folder from being read as the dataset's schema, or None.

    The one column check of a finished dataset: every reader makes it before opening a table
    (:func:`load_table`) and ``generate --verify`` makes it on every table, so verification passes
    exactly what the readers accept. Types are read from ``dataset_info.json`` (what ``datasets``
    reports) and from each Arrow file's own schema (what the file holds: a file rewritten with
    another type under the old ``dataset_info.json`` is silently cast, or refused, on load).
    Columns the schema does not know, and schema columns a shard lacks (data from an older labels
    version), are left to the readers that ask for them; an Arrow file and ``dataset_info.json``
    must still agree on those, or ``datasets`` cannot open the table.

    Args:
        table_dir: the shard's table folder (``<shard>/<table>``).
        table: the table's name (for the message).
        schema: the table's ``datasets.Features`` in this dataset (:func:`table_schema`), or None
            when the manifest does not say.
    """
    table_dir = Path(table_dir)
    sources = []  # (where, {column: arrow type})
    info = read_json_or_none(table_dir / "dataset_info.json")
    if isinstance(info, dict) and isinstance(info.get("features"), dict):
        try:
            sources.append(("dataset_info.json", _arrow_types(_features(info["features"]).arrow_schema)))
        except (TypeError, ValueError, KeyError) as err:
            return f"table {table!r}: dataset_info.json lists features datasets cannot read ({err}; the shard was rewritten)"
    state = read_json_or_none(table_dir / "state.json")
    for entry in (state.get("_data_files") or []) if isinstance(state, dict) else []:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not (table_dir / name).is_file():
            return f"table {table!r}: state.json lists a data file {name!r} that is not there (the shard was rewritten)"
        try:
            sources.append((name, _arrow_types(_arrow_file_schema(table_dir / name))))
        except Exception as err:  # pyarrow raises several types for a file that is not an Arrow stream
            return f"table {table!r}: {name} is not an Arrow stream ({type(err).__name__}; the shard was rewritten)"
    want = _arrow_types(_features(schema).arrow_schema) if schema else {}
    for where, got in sources:
        for column, typ in got.items():
            if column in want and typ != want[column]:
                return (
                    f"table {table!r} column {column!r} is {_arrow_type_name(typ)} in {where} but the dataset's "
                    f"schema says {_arrow_type_name(want[column])} (the shard was rewritten)"
                )
    if len(sources) > 1 and sources[0][0] == "dataset_info.json":
        described = sources[0][1]
        for where, got in sources[1:]:
            if set(got) != set(described) or any(got[c] != described[c] for c in got):
                return (
                    f"table {table!r}: {where} holds other columns or types than its dataset_info.json "
                    "describes (the shard was rewritten)"
                )
    return None


def shard_column_problem(path: str | Path, manifest: Mapping[str, Any] | None) -> str | None:
    """:func:`table_problem` of every table a shard holds."""
    for table in TABLES:
        if (Path(path) / table).is_dir():
            problem = table_problem(Path(path) / table, table, table_schema(manifest, table))
            if problem is not None:
                return problem
    return None


def _features(spec):
    from datasets import Features

    return spec if isinstance(spec, Features) else Features.from_dict(dict(spec))


def _arrow_file_schema(path: Path):
    """The schema an Arrow stream file (as ``datasets`` saves them) declares, read from its header."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).schema


def _arrow_types(schema) -> dict[str, Any]:
    return {field.name: field.type for field in schema}


def _arrow_type_name(typ) -> str:
    from datasets.features.features import generate_from_arrow_type

    try:
        return _type_name(generate_from_arrow_type(typ))
    except (TypeError, ValueError, NotImplementedError):
        return str(typ)


def _type_name(feature) -> str:
    return str(getattr(feature, "dtype", None) or feature)


def expected_shards(out_dir: str | Path, manifest: Mapping[str, Any] | None = None) -> list[str] | None:
    """Shard names a finished dataset must hold (its manifest's list; every shard folder for
    manifests written before the list existed), or None when there is no manifest.

    ``manifest``: the manifest when the caller has read it already.
    """
    man = manifest if manifest is not None else read_json_or_none(Path(out_dir) / MANIFEST)
    if man is None:
        return None
    if isinstance(man.get("shards"), list):
        return [str(n) for n in man["shards"]]
    root = shards_root(out_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def complete_shards(out_dir: str | Path, split: str | None = None, *, strict: bool | None = None) -> list[Path]:
    """Verified shard folders, sorted by name, optionally of one split.

    Every reader of a finished dataset comes through here (``load_table``, ``load_arrays``: train,
    tune, eval, replay), so each shard it returns is the one the manifest recorded: intact (every
    file as its completion record says) and, where the manifest records digests, that very shard
    (not one swapped, rewritten or copied in).

    Args:
        out_dir: dataset folder.
        split: only this split's shards.
        strict: raise :class:`DamagedDatasetError` for a missing, damaged or substituted shard
            instead of leaving it out. Default: strict when the dataset is finished (has a
            manifest); a dataset still being generated is read leniently (its unfinished shards are
            simply not there yet).
    """
    root = shards_root(out_dir)
    manifest = read_json_or_none(Path(out_dir) / MANIFEST)
    expected = expected_shards(out_dir, manifest)
    if strict is None:
        strict = expected is not None
    if strict and expected is not None:
        names = expected
    else:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    out = []
    for name in names:
        if split is not None and not name.startswith(f"{split}-"):
            continue
        problem = shard_problem(root / name)
        if problem is None and strict:
            wrong = digest_problem(manifest, name, read_shard_record(root / name))
            if wrong is not None:
                raise DamagedDatasetError(damaged_message(out_dir, name, wrong, substituted=True))
        if problem is None:
            out.append(root / name)
        elif strict:
            raise DamagedDatasetError(damaged_message(out_dir, name, problem))
    return out


def read_manifest(out_dir: str | Path) -> dict:
    p = Path(out_dir) / MANIFEST
    if not p.is_file():
        raise MissingInputError(
            f"{out_dir} has no {MANIFEST}: not a specstop dataset, or `specstop generate` has not finished "
            "(rerun it: finished shards are kept)"
        )
    try:
        man = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{p} is not valid JSON ({err}); rerun `specstop generate --merge` on {out_dir} to rewrite it") from None
    if not isinstance(man, dict):
        raise UserError(f"{p} is not a dataset manifest (a JSON object); rerun `specstop generate --merge` on {out_dir}")
    return man


def load_table(out_dir: str | Path, table: str, split: str | None = None):
    """All verified shards' ``table`` as one ``datasets.Dataset`` (memory-mapped)."""
    from datasets import concatenate_datasets, load_from_disk

    if table not in TABLES:
        raise UserError(f"unknown table {table!r}; tables are {TABLES}")
    parts = []
    schema = table_schema(read_json_or_none(Path(out_dir) / MANIFEST), table)
    for p in complete_shards(out_dir, split):
        # An empty table is saved without any .arrow file, which load_from_disk cannot open:
        # skip tables whose shard record says they have no rows.
        if (read_shard_record(p) or {}).get("rows", {}).get(table, 1) == 0:
            continue
        retyped = table_problem(p / table, table, schema)
        if retyped is not None:  # would crash loading or concatenation, or be read silently as another type
            raise DamagedDatasetError(damaged_message(out_dir, p.name, retyped, substituted=True))
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


def load_column_chunks(out_dir: str | Path, table: str, split: str | None, column: str) -> list[np.ndarray]:
    """A fixed-size-list column as ``[n_i, width]`` arrays, one per Arrow chunk, without copying.

    ``datasets`` memory-maps the shard files, so the arrays are views of the mapped buffers:
    processes that read the same dataset share its pages instead of each holding a copy
    (data-parallel training ranks). The arrays are read-only.
    """
    import pyarrow as pa

    tbl = load_table(out_dir, table, split).data.table
    if column not in tbl.column_names:
        raise KeyError(f"table {table!r} has no column {column!r} (columns: {tbl.column_names})")
    col = tbl.column(column)
    if not pa.types.is_fixed_size_list(col.type):
        raise ValueError(f"column {column!r} of {table!r} is {col.type}, not a fixed-size list")
    width = col.type.list_size
    out = []
    for chunk in col.chunks:
        if len(chunk) == 0:
            continue
        flat = chunk.flatten()  # respects the chunk's offset; zero-copy without nulls
        try:
            values = flat.to_numpy(zero_copy_only=True)
        except pa.ArrowInvalid:  # nulls or an unsupported type: fall back to a copy of this chunk
            values = flat.to_numpy(zero_copy_only=False)
        out.append(values.reshape(-1, width))
    return out
