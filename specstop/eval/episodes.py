"""Replay inputs: a dataset split as flat numpy arrays, one block of rows per prompt.

:class:`ReplayData` holds what greedy replay, sampled replay, PEARL and the tuner read:

* token rows (teacher forcing along the target's response X_0..X_{N-1}), concatenated over
  prompts in (prompt_id, position) order; prompt p owns rows ``offsets[p]:offsets[p+1]``;
* rollouts (greedy draft continuations after each mismatch position m), concatenated; rollout r
  owns rollout steps ``r_offsets[r]:r_offsets[r+1]`` and ``rollout_of_row[row]`` is its id (or -1);
* predictor scores per score key (one key per checkpoint): ``row_scores[key]`` [T] = sigmoid of
  the predictor on the row itself (dist: the row's topk/entropy/position; hidden: the row's
  ``hidden``), ``rollout_scores[key]`` [Rsteps] likewise for rollout steps, and
  ``mismatch_scores[key]`` [R] for the mismatch token d_m (hidden predictors read
  ``mismatch_hidden``; dist predictors the features of q_m, i.e. the mismatch row's score).

Which score a policy step uses (docs/design.md): dist predictors score token j itself; hidden
predictors score token j-1's hidden state (None at j = 1). Replay resolves that; this module only
stores per-token scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specstop.errors import UserError

TOKEN_COLUMNS = (
    "position",
    "token",
    "draft_argmax",
    "topk",
    "greedy_match",
    "accept_prob",
    "accept_expected",
    "tv",
)


@dataclass
class ReplayData:
    """A split ready for replay. Shapes: P prompts, T token rows, R rollouts, RS rollout steps.

    Attributes:
        prompt_ids: [P] object. offsets: [P+1] int64 row offsets. max_new_tokens: int.
        eos_token_ids: every id that ends a response (the target's generation config may list several,
            e.g. Qwen2.5 Instruct's [151645, 151643]); rollouts and decoding stop on any of them.
        greedy_match: [T] bool. token, draft_argmax: [T] int64. top1: [T] float64 (topk[:, 0]).
        accept_prob, accept_expected, tv: [T] float64 (sampling replay and reports).
        verified: [T] bool or None (the recorded Bernoulli acceptance, sampled data).
        rollout_of_row: [T] int64 rollout id of a mismatch row, -1 elsewhere.
        r_offsets: [R+1] int64. r_tokens: [RS] int64. r_top1: [RS] float64.
        row_scores / rollout_scores / mismatch_scores: {key: [T] / [RS] / [R] float64}.
        score_reads: {key: "dist" | "hidden"}.
        temperature: generation temperature (0 = greedy).
        source: where it came from (dataset path + split), for reports.
    """

    prompt_ids: np.ndarray
    offsets: np.ndarray
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    greedy_match: np.ndarray
    token: np.ndarray
    draft_argmax: np.ndarray
    top1: np.ndarray
    accept_prob: np.ndarray
    accept_expected: np.ndarray
    tv: np.ndarray
    rollout_of_row: np.ndarray
    r_offsets: np.ndarray
    r_tokens: np.ndarray
    r_top1: np.ndarray
    verified: np.ndarray | None = None
    row_scores: dict = field(default_factory=dict)
    rollout_scores: dict = field(default_factory=dict)
    mismatch_scores: dict = field(default_factory=dict)
    score_reads: dict = field(default_factory=dict)
    temperature: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        self.eos_token_ids = eos_tuple(self.eos_token_ids)

    def is_eos(self, tokens) -> np.ndarray:
        """Element-wise: is the token any of the EOS ids. ``[...] -> [...] bool``."""
        return np.isin(np.asarray(tokens), self.eos_token_ids)

    @property
    def num_prompts(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """[P] response lengths N."""
        return np.diff(self.offsets)

    @property
    def has_rollouts(self) -> bool:
        missing = (~self.greedy_match) & (self.rollout_of_row < 0)
        return not bool(missing.any())

    def add_scores(
        self, key: str, reads: str, row: np.ndarray, rollout: np.ndarray | None, mismatch: np.ndarray | None
    ) -> None:
        """Register a predictor's per-token scores under ``key`` (see module docstring)."""
        if reads not in ("dist", "hidden"):
            raise ValueError(f"reads must be 'dist' or 'hidden', got {reads!r}")
        row = np.asarray(row, dtype=np.float64)
        if row.shape != (self.num_tokens,):
            raise ValueError(f"row scores for {key!r} have shape {row.shape}, expected ({self.num_tokens},)")
        n_r = len(self.r_offsets) - 1
        if rollout is None:
            rollout = np.full(len(self.r_tokens), np.nan)
        if mismatch is None:
            # dist predictors: d_m is drawn from q_m, so its features are the mismatch row's.
            mm_rows = np.full(n_r, -1, dtype=np.int64)
            rows = np.flatnonzero(self.rollout_of_row >= 0)
            mm_rows[self.rollout_of_row[rows]] = rows
            mismatch = (
                np.where(mm_rows >= 0, row[np.maximum(mm_rows, 0)], np.nan)
                if reads == "dist"
                else np.full(n_r, np.nan)
            )
        self.row_scores[key] = row
        self.rollout_scores[key] = np.asarray(rollout, dtype=np.float64)
        self.mismatch_scores[key] = np.asarray(mismatch, dtype=np.float64)
        self.score_reads[key] = reads

    def subset(self, prompts: np.ndarray, *, max_new_tokens: int | None = None) -> ReplayData:
        """A new ReplayData with only the given prompt indices (in the given order).

        Args:
            prompts: [P'] prompt indices.
            max_new_tokens: cut every response to its first ``max_new_tokens`` rows and replay with that
                budget (what a decoder asked for fewer tokens than the dataset generated emits: greedy
                decoding is a prefix of the longer run). Default: the dataset's own budget.

        Raises:
            ValueError: ``max_new_tokens`` above the dataset's (the tokens after it were never recorded).
        """
        prompts = np.asarray(prompts, dtype=np.int64)
        budget = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= budget <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be in 1..{self.max_new_tokens} (the dataset's budget), got {budget}")
        lens = np.minimum(self.lengths[prompts], budget)
        rows = _ranges(self.offsets[prompts], lens)
        rids_old = self.rollout_of_row[rows]
        has = rids_old >= 0
        old_r = rids_old[has]
        r_lens = np.diff(self.r_offsets)[old_r]
        rsteps = _ranges(self.r_offsets[old_r], r_lens)
        new_rid = np.full(len(rows), -1, dtype=np.int64)
        new_rid[has] = np.arange(has.sum())
        out = ReplayData(
            prompt_ids=self.prompt_ids[prompts],
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            max_new_tokens=budget,
            eos_token_ids=self.eos_token_ids,
            greedy_match=self.greedy_match[rows],
            token=self.token[rows],
            draft_argmax=self.draft_argmax[rows],
            top1=self.top1[rows],
            accept_prob=self.accept_prob[rows],
            accept_expected=self.accept_expected[rows],
            tv=self.tv[rows],
            rollout_of_row=new_rid,
            r_offsets=np.concatenate([[0], np.cumsum(r_lens)]).astype(np.int64),
            r_tokens=self.r_tokens[rsteps],
            r_top1=self.r_top1[rsteps],
            verified=None if self.verified is None else self.verified[rows],
            temperature=self.temperature,
            source=self.source,
        )
        for k in self.row_scores:
            out.row_scores[k] = self.row_scores[k][rows]
            out.rollout_scores[k] = self.rollout_scores[k][rsteps]
            out.mismatch_scores[k] = self.mismatch_scores[k][old_r]
            out.score_reads[k] = self.score_reads[k]
        return out


def eos_tuple(eos) -> tuple[int, ...]:
    """EOS ids as a sorted tuple: one id, a list (manifests write a list when the target's generation
    config has several), or None (no EOS: nothing ends a response early)."""
    if eos is None:
        return ()
    if isinstance(eos, (int, np.integer)):
        return (int(eos),)
    return tuple(sorted({int(e) for e in eos}))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    idx = np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)
    return idx + np.repeat(np.asarray(starts, dtype=np.int64), lengths)


def from_arrays(
    greedy_match,
    *,
    lengths=None,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    token=None,
    draft_argmax=None,
    top1=None,
    accept_expected=None,
    accept_prob=None,
    tv=None,
    verified=None,
    rollouts: dict | None = None,
    temperature: float = 0.0,
) -> ReplayData:
    """Build :class:`ReplayData` from plain arrays (tests, benchmarks, synthetic studies).

    Args:
        greedy_match: [T] bool, prompts concatenated. lengths: [P] (default: one prompt).
        token / draft_argmax: [T] ints (default: token = 1..., draft_argmax = token where matched,
            else a different id; EOS never appears unless given).
        top1, accept_expected, accept_prob, tv: [T] floats (defaults: 0.5 / derived).
        rollouts: {global row index m: dict(tokens=[n], top1=[n])} for mismatch rows.
    """
    gm = np.asarray(greedy_match, dtype=bool)
    t = len(gm)
    lengths = np.asarray([t] if lengths is None else lengths, dtype=np.int64)
    if lengths.sum() != t:
        raise ValueError(f"lengths sum to {lengths.sum()} but greedy_match has {t} rows")
    token = np.asarray(token if token is not None else np.zeros(t), dtype=np.int64)
    if draft_argmax is None:
        draft_argmax = np.where(gm, token, token + 1)
        draft_argmax = np.where(~gm & np.isin(draft_argmax, eos_tuple(eos_token_id)), token + 2, draft_argmax)
    top1 = np.asarray(top1 if top1 is not None else np.full(t, 0.5), dtype=np.float64)
    acc = np.asarray(
        accept_expected if accept_expected is not None else gm.astype(np.float64), dtype=np.float64
    )
    rollouts = rollouts or {}
    rid = np.full(t, -1, dtype=np.int64)
    r_tok, r_top1, r_off = [], [], [0]
    for i, m in enumerate(sorted(rollouts)):
        if gm[m]:
            raise ValueError(f"row {m} has a rollout but greedy_match is True there")
        rid[m] = i
        r = rollouts[m]
        toks = np.asarray(r["tokens"], dtype=np.int64)
        r_tok.append(toks)
        r_top1.append(np.asarray(r.get("top1", np.full(len(toks), 0.5)), dtype=np.float64))
        r_off.append(r_off[-1] + len(toks))
    return ReplayData(
        prompt_ids=np.asarray([f"p{i}" for i in range(len(lengths))], dtype=object),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        max_new_tokens=int(max_new_tokens),
        eos_token_ids=eos_tuple(eos_token_id),
        greedy_match=gm,
        token=token,
        draft_argmax=np.asarray(draft_argmax, dtype=np.int64),
        top1=top1,
        accept_prob=np.asarray(accept_prob if accept_prob is not None else acc, dtype=np.float64),
        accept_expected=acc,
        tv=np.asarray(tv if tv is not None else 1.0 - acc, dtype=np.float64),
        rollout_of_row=rid,
        r_offsets=np.asarray(r_off, dtype=np.int64),
        r_tokens=np.concatenate(r_tok) if r_tok else np.zeros(0, dtype=np.int64),
        r_top1=np.concatenate(r_top1) if r_top1 else np.zeros(0),
        verified=None if verified is None else np.asarray(verified, dtype=bool),
        temperature=temperature,
    )


def load_replay_data(data_dir: str | Path, split: str, *, need_rollouts: bool | None = None) -> ReplayData:
    """Read one split of a specstop dataset into :class:`ReplayData` (no predictor scores yet).

    Args:
        data_dir: dataset folder (``manifest.json`` + ``shards/``).
        split: e.g. ``validation`` or ``test``.
        need_rollouts: raise when mismatch rows lack rollouts (default: when greedy).

    Raises:
        ValueError: the split is empty, positions are not 0..N-1 per prompt, or rollouts are missing.
    """
    from specstop.data_gen.storage import load_arrays, read_manifest

    man = read_manifest(data_dir)
    gen = man["generation"]
    k = int(man["labels"]["topk_k"])
    cols = ["prompt_id", *TOKEN_COLUMNS, "verified"]
    tok = load_arrays(data_dir, "tokens", split, columns=cols)
    if len(tok["position"]) == 0:
        raise UserError(
            f"split {split!r} of {data_dir} has no token rows; splits present: "
            f"{sorted(man.get('splits', {}))}. Pick another --split or regenerate the dataset."
        )
    pid_codes, pid_names = _codes(tok["prompt_id"])
    order = np.lexsort((tok["position"], pid_codes))
    pos = tok["position"][order].astype(np.int64)
    codes = pid_codes[order]
    counts = np.bincount(codes, minlength=len(pid_names))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    expect = np.arange(len(pos)) - np.repeat(offsets[:-1], counts)
    if not np.array_equal(pos, expect):
        raise UserError(
            f"{data_dir} split {split!r}: token positions are not 0..N-1 for every prompt (duplicate or missing "
            "rows; a shard may be incomplete). Rerun `specstop generate` on that folder to repair it."
        )
    gm = tok["greedy_match"][order].astype(bool)
    data = ReplayData(
        prompt_ids=pid_names,
        offsets=offsets,
        max_new_tokens=int(gen["max_new_tokens"]),
        eos_token_ids=eos_tuple(gen.get("eos_token_id")),
        greedy_match=gm,
        token=tok["token"][order].astype(np.int64),
        draft_argmax=tok["draft_argmax"][order].astype(np.int64),
        top1=tok["topk"][order][:, 0].astype(np.float64),
        accept_prob=tok["accept_prob"][order].astype(np.float64),
        accept_expected=tok["accept_expected"][order].astype(np.float64),
        tv=tok["tv"][order].astype(np.float64),
        verified=tok["verified"][order].astype(bool),
        rollout_of_row=np.full(len(order), -1, dtype=np.int64),
        r_offsets=np.zeros(1, dtype=np.int64),
        r_tokens=np.zeros(0, dtype=np.int64),
        r_top1=np.zeros(0),
        temperature=float(gen.get("temperature") or 0.0),
        source=f"{data_dir}:{split}",
    )
    data._order = order  # row permutation dataset -> replay order (scoring uses it)
    data._k = k
    roll = load_arrays(
        data_dir, "rollouts", split, columns=["prompt_id", "position", "length", "tokens", "topk"]
    )
    if len(roll["position"]):
        _attach_rollouts(data, roll, pid_names, k)
    if need_rollouts is None:
        need_rollouts = data.temperature == 0.0
    if need_rollouts and not data.has_rollouts:
        n_missing = int(((~data.greedy_match) & (data.rollout_of_row < 0)).sum())
        raise UserError(
            f"{data_dir} split {split!r}: {n_missing} mismatch positions have no rollout, so greedy replay cannot "
            "follow a policy past a mismatch. Regenerate with rollouts for this split "
            "(`specstop generate ... --labels.rollouts.splits` including it)."
        )
    return data


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    names, inv = np.unique(values.astype(str), return_inverse=True)
    return inv.astype(np.int64), names.astype(object)


def _attach_rollouts(data: ReplayData, roll: dict, pid_names: np.ndarray, k: int) -> None:
    index = {n: i for i, n in enumerate(pid_names)}
    p_idx = np.asarray([index.get(str(p), -1) for p in roll["prompt_id"]], dtype=np.int64)
    if (p_idx < 0).any():
        raise UserError(
            "rollout rows name prompts with no token rows; the dataset is inconsistent, regenerate it"
        )
    rows = data.offsets[p_idx] + roll["position"].astype(np.int64)
    order = np.argsort(rows, kind="stable")
    tok_flat, tok_off = roll["tokens"]
    topk_flat, topk_off = roll["topk"]
    lengths = np.diff(tok_off)[order]
    steps = _ranges(tok_off[:-1][order], lengths)
    data.r_tokens = tok_flat[steps].astype(np.int64)
    # topk is stored flat [n * k]: the top-1 of step t is element t * k of the row's block.
    top_starts = topk_off[:-1][order]
    t_in_row = np.arange(len(steps)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    data.r_top1 = topk_flat[np.repeat(top_starts, lengths) + t_in_row * k].astype(np.float64)
    data.r_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data.rollout_of_row[rows[order]] = np.arange(len(order))
    data._rollout_order = order  # rollout table row -> replay rollout id permutation
    data._rollout_steps = steps
