"""Label one shard's prompts: responses -> teacher-forced rows -> mixed rows -> rollouts -> tables.

This is the per-batch core of `specstop generate`, free of any file handling, so the benchmark
and tests can call it directly. The output dicts follow ``schema.features_for`` column names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.labels import teacher_labels
from specstop.data_gen.mixing import mixed_rows
from specstop.data_gen.responses import PreparedPrompt, Response, capture_fits, eos_ids, generate_responses
from specstop.data_gen.rollouts import greedy_rollouts, rollout_cap

log = logging.getLogger(__name__)


@dataclass
class BatchTables:
    """Column lists for the four tables, accumulated over batches."""

    sequences: dict[str, list] = field(default_factory=dict)
    tokens: dict[str, list] = field(default_factory=dict)
    mixed: dict[str, list] = field(default_factory=dict)
    rollouts: dict[str, list] = field(default_factory=dict)
    rollout_steps: int = 0
    response_tokens: int = 0

    def add(self, table: str, cols: dict) -> None:
        dst = getattr(self, table)
        for c, v in cols.items():
            dst.setdefault(c, []).append(v)

    def finish(self) -> dict[str, dict]:
        """``{table: {column: np.ndarray | list}}`` ready for ``storage.write_shard``."""
        out = {}
        for table in ("sequences", "tokens", "mixed", "rollouts"):
            cols = {}
            for c, parts in getattr(self, table).items():
                if parts and isinstance(parts[0], np.ndarray):
                    cols[c] = np.concatenate(parts)
                else:
                    cols[c] = [x for part in parts for x in part]
            out[table] = cols
        return out


def mixing_requested(cfg: DataGenConfig) -> bool:
    """Token mixing is asked for on some split: draws > 0, a rate below 1 (1 mixes nothing) and a split."""
    m = cfg.labels.mixing
    return m.draws > 0 and m.rate < 1.0 and bool(m.splits)


def mixing_enabled(cfg: DataGenConfig, split: str) -> bool:
    """Mixed rows are made on ``split``: asked for there, and hidden states (their features) are kept."""
    return cfg.labels.hidden_states and mixing_requested(cfg) and split in cfg.labels.mixing.splits


def mixing_notice(cfg: DataGenConfig) -> str | None:
    """The note that mixing asked for is skipped (it needs hidden states), or None: a run whose mixing
    is off (no draws, rate 1, no split) is told nothing about it."""
    if mixing_requested(cfg) and not cfg.labels.hidden_states:
        return "token mixing skipped: it produces hidden-state rows and labels.hidden_states is off"
    return None


def rollouts_enabled(cfg: DataGenConfig, split: str) -> bool:
    r = cfg.labels.rollouts
    # Sampled data get rejection rollouts (the continuation after a residual draw Y'_m, see
    # specstop.eval.sampled); greedy data the continuation after an argmax mismatch.
    return r.length > 0 and split in r.splits


def label_batch(
    pair, prompts: Sequence[PreparedPrompt], split: str, cfg: DataGenConfig, tables: BatchTables,
    responses: Sequence[Response] | None = None,
) -> None:
    """Generate responses for a batch of prompts (one split) and append every table's rows.

    Args:
        pair: the ModelPair.
        prompts: the batch (rendered; ``record`` is a PromptRecord).
        split: their split (decides mixing and rollouts).
        cfg: the run config.
        tables: accumulator the rows are appended to.
        responses: precomputed target responses (tests); generated when None.
    """
    gen, lab = cfg.generation, cfg.labels
    dec = gen.decoding()
    k = lab.topk_k
    if responses is None:
        capture = capture_fits(len(prompts), gen.max_new_tokens, pair.target_identity.logits_size,
                               next(pair.target.parameters()).dtype)
        responses = generate_responses(pair, prompts, gen, gen.seed, capture_logits=capture)
    pids = [p.record.prompt_id for p in prompts]
    pidx = [int(p.record.source_index) for p in prompts]
    p_ids = [p.ids for p in prompts]
    r_ids = [r.ids for r in responses]
    tables.response_tokens += sum(len(r) for r in r_ids)

    tables.add("sequences", {
        "prompt_id": pids,
        "split": [split] * len(prompts),
        "prompt_text": [str(p.record.text) for p in prompts],
        "prompt_ids": p_ids,
        "response_ids": r_ids,
        "response_text": [pair.tokenizer.decode(r, skip_special_tokens=True) for r in r_ids],
        "num_tokens": [len(r) for r in r_ids],
        "stop_reason": [r.stop_reason for r in responses],
        "prompt_truncated": [p.truncated for p in prompts],
    })

    teacher = teacher_labels(
        pair, pids, pidx, p_ids, r_ids, decoding=dec, k=k, seed=gen.seed,
        hidden=lab.hidden_states, chunk_rows=lab.chunk_rows,
        target_logits=[r.logits for r in responses] if all(r.logits is not None for r in responses) else None,
        keep_draft_cache=rollouts_enabled(cfg, split),
    )
    off = teacher.offsets
    row_prompt = np.repeat(np.arange(len(prompts)), np.diff(off))
    tables.add("tokens", {
        "prompt_id": [pids[b] for b in row_prompt],
        "split": [split] * off[-1],
        **teacher.columns,
    })

    if mixing_enabled(cfg, split):
        mix_prompt, mcols = mixed_rows(
            pair, pids, pidx, p_ids, teacher, decoding=dec, k=k, seed=gen.seed,
            rate=lab.mixing.rate, draws=lab.mixing.draws, batch_size=gen.batch_size, chunk_rows=lab.chunk_rows,
        )
        tables.add("mixed", {"prompt_id": [pids[b] for b in mix_prompt], "split": [split] * len(mix_prompt), **mcols})

    if rollouts_enabled(cfg, split):
        c = teacher.columns
        if dec.greedy:
            # Greedy drafting proposes argmax q_m; it is rejected iff that differs from X_m.
            mism = np.nonzero(c["draft_argmax"] != c["token"])[0]
            wrong = c["draft_argmax"]
        else:
            # Sampled: given that X_m is emitted, the draft token at m is rejected with probability
            # 1 - min(1, q_m(X_m) / p_m(X_m)) and was then Y'_m ~ norm(max(q_m - p_m, 0)).
            mism = np.nonzero(c["draft_prob"] < c["target_prob"])[0]
            wrong = c["reject_token"]
        prefixes, caps, owners, starts = [], [], [], []
        for r in mism:
            b = int(row_prompt[r])
            m = int(c["position"][r])
            prefixes.append(p_ids[b] + r_ids[b][:m] + [int(wrong[r])])
            starts.append((b, m))
            caps.append(rollout_cap(m, lab.rollouts.length, gen.max_new_tokens))
            owners.append((b, m, int(wrong[r])))
        pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
        rolls = greedy_rollouts(
            pair.draft, prefixes, caps, vocab_size=pair.vocab_size, decoding=dec, k=k,
            eos_ids=eos_ids(pair), pad_id=pad, hidden=lab.hidden_states, batch_size=lab.rollouts.batch_size,
            prefix=teacher.draft_prefix, starts=starts,
        ) if prefixes else []
        teacher.draft_prefix = None  # free the batch's KV cache
        cols = {
            "prompt_id": [pids[b] for b, _, _ in owners],
            "split": [split] * len(owners),
            "position": [m for _, m, _ in owners],
            "mismatch_token": [d for _, _, d in owners],
            "length": [len(ro.tokens) for ro in rolls],
            # Variable-length lists go in as numpy arrays (no per-float Python objects).
            "tokens": [ro.tokens for ro in rolls],
            "topk": [ro.topk.reshape(-1) for ro in rolls],
            "entropy": [ro.entropy for ro in rolls],
        }
        if lab.hidden_states:
            cols["mismatch_hidden"] = [ro.mismatch_hidden for ro in rolls]
            cols["hidden"] = [ro.hidden.reshape(-1) for ro in rolls]
        tables.rollout_steps += sum(len(ro.tokens) for ro in rolls)
        tables.add("rollouts", cols)
