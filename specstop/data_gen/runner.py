"""Shard planning, resumable execution and the manifest of `specstop generate`.

Prompts are assigned to shards deterministically: per split (train, validation, test, then any
other split by name) in the order of the prompt list, ``prompts_per_shard`` at a time. Shard g
(counting over all splits) belongs to worker ``g % num_shards``. A finished shard records its
prompt ids and a fingerprint of the label settings; a rerun keeps verified shards whose record
matches and regenerates the rest, so no prompt is duplicated or dropped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specstop.data_gen import storage
from specstop.data_gen.card import write_dataset_card
from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.labels import LABELS_VERSION, label_semantics
from specstop.data_gen.ownership import check_no_foreign_files, clean_partial_shards
from specstop.data_gen.responses import default_render, eos_ids, max_prompt_tokens, prepare_prompts
from specstop.data_gen.schema import SCHEMA_VERSION
from specstop.data_gen.shard import BatchTables, label_batch, mixing_enabled, mixing_notice, rollouts_enabled
from specstop.data_gen.storage import complete_shards, read_shard_record, shard_name, write_shard
from specstop.errors import UserError
from specstop.jsonio import atomic_write_json
from specstop.outputs import claim_output_dir
from specstop.pair.identity import check_same_pair, pair_difference

log = logging.getLogger(__name__)

SPLIT_ORDER = ("train", "validation", "test")


class DataFolderConflict(UserError):
    """The data folder holds shards that this run must not mix with its own; nothing was changed.

    ``problem`` says what differs and ``fix`` what to do about ``generate --data``'s folder. A command
    that chose the folder itself (``specstop pipeline``'s ``RUN/data``) words its own fix from
    ``problem``, so no advice names a flag the user did not give.
    """

    def __init__(self, problem: str, fix: str, sep: str = "; ") -> None:
        super().__init__(f"{problem}{sep}{fix}")
        self.problem, self.fix = problem, fix


@dataclass
class ShardPlan:
    """One shard: ``ordinal`` counts over all splits (decides the worker)."""

    split: str
    index: int
    ordinal: int
    records: list

    @property
    def name(self) -> str:
        return shard_name(self.split, self.index)

    @property
    def prompt_ids(self) -> list[str]:
        return [r.prompt_id for r in self.records]


def plan_shards(records: Sequence, prompts_per_shard: int) -> list[ShardPlan]:
    """Deterministic shard assignment (see module docstring)."""
    by_split: dict[str, list] = {}
    for r in records:
        by_split.setdefault(r.split, []).append(r)
    seen = set()
    for r in records:
        if r.prompt_id in seen:
            raise UserError(f"prompt id {r.prompt_id!r} occurs twice; prompt ids must be unique (set id_field)")
        seen.add(r.prompt_id)
    splits = sorted(by_split, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else len(SPLIT_ORDER), s))
    plan, ordinal = [], 0
    for s in splits:
        recs = by_split[s]
        for i in range(0, len(recs), prompts_per_shard):
            plan.append(ShardPlan(s, i // prompts_per_shard, ordinal, recs[i : i + prompts_per_shard]))
            ordinal += 1
    return plan


def worker_from_env(num_shards: int | None, shard_index: int | None) -> tuple[int, int]:
    """``(num_shards, shard_index)`` from flags, else torchrun's ``WORLD_SIZE``/``RANK``, else (1, 0)."""
    import os

    n = num_shards if num_shards is not None else int(os.environ.get("WORLD_SIZE", "1"))
    i = shard_index if shard_index is not None else int(os.environ.get("RANK", "0"))
    if n < 1 or not 0 <= i < n:
        raise UserError(f"--shard-index must be in [0, --num-shards) and --num-shards >= 1; got index {i} of {n}")
    return n, i


def _shard_status(
    out_dir: Path, plan: ShardPlan, fingerprint: str, pair: dict | None = None, *, check_hashes: bool = True
) -> str:
    """'done' (verified, same prompts and settings), 'missing' or 'stale' (different prompts).

    ``check_hashes=False`` for shards this process has just written (their hashes were computed
    while writing; re-reading a large dataset twice at the end of a run buys nothing).

    Raises:
        UserError: the shard was made with other label settings, or (when ``pair`` is given) with
            another model pair or dtype - a dataset must never mix them.
    """
    path = storage.shards_root(out_dir) / plan.name
    if not path.is_dir() or not storage.verify_shard(path, check_hashes=check_hashes):
        return "missing"
    meta = (read_shard_record(path) or {}).get("meta", {})
    if meta.get("fingerprint") != fingerprint:
        raise DataFolderConflict(
            f"{path} was written with other label settings (fingerprint {meta.get('fingerprint')} != {fingerprint}); "
            "a dataset must not mix settings",
            "use a new --data folder, or delete that folder to start over", sep=": ",
        )
    diff = pair_difference(meta.get("pair"), pair, dtype=True, name=True) if pair is not None else None
    if diff is not None:
        raise DataFolderConflict(
            f"{path} was generated with another model pair or dtype than this run ({diff}); a dataset must not "
            "mix pairs",
            "rerun with the --pair/--draft/--target and --dtype it was started with, or use a new --data folder",
            sep=": ",
        )
    return "done" if meta.get("prompt_ids") == plan.prompt_ids else "stale"


def check_no_foreign_shards(out_dir: Path, plan: Sequence[ShardPlan]) -> None:
    names = {p.name for p in plan}
    foreign = [p.name for p in complete_shards(out_dir, strict=False) if p.name not in names]
    if foreign:
        raise DataFolderConflict(
            f"{out_dir} holds shards that this prompt set does not produce: {', '.join(foreign[:5])}"
            f"{' ...' if len(foreign) > 5 else ''} (from a run with another prompt set, --limit or "
            "prompts_per_shard?)",
            "use a new --data folder, or delete them",
        )


def generate_dataset(
    pair,
    records: Sequence,
    cfg: DataGenConfig,
    out_dir: str | Path,
    *,
    render: Callable[[str], list[int]] | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
    prompt_info: dict | None = None,
    progress: bool = True,
) -> dict:
    """Label ``records`` into ``out_dir`` (resumable); write the manifest when every shard is done.

    Args:
        pair: the loaded ModelPair.
        records: ``specstop.prompts.PromptRecord`` list (prompt_id, text, split, source_index, meta).
        cfg: the run config (validated here).
        out_dir: dataset folder.
        render: text -> prompt token ids; default ``specstop.prompts.render_prompt`` with the
            config's chat template and system prompt.
        num_shards, shard_index: this worker's share (shard g is done by worker g % num_shards).
        prompt_info: the manifest's ``prompts`` entry without ``counts`` (defaults from cfg.prompts).
        progress: show a tqdm bar.

    Returns:
        ``{"done": [...], "skipped": [...], "manifest": path or None}``.
    """
    cfg.validate()
    # Fail before any model work (and before creating the folder) rather than hours into a run.
    empty = [r.prompt_id for r in records if not str(r.text).strip()]
    if empty:
        raise UserError(f"prompt {empty[0]!r} is empty ({len(empty)} empty in all); remove it or fix the template/field")
    plan = plan_shards(records, cfg.prompts_per_shard)
    check_no_foreign_files(out_dir)  # nothing of the user's is cleaned or overwritten
    role = "all" if num_shards == 1 else f"worker-{shard_index}-of-{num_shards}"
    with claim_output_dir(out_dir, role=role, command=f"specstop generate --data {out_dir}") as out:
        return _generate_locked(
            pair, plan, cfg, out, render=render, num_shards=num_shards, shard_index=shard_index,
            prompt_info=prompt_info, progress=progress,
        )


def _generate_locked(pair, plan, cfg, out: Path, *, render, num_shards, shard_index, prompt_info, progress) -> dict:
    """:func:`generate_dataset` once the output folder is claimed (see there)."""
    import datasets
    from tqdm.auto import tqdm

    datasets.disable_progress_bars()  # one bar per table write would drown ours
    mine = [p for p in plan if p.ordinal % num_shards == shard_index]
    # Only this worker's shards: other workers of the job may be writing theirs right now.
    removed = clean_partial_shards(out, names=[p.name for p in mine])
    if removed:
        log.info("removed %d partial/corrupt shard folder(s) from an interrupted run: %s", len(removed), ", ".join(removed))
    check_no_foreign_shards(out, plan)
    fp = cfg.label_fingerprint()
    pair_id = json.loads(json.dumps(pair.to_dict()))  # as stored in shard records
    render = render or default_render(pair.tokenizer, cfg.prompts.chat_template, cfg.prompts.system_prompt)
    limit = max_prompt_tokens(pair, cfg.generation)
    hidden_size = pair.draft_identity.hidden_size if cfg.labels.hidden_states else None
    if (note := mixing_notice(cfg)) is not None:
        log.info("%s", note)
    if cfg.generation.temperature > 0 and cfg.labels.rollouts.length > 0 and cfg.labels.rollouts.splits:
        log.info("rollouts on %s are rejection rollouts (the continuation after a residual draw: sampled replay)",
                 ", ".join(cfg.labels.rollouts.splits))

    todo, skipped = [], []
    for p in mine:
        status = _shard_status(out, p, fp, pair_id)
        (skipped if status == "done" else todo).append(p)
        if status == "stale":
            log.info("shard %s holds other prompts than planned: regenerating it", p.name)
    if skipped:
        log.info("resuming: %d verified shard(s) kept, %d to generate", len(skipped), len(todo))
    pair_meta = {
        "pair": pair_id, "eos_token_id": eos_ids(pair), "max_prompt_tokens": limit,
        "hidden_size": hidden_size, "draft_hidden_size": pair.draft_identity.hidden_size,
    }
    bar = tqdm(total=sum(len(p.records) for p in todo), unit="prompt", disable=not progress, desc="generate")
    try:  # close the bar on errors too, so the error message starts on its own line
        _write_todo(pair, todo, cfg, out, render, limit, hidden_size, fp, pair_meta, bar)
    finally:
        bar.close()
    manifest = None
    written = {p.name for p in todo}
    if all(_shard_status(out, p, fp, check_hashes=p.name not in written) == "done" for p in plan):
        manifest = write_manifest(out, cfg, plan, prompt_info=prompt_info, just_written=written)
    elif num_shards > 1:
        log.info("worker %d/%d done; run with --merge once every worker has finished", shard_index, num_shards)
    return {"done": [p.name for p in todo], "skipped": [p.name for p in skipped], "manifest": manifest}


def _write_todo(pair, todo, cfg, out, render, limit, hidden_size, fp, pair_meta, bar) -> None:
    """Label and write the shards in ``todo`` (the body of :func:`generate_dataset`)."""
    from specstop.memory import check_memory

    t0, n_tok = time.perf_counter(), 0
    for p in todo:
        prepared, dropped = prepare_prompts(p.records, render, limit, cfg.generation.prompt_overflow)
        tables = BatchTables()
        bs = cfg.generation.batch_size
        for s in range(0, len(prepared), bs):
            check_memory()  # stop cleanly between batches; finished shards are kept
            label_batch(pair, prepared[s : s + bs], p.split, cfg, tables)
            bar.update(len(prepared[s : s + bs]))
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{(n_tok + tables.response_tokens) / dt:.1f}", prompt_s=f"{bar.n / dt:.2f}")
        bar.update(len(dropped))
        n_tok += tables.response_tokens
        meta = {
            "prompt_ids": p.prompt_ids, "fingerprint": fp, "split": p.split, "skipped_prompts": dropped,
            "rollout_steps": tables.rollout_steps, "response_tokens": tables.response_tokens, **pair_meta,
        }
        write_shard(out, p.name, tables.finish(), k=cfg.labels.topk_k, hidden_size=hidden_size, meta=meta)


def prompt_info_from_config(cfg: DataGenConfig) -> dict:
    pc = cfg.prompts
    field_name = pc.template.split(":", 1)[1] if pc.template and pc.template.startswith("field:") else None
    return {
        "source": pc.source, "field": field_name, "template": pc.template, "chat_template": pc.chat_template,
        "seed": pc.seed, "split_sizes": pc.split_sizes,
    }


def _arrow_bytes(shard: Path) -> int:
    return sum(f.stat().st_size for f in shard.rglob("*.arrow"))


def write_manifest(
    out_dir: str | Path,
    cfg: DataGenConfig,
    plan: Sequence[ShardPlan],
    *,
    prompt_info: dict | None = None,
    just_written: set[str] | frozenset[str] = frozenset(),
) -> Path:
    """Write ``manifest.json`` (keys as in docs/design.md) from the finished shards of ``plan``.

    ``just_written``: shards this process wrote a moment ago (checked by size, not re-hashed).

    Raises:
        UserError: a planned shard is missing, unverified or holds other prompts, or shards were
            generated with different pairs or dtypes.
    """
    from specstop import __version__

    out = Path(out_dir)
    fp = cfg.label_fingerprint()
    missing = [p.name for p in plan if _shard_status(out, p, fp, check_hashes=p.name not in just_written) != "done"]
    if missing:
        raise UserError(
            f"cannot write the manifest: {len(missing)} shard(s) not finished ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}); run the remaining workers (or rerun) first"
        )
    check_no_foreign_shards(out, plan)
    splits: dict[str, dict] = {}
    total_bytes = rows_tok = rows_mix = rows_roll = steps = 0
    meta0 = None
    for p in plan:
        path = storage.shards_root(out) / p.name
        rec = read_shard_record(path)
        if meta0 is not None:
            # Workers (or resumed runs) that loaded another pair or dtype must not be merged.
            check_same_pair(
                meta0.get("pair"), rec["meta"].get("pair"), dtype=True, name=True,
                what=f"cannot write the manifest: shard {p.name} was generated with another model pair or dtype "
                f"than shard {plan[0].name}",
                fix="regenerate the odd shards with the pair and --dtype of the others (delete their folders and rerun)",
            )
        meta0 = meta0 or rec["meta"]
        s = splits.setdefault(p.split, {"prompts": 0, "tokens": 0, "mixed": 0, "rollouts": 0})
        s["prompts"] += rec["rows"]["sequences"]
        s["tokens"] += rec["rows"]["tokens"]
        s["mixed"] += rec["rows"]["mixed"]
        s["rollouts"] += rec["rows"]["rollouts"]
        rows_tok += rec["rows"]["tokens"]
        rows_mix += rec["rows"]["mixed"]
        rows_roll += rec["rows"]["rollouts"]
        steps += rec["meta"].get("rollout_steps", 0)
        total_bytes += _arrow_bytes(path)
    meta0 = meta0 or {}
    hidden_on = cfg.labels.hidden_states
    H = meta0.get("draft_hidden_size") or 0
    # float16 hidden values are stored uncompressed: 2 bytes each, one vector per token row, mixed
    # row, rollout step and rollout (mismatch_hidden). With hidden states off that is an estimate.
    hidden_bytes = 2 * H * (rows_tok + rows_mix + steps + rows_roll)
    denom = max(rows_tok, 1)
    if hidden_on:
        bpt = {"with_hidden": total_bytes / denom, "without_hidden": (total_bytes - hidden_bytes) / denom}
    else:
        bpt = {"with_hidden": (total_bytes + hidden_bytes) / denom, "without_hidden": total_bytes / denom}
    g, lab = cfg.generation, cfg.labels
    all_splits = sorted(splits)
    info = dict(prompt_info or prompt_info_from_config(cfg))
    info["counts"] = {s: v["prompts"] for s, v in splits.items()}
    eos = meta0.get("eos_token_id")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "specstop_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "pair": meta0.get("pair"),
        "prompts": info,
        "generation": {
            "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_k": g.top_k, "top_p": g.top_p,
            "seed": g.seed, "batch_size": g.batch_size, "max_prompt_tokens": meta0.get("max_prompt_tokens"),
            "prompt_overflow": g.prompt_overflow,
            "eos_token_id": eos[0] if isinstance(eos, list) and len(eos) == 1 else eos,
        },
        "labels": {
            "version": LABELS_VERSION,
            "semantics": label_semantics(g.decoding()),
            "topk_k": lab.topk_k,
            "hidden_states": hidden_on,
            "hidden_size": meta0.get("hidden_size") if hidden_on else None,
            "hidden_layer": -1,
            "mixing": {"rate": lab.mixing.rate, "draws": lab.mixing.draws,
                       "splits": [s for s in all_splits if mixing_enabled(cfg, s)]},
            "rollouts": {"length": lab.rollouts.length,
                         "splits": [s for s in all_splits if rollouts_enabled(cfg, s)]},
        },
        "splits": splits,
        "bytes_per_token": bpt,
        # Every shard a reader must find (intact): a missing or damaged one is an error, not a skip.
        "shards": [p.name for p in plan],
        # ... and each shard's content digest: a shard folder copied in from another dataset is caught.
        "shard_digests": {p.name: storage.shard_digest(read_shard_record(storage.shards_root(out) / p.name))
                          for p in plan},
    }
    path = out / storage.MANIFEST
    atomic_write_json(path, manifest)
    write_dataset_card(out, manifest)  # README.md with configs: `datasets.load_dataset(out)` opens it
    log.info("wrote %s (%s)", path, ", ".join(f"{s}: {v['prompts']} prompts, {v['tokens']} tokens" for s, v in splits.items()))
    return path
