"""Random replay inputs with known structure, for tests and the replay benchmark (numpy only)."""

from __future__ import annotations

import numpy as np

from specstop.eval.episodes import ReplayData, from_arrays


def random_replay_data(
    n_prompts: int = 20,
    tokens: int = 60,
    *,
    seed: int = 0,
    match_rate: float = 0.75,
    rollout_length: int = 24,
    max_new_tokens: int | None = None,
    eos_token_id: int = 999,
    eos_end: bool = True,
    eos_rate: float = 0.02,
    score_levels: int | None = None,
    vary_lengths: bool = True,
) -> ReplayData:
    """Random greedy replay data with rollouts and two score keys ("dist" and "hidden").

    Args:
        n_prompts / tokens: prompts and (maximum) response length N.
        match_rate: P(greedy_match) per position.
        rollout_length: stored rollout steps (truncated at max_new_tokens - 2 like data_gen).
        max_new_tokens: default ``tokens`` (length-stopped responses hit it exactly).
        eos_end: responses shorter than max_new_tokens end with EOS (matched or not).
        eos_rate: chance that a rollout token or a mismatch token is EOS.
        score_levels: quantise scores to this many levels (creates ties), None for continuous.
    """
    rng = np.random.default_rng(seed)
    max_new = max_new_tokens or tokens
    lens = (
        rng.integers(max(2, tokens // 3), tokens + 1, n_prompts)
        if vary_lengths
        else np.full(n_prompts, tokens)
    )
    lens = np.minimum(lens, max_new)
    t = int(lens.sum())
    gm = rng.random(t) < match_rate
    token = rng.integers(0, 500, t)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    if eos_end:
        for p in range(n_prompts):
            if lens[p] < max_new:
                token[offsets[p + 1] - 1] = eos_token_id
    dam = np.where(gm, token, (token + 1 + rng.integers(0, 400, t)) % 500)
    dam = np.where(~gm & (rng.random(t) < eos_rate), eos_token_id, dam)
    rollouts = {}
    pos = np.arange(t) - np.repeat(offsets[:-1], lens)
    for m in np.flatnonzero(~gm):
        n = max(0, min(rollout_length, max_new - 2 - int(pos[m])))
        toks = rng.integers(0, 500, n)
        if n:
            toks[rng.random(n) < eos_rate] = eos_token_id
            e = np.flatnonzero(toks == eos_token_id)
            if len(e):
                toks = toks[: e[0] + 1]  # a rollout stops after EOS
        rollouts[int(m)] = {"tokens": toks, "top1": _q(rng.random(len(toks)), score_levels)}
    data = from_arrays(
        gm,
        lengths=lens,
        max_new_tokens=max_new,
        eos_token_id=eos_token_id,
        token=token,
        draft_argmax=dam,
        top1=_q(rng.random(t), score_levels),
        accept_expected=np.clip(0.5 + 0.4 * (gm - 0.5) + 0.2 * rng.standard_normal(t), 0.01, 0.99),
        rollouts=rollouts,
    )
    rs = len(data.r_tokens)
    n_r = len(data.r_offsets) - 1
    # Scores correlated with matching so thresholds matter.
    data.add_scores(
        "dist",
        "dist",
        _q(np.clip(0.35 * gm + 0.65 * rng.random(t), 0, 1), score_levels),
        _q(rng.random(rs), score_levels),
        None,
    )
    data.add_scores(
        "hidden",
        "hidden",
        _q(np.clip(0.3 * gm + 0.7 * rng.random(t), 0, 1), score_levels),
        _q(rng.random(rs), score_levels),
        _q(rng.random(n_r), score_levels),
    )
    return data


def _q(x: np.ndarray, levels: int | None) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if levels is None:
        return x
    return np.round(x * levels) / levels
