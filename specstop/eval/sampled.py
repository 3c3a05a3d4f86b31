"""Replay of *sampled* speculative decoding (T > 0) as R greedy-style replays of acceptance draws.

Speculative sampling emits exactly the target's sampling distribution, so the recorded target
samples X (the dataset's responses) are what decoding emits, and every round can be simulated
*conditioned on that output*. At a drafted position i (all earlier drafts of the round accepted,
so the prefix is x, X_<i) the draft token Y ~ q_i is accepted with probability min(1, p_i(Y)/q_i(Y)),
else the residual norm(max(p_i - q_i, 0)) is drawn. Given that the emitted token is X_i:

* P(accepted | emitted X_i) = min(p_i(X_i), q_i(X_i)) / p_i(X_i) = c_i, and then Y = X_i;
* otherwise (probability 1 - c_i) Y was a draw from norm(max(q_i - p_i, 0)), independent of X_i;

and draws at different positions are independent given X. So a replay along X where position i is
"matched" with probability c_i - and, when not, the drafted token is a residual draw Y'_i whose
continuation the dataset's rejection rollouts hold - is an exact simulation of sampled speculative
decoding's rounds (drafted counts, acceptances, target passes), and averaging over the recorded
samples X ~ p averages over decoding's own randomness. Features are aligned: accepted steps read the
tokens rows (q_i, the state after X_{i-1}, the state after X_i), a rejected step reads q_i and, for
hidden-state heads, the state after Y'_i (``mismatch_hidden``).

One approximation, stated wherever results are reported: after the first rejection of a round
the remaining drafted tokens follow the stored greedy continuation of Y'_i (``rollouts.length``
steps; the draft would sample them) and, beyond it, the on-path rows i + 1, i + 2, ... as proxies
for the off-path features (past the end of a response, its last non-EOS row). That only changes how many wasted tokens a feature-reading policy
drafts after a rejection; static and heuristic policies are exact.

Each of the R copies is one realisation of every acceptance draw (seeded), built as greedy
:class:`~specstop.eval.episodes.ReplayData` (``greedy_match`` = the accepted draws), so the exact
greedy machinery - replay, the breakpoint tuner, segments, reports - runs on it unchanged: tuning
minimises the mean latency over the R realisations, and reports give its spread across them.

Theorem 1 of the theory paper (expected rejections with unbounded drafting = sum of TV) is checked
non-circularly: the copies' rejections come from c_i = min(1, q(X)/p(X)) at the sampled X, the
right-hand side from the full distributions' TV.
"""

from __future__ import annotations

import numpy as np

from specstop.errors import UserError
from specstop.eval.episodes import ReplayData, _ranges

DEFAULT_REPEATS = 16
APPROXIMATION = (
    "sampled replay: R realisations of the acceptance draws conditioned on the recorded target samples "
    "(exact per round); after a rejection the policy sees the stored greedy continuation of the rejected "
    "draft token, then on-path rows as proxies (affects only wasted drafts of feature-reading policies)"
)


def sampled_columns_required(data_dir, split: str) -> dict:
    """Load p_i(X_i), q_i(X_i), Y'_i and q_i(Y'_i) of a sampled split (in replay row order).

    Raises:
        UserError: the dataset predates labels version 3 (no such columns): regenerate it.
    """
    from specstop.data_gen.storage import load_arrays, read_manifest

    man = read_manifest(data_dir)
    version = int((man.get("labels") or {}).get("version") or man.get("labels_version") or 0)
    cols = ["target_prob", "draft_prob", "reject_token", "reject_draft_prob"]
    try:
        arr = load_arrays(data_dir, "tokens", split, columns=cols)
    except (KeyError, ValueError) as err:
        raise UserError(
            f"{data_dir} (labels version {version or 'unknown'}) lacks the columns sampled replay needs "
            f"({', '.join(cols)}): regenerate it with this specstop (`specstop generate` into a new folder)"
        ) from err
    return arr


def attach_sampled_columns(data: ReplayData, data_dir, split: str) -> None:
    """Read the sampled-replay columns into ``data`` (``data._sampled``), in its row order."""
    order = getattr(data, "_order", None)
    if order is None:
        raise ValueError("attach_sampled_columns needs ReplayData from load_replay_data")
    arr = sampled_columns_required(data_dir, split)
    data._sampled = {k: np.asarray(v)[order] for k, v in arr.items()}


def accept_given_output(data: ReplayData) -> np.ndarray:
    """``[T]`` c_i = min(1, q_i(X_i) / p_i(X_i)): P(the draft token at i is accepted | X_i emitted)."""
    s = data._sampled
    tp = np.asarray(s["target_prob"], dtype=np.float64)
    dp = np.asarray(s["draft_prob"], dtype=np.float64)
    return np.where(tp > 0, np.minimum(1.0, dp / np.maximum(tp, 1e-30)), 1.0)


def virtual_replay_data(data: ReplayData, *, repeats: int = DEFAULT_REPEATS, seed: int = 0,
                        max_steps: int = 20) -> ReplayData:
    """R copies of a sampled split as greedy :class:`ReplayData` (see the module docstring).

    Args:
        data: a sampled split from ``load_replay_data`` with :func:`attach_sampled_columns` and any
            predictor scores already added.
        repeats: R realisations of the acceptance draws.
        seed: seeds the draws (the same seed gives the same realisations: common random numbers,
            so policies and thresholds are compared on the same draws).
        max_steps: rollouts are extended with on-path proxies to this many steps (the largest SL_max
            any policy may use), or to the end of the response.

    Returns:
        ReplayData of R x P prompts (prompt ``p`` of copy ``r`` is ``"{id}#r"``), ``temperature`` kept,
        ``virtual_repeats = R``.
    """
    if data.temperature <= 0:
        raise ValueError("virtual_replay_data is for sampled data (T > 0)")
    if not hasattr(data, "_sampled"):
        raise ValueError("call attach_sampled_columns(data, data_dir, split) first")
    if repeats < 1:
        raise UserError(f"sampled replay needs at least one repeat, got {repeats}")
    s = data._sampled
    t, n_p = data.num_tokens, data.num_prompts
    c = accept_given_output(data)
    rng = np.random.default_rng(seed)
    accepted = rng.random((repeats, t)) < c[None, :]  # [R, T]
    prompt_of_row = np.repeat(np.arange(n_p), data.lengths)
    pos = np.arange(t) - data.offsets[prompt_of_row]
    ends = data.offsets[prompt_of_row + 1]

    # One rollout per row where a rejection is possible: the stored continuation of Y'_i, then
    # on-path proxies up to max_steps (or the response's end / the max_new_tokens - 2 limit).
    can_reject = c < 1.0
    rows = np.flatnonzero(can_reject)
    rid_old = data.rollout_of_row[rows]
    r_lens = np.diff(data.r_offsets)
    stored = np.where(rid_old >= 0, r_lens[np.maximum(rid_old, 0)] if len(r_lens) else 0, 0)
    limit = np.minimum(max_steps, np.maximum(data.max_new_tokens - 2 - pos[rows], 0))
    stored = np.minimum(stored, limit)
    # Proxies: rows m+stored+1, m+stored+2, ... A response that ended with EOS before max_new_tokens
    # has no rows past its end, yet the draft would keep drafting after a rejection there: the last
    # non-EOS row of the response (or row m itself) stands in for those steps too.
    ext = np.maximum(limit - stored, 0)
    lens = stored + ext
    rec_steps = _ranges(data.r_offsets[np.maximum(rid_old, 0)], stored)
    last = ends - 1
    last_plain = np.where(data.is_eos(data.token[last]), last - 1, last)
    cap = np.maximum(last_plain[rows], rows)
    ext_rows = np.minimum(_ranges(rows + stored + 1, ext), np.repeat(cap, ext))
    # Interleave per rollout: its stored steps, then its proxy rows.
    total = int(lens.sum())
    r_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    is_rec = np.zeros(total, dtype=bool)
    is_rec[_ranges(r_off[:-1], stored)] = True
    r_tokens = np.empty(total, dtype=np.int64)
    r_top1 = np.empty(total, dtype=np.float64)
    r_tokens[is_rec] = data.r_tokens[rec_steps]
    r_top1[is_rec] = data.r_top1[rec_steps]
    r_tokens[~is_rec] = data.token[ext_rows]
    r_top1[~is_rec] = np.asarray(s["draft_prob"], dtype=np.float64)[ext_rows]
    new_rid = np.full(t, -1, dtype=np.int64)
    new_rid[rows] = np.arange(len(rows))

    # Per row: the drafted token and its probability, as accepted (X_i, q_i(X_i)) or rejected (Y'_i).
    drafted_rej = np.asarray(s["reject_token"], dtype=np.int64)
    conf_acc = np.asarray(s["draft_prob"], dtype=np.float64)
    conf_rej = np.asarray(s["reject_draft_prob"], dtype=np.float64)
    gm = accepted.reshape(-1)
    tile = np.tile(np.arange(t), repeats)
    out = ReplayData(
        prompt_ids=np.asarray([f"{pid}#{r}" for r in range(repeats) for pid in data.prompt_ids], dtype=object),
        offsets=np.concatenate([[0], np.cumsum(np.tile(data.lengths, repeats))]).astype(np.int64),
        max_new_tokens=data.max_new_tokens,
        eos_token_ids=data.eos_token_ids,
        greedy_match=gm,
        token=data.token[tile],
        draft_argmax=np.where(gm, data.token[tile], drafted_rej[tile]),
        top1=np.where(gm, conf_acc[tile], conf_rej[tile]),
        accept_prob=data.accept_prob[tile],
        accept_expected=data.accept_expected[tile],
        tv=data.tv[tile],
        rollout_of_row=np.where(gm, -1, new_rid[tile]),
        r_offsets=r_off,
        r_tokens=r_tokens,
        r_top1=r_top1,
        verified=None,
        temperature=data.temperature,
        source=data.source,
    )
    for key in data.row_scores:
        row = data.row_scores[key]
        roll = np.empty(total, dtype=np.float64)
        roll[is_rec] = data.rollout_scores[key][rec_steps]
        roll[~is_rec] = row[ext_rows]
        mm_old = data.mismatch_scores[key]
        mm = np.where(rid_old >= 0, mm_old[np.maximum(rid_old, 0)] if len(mm_old) else np.nan, np.nan)
        if data.score_reads[key] == "dist":
            mm = row[rows]  # Y'_i was drawn from q_i: the row's own distribution features
        else:
            # Without a stored rejection rollout the state after Y'_i is unknown: the on-path proxy.
            mm = np.where(np.isnan(mm), row[rows], mm)
        out.row_scores[key] = row[tile]
        out.rollout_scores[key] = roll
        out.mismatch_scores[key] = mm
        out.score_reads[key] = data.score_reads[key]
    out.virtual_repeats = repeats
    out.virtual_prompts = n_p
    out.missing_rejection_rollouts = int((rid_old < 0).sum())
    return out


def per_copy_latency(data: ReplayData, spec, cost) -> np.ndarray:
    """``[R]`` latency per token of ``spec`` in each realisation (for spreads)."""
    from specstop.eval.segments import fast_replay

    r = int(getattr(data, "virtual_repeats", 1))
    n_p = int(getattr(data, "virtual_prompts", data.num_prompts))
    out = np.empty(r)
    for i in range(r):
        sub = data.subset(np.arange(i * n_p, (i + 1) * n_p))
        out[i] = fast_replay(sub, spec).metrics(cost)["latency_per_token"]
    return out


def spread(values: np.ndarray) -> dict:
    """Mean, standard deviation and 95% half-width over realisations."""
    v = np.asarray(values, dtype=np.float64)
    sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return {"mean": float(v.mean()), "std": sd, "ci95": 1.96 * sd / np.sqrt(len(v)) if len(v) > 1 else None,
            "repeats": int(len(v))}


def theorem1_check(data: ReplayData) -> dict:
    """Expected rejections with unbounded drafting vs the sum of TV (theory paper, Theorem 1).

    With unbounded drafting every position but a round's bonus is drafted. Along the recorded X the
    expected rejections are sum_i (1 - c_i) (c_i from p_i(X_i), q_i(X_i) of the sampled token) and
    E_X[1 - c_i] = TV(p_i, q_i); the right-hand side uses the full distributions' TV. They agree in
    expectation over X, so their difference is reported with its standard error over positions.
    """
    c = accept_given_output(data)
    one_minus_c = 1.0 - c
    tv = np.asarray(data.tv, dtype=np.float64)
    d = one_minus_c - tv
    return {
        "rejections_expected_at_samples": float(one_minus_c.sum()),
        "sum_tv": float(tv.sum()),
        "difference": float(d.sum()),
        "difference_se": float(d.std(ddof=1) * np.sqrt(len(d))) if len(d) > 1 else None,
        "positions": int(len(d)),
    }


def replayable(data: ReplayData, data_dir, split: str, *, repeats: int = DEFAULT_REPEATS, seed: int = 0,
               max_steps: int = 20) -> ReplayData:
    """``data`` ready for the exact replay machinery: greedy data as they are, sampled data as R
    realisations (:func:`virtual_replay_data`, with the Theorem 1 check attached). Call after scoring."""
    if data.temperature <= 0:
        return data
    attach_sampled_columns(data, data_dir, split)
    out = virtual_replay_data(data, repeats=repeats, seed=seed, max_steps=max_steps)
    out.theorem1 = theorem1_check(data)
    return out
