"""The dataset card (``README.md``) that makes a specstop dataset folder open with ``datasets``.

``datasets.load_dataset(DATA)`` on a local folder reads the card's YAML ``configs:`` list: one
config per table (``tokens``, ``sequences``, ``mixed``, ``rollouts``) whose ``data_files`` name
the Arrow shard files of each split, so::

    datasets.load_dataset("data/mbpp")                     # the token rows (default config)
    datasets.load_dataset("data/mbpp", "rollouts", split="test")

The shard files are the ones ``save_to_disk`` wrote (Arrow streaming format, which the ``arrow``
builder reads); nothing is copied. Tables or splits without rows are left out, because a pattern
that matches no file is an error in ``datasets``.

The card also carries a ``dataset_info:`` entry per table (bytes and rows per split). ``datasets``
keys its cache on the card's YAML only, not on the files' contents or times: without sizes that
change when the data do, ``load_dataset`` on a folder regenerated in place (another schema, other
rows) silently returns the previous generation's cached tables.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specstop.data_gen.schema import TABLES
from specstop.data_gen.storage import complete_shards, read_shard_record

CARD = "README.md"
DEFAULT_TABLE = "tokens"

_TABLE_TEXT = {
    "tokens": "one row per response token: top-k draft probabilities, entropy, hidden state, acceptance labels",
    "sequences": "one row per prompt: prompt and response token ids, split, prompt id",
    "mixed": "token-mixing rows (SpecDec++): hidden states of mixed draft/target prefixes with labels",
    "rollouts": "greedy rollouts after each mismatch (exact replay of speculative decoding)",
}


def _table_files(out: Path) -> dict[str, dict[str, dict]]:
    """Per table, per split: the relative Arrow file paths, their bytes and the rows they hold."""
    tables: dict[str, dict[str, dict]] = {}
    for table in TABLES:
        by_split: dict[str, dict] = {}
        for shard in complete_shards(out):
            rows = ((read_shard_record(shard) or {}).get("rows") or {}).get(table, 0)
            if not rows:
                continue
            split = shard.name.rsplit("-", 1)[0]
            files = sorted((shard / table).glob("*.arrow"))
            entry = by_split.setdefault(split, {"paths": [], "bytes": 0, "rows": 0})
            entry["paths"].extend(p.relative_to(out).as_posix() for p in files)
            entry["bytes"] += sum(p.stat().st_size for p in files)
            entry["rows"] += int(rows)
        if by_split:
            tables[table] = by_split
    return tables


def card_configs(out_dir: str | Path) -> list[dict]:
    """The ``configs:`` entries: per table, per split, the relative paths of its Arrow files."""
    configs = []
    for table, by_split in _table_files(Path(out_dir)).items():
        entry = {"config_name": table, "data_files": [{"split": s, "path": f["paths"]} for s, f in by_split.items()]}
        if table == DEFAULT_TABLE:
            entry["default"] = True
        configs.append(entry)
    return configs


def card_dataset_info(out_dir: str | Path) -> list[dict]:
    """The ``dataset_info:`` entries: per table, its bytes and, per split, bytes and rows (see the module doc)."""
    return [
        {
            "config_name": table,
            "dataset_size": sum(f["bytes"] for f in by_split.values()),
            "splits": [{"name": s, "num_bytes": f["bytes"], "num_examples": f["rows"]} for s, f in by_split.items()],
        }
        for table, by_split in _table_files(Path(out_dir)).items()
    ]


def write_dataset_card(out_dir: str | Path, manifest: dict) -> Path:
    """Write ``OUT/README.md`` (YAML configs + a short description) atomically.

    Args:
        out_dir: the dataset folder (shards finished).
        manifest: the manifest just written (pair, prompts, splits).
    """
    out = Path(out_dir)
    pair = manifest.get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path")
    target = (pair.get("target") or {}).get("name_or_path")
    meta = {
        "dataset_info": card_dataset_info(out),
        "configs": card_configs(out),
        "tags": ["specstop", "speculative-decoding"],
        "pretty_name": f"specstop labels: {(manifest.get('prompts') or {}).get('source')}",
    }
    splits = manifest.get("splits") or {}
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# {meta['pretty_name']}",
        "",
        f"Draft-position labels written by `specstop generate` for draft `{draft}` and target `{target}`",
        f"(decoding {manifest.get('generation', {}).get('temperature')!r} temperature). `manifest.json` holds",
        "every setting; docs/schemas.md describes each column.",
        "",
        "```python",
        "import datasets",
        f"tokens = datasets.load_dataset(DATA)                      # config {DEFAULT_TABLE!r}: {_TABLE_TEXT[DEFAULT_TABLE]}",
        "rollouts = datasets.load_dataset(DATA, \"rollouts\", split=\"test\")",
        "```",
        "",
        "| table | what a row is |",
        "|---|---|",
        *[f"| `{c['config_name']}` | {_TABLE_TEXT[c['config_name']]} |" for c in meta["configs"]],
        "",
        "| split | prompts | token rows | mixed rows | rollouts |",
        "|---|---|---|---|---|",
        *[f"| {s} | {v.get('prompts')} | {v.get('tokens')} | {v.get('mixed')} | {v.get('rollouts')} |" for s, v in splits.items()],
        "",
    ]
    from specstop.outputs import atomic_write_text

    return atomic_write_text(out / CARD, "\n".join(lines))
