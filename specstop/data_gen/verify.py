"""Checking a finished dataset end to end before it is trusted (``train``, ``generate --verify``).

Every shard the manifest lists must be present and intact (every table, every file's size and
sha256), be the very shard the manifest recorded (its digest; its columns of the schema's types),
made by the pair the manifest names (same weights, tokenizer and dtype), and the shards' row counts
must add up to the manifest's. Anything else means rows would be silently missing or
mixed, so it is an error naming the shard and the fix.
"""

from __future__ import annotations

from pathlib import Path

from specstop.data_gen.storage import (
    DamagedDatasetError,
    digest_problem,
    expected_shards,
    read_manifest,
    read_shard_record,
    shard_column_problem,
    shard_problem,
    shards_root,
)
from specstop.pair.identity import pair_difference

_ROW_KEYS = {"sequences": "prompts", "tokens": "tokens", "mixed": "mixed", "rollouts": "rollouts"}
# A substituted shard passes its own completion record, so `specstop generate` would keep it.
_KEPT_BY_A_RERUN = " (it is intact on its own, so a rerun keeps it: delete that shard folder first)"


def dataset_problems(out_dir: str | Path) -> tuple[list[str], int]:
    """``(problems, shards checked)`` of a finished dataset; no problems means it is intact.

    Raises:
        MissingInputError: no manifest (not a finished dataset).
    """
    man = read_manifest(out_dir)
    names = expected_shards(out_dir, man) or []
    problems: list[str] = []
    totals: dict[str, dict[str, int]] = {}
    for name in names:
        path = shards_root(out_dir) / name
        problem = shard_problem(path, check_hashes=True)
        if problem is not None:
            problems.append(f"shard {name}: {problem}")
            continue
        rec = read_shard_record(path) or {}
        meta = rec.get("meta") or {}
        # The checks every reader makes (storage.complete_shards, storage.load_table).
        problem = digest_problem(man, name, rec) or shard_column_problem(path, man)
        if problem is not None:
            problems.append(f"shard {name}: {problem}{_KEPT_BY_A_RERUN}")
            continue
        diff = pair_difference(man.get("pair"), meta.get("pair"), dtype=True, name=True)
        if diff is not None:
            problems.append(f"shard {name}: made by another pair or dtype than the manifest names ({diff})")
        split = meta.get("split") or name.rsplit("-", 1)[0]
        acc = totals.setdefault(split, {})
        for table, n in (rec.get("rows") or {}).items():
            key = _ROW_KEYS.get(table, table)
            acc[key] = acc.get(key, 0) + int(n)
    if not problems:
        for split, counts in (man.get("splits") or {}).items():
            for key, want in counts.items():
                got = totals.get(split, {}).get(key, 0)
                if isinstance(want, int) and got != want:
                    problems.append(f"split {split}: the manifest counts {want} {key} rows but the shards hold {got}")
    return problems, len(names)


def verify_dataset(out_dir: str | Path) -> int:
    """Raise :class:`DamagedDatasetError` unless the dataset is intact; returns the shards checked."""
    problems, n = dataset_problems(out_dir)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise DamagedDatasetError(
            f"dataset {out_dir} is damaged: {problems[0]}{more}. Its rows would be silently missing or mixed; "
            "rerun the `specstop generate` command that made it (same config and --data): it regenerates only "
            f"damaged shards (`specstop generate --verify --data {out_dir}` lists every problem)"
        )
    return n
