"""Monte-Carlo replay of *sampled* speculative decoding (T > 0) from recorded acceptance probabilities.

Model (an approximation; state it wherever results are reported):

* the response is the recorded target response X_0..X_{N-1}; a round starting at s drafts
  K = K(s) tokens, where the policy reads the teacher-forced features of rows s, s+1, ... (the
  features along the recorded prefix, no rollouts);
* draft token j is accepted independently with probability ``accept_expected`` of its position
  (= 1 - TV(p_i, q_i), the acceptance probability of a *fresh* draft token at that prefix);
* after a rejection at position s + n the round emits the n accepted tokens plus the target's
  residual token, and the next round continues along the *recorded* rows at s + n + 1, as if the
  residual sample had equalled X_{s+n}.

What this ignores: in real sampled decoding the accepted/resampled tokens differ from X, so later
positions see other prefixes (other features, other TV). Per-position acceptance probabilities are
exact; path effects are not. The error should be measured against online decoding.

Theorem 1 of the theory paper (section 3): with unbounded draft length, E[number of rejections]
= sum over positions of TV(p_i, q_i). :func:`rejection_check` reports both sides.
"""

from __future__ import annotations

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData
from specstop.eval.replay import Counts, score_key
from specstop.policy import PolicySpec

Z95 = 1.96


def k_of_start(data: ReplayData, spec: PolicySpec, cap: int | None = None) -> np.ndarray:
    """[T] drafted length K(s) of a round starting at each row, from teacher-forced features.

    Not defined for the heuristic (its K depends on the past; :func:`mc_replay` handles it).
    ``cap`` overrides the policy cap (e.g. a huge one for "unbounded")."""
    t = data.num_tokens
    prompt = np.repeat(np.arange(data.num_prompts), data.lengths)
    pos = np.arange(t) - data.offsets[prompt]
    n_p = data.lengths[prompt]
    rem = data.max_new_tokens - pos
    c = np.minimum(spec.cap if cap is None else cap, rem - 1)
    # Drafting cannot run past the recorded response (EOS ends it; length caps it via rem).
    c = np.minimum(c, n_p - pos)
    c = np.maximum(c, 0)
    out = np.zeros(t, dtype=np.int64)
    cm = int(c.max(initial=0))
    if cm == 0:
        return out
    eos_row = data.is_eos(data.token)
    values, reads, rule = None, "dist", "below"
    if spec.kind == "confidence":
        values, rule = data.top1, spec.rule
    elif spec.kind == "predictor":
        key = score_key(spec)
        values, reads, rule = data.row_scores[key], data.score_reads.get(key, spec.reads), spec.rule
    x = -spec.threshold if spec.rule == "cumprod" else spec.threshold
    for i in range(0, t, 1 << 15):
        sl = slice(i, min(t, i + (1 << 15)))
        rows = np.arange(sl.start, sl.stop)
        js = np.arange(1, cm + 1)
        idx = np.minimum(rows[:, None] + js[None, :] - 1, t - 1)
        valid = js[None, :] <= c[sl, None]
        stop = valid & eos_row[idx]
        if values is not None:
            from specstop.eval.segments import _stop_values

            v = _stop_values(values, idx, valid, rule, reads)
            stop |= valid & (v < x)
        stop |= js[None, :] == c[sl, None]
        k = np.where(stop.any(1), stop.argmax(1) + 1, 0)
        out[sl] = np.where(c[sl] > 0, k, 0)
    return out


def mc_replay(
    data: ReplayData,
    spec: PolicySpec,
    cost: CostModel,
    *,
    repeats: int = 20,
    seed: int = 0,
    cap: int | None = None,
    use_recorded: bool = False,
) -> dict:
    """R independent Monte-Carlo replays; returns mean metrics, 95% CI of latency, mean rejections.

    Args:
        spec: any policy but oracle/pearl (the heuristic is simulated with its schedule).
        repeats: R. seed: RNG seed. cap: override the policy cap (None: the policy's).
        use_recorded: accept with the recorded ``verified`` draws (one realisation, R = 1) instead.
    """
    if spec.kind in ("oracle", "pearl"):
        raise ValueError(
            f"{spec.kind} is a greedy-replay baseline; Monte-Carlo replay takes static, heuristic, confidence or predictor policies"
        )
    rng = np.random.default_rng(seed)
    if use_recorded:
        if data.verified is None:
            raise ValueError("the data has no recorded `verified` column")
        repeats = 1
    heuristic = spec.kind == "heuristic"
    k_tab = None if heuristic else k_of_start(data, spec, cap)
    n_p = data.num_prompts
    lanes_p = np.repeat(np.arange(n_p), repeats)
    rep = np.tile(np.arange(repeats), n_p)
    s = data.offsets[lanes_p].copy()
    end = data.offsets[lanes_p + 1]
    sched = np.full(len(s), spec.start, np.int64)
    tot = {k: np.zeros(repeats, np.int64) for k in ("rounds", "drafted", "accepted", "emitted", "rejections", "target_only")}
    # [R, K_max + 1] rounds per drafted length: what a per-K cost table prices.
    k_width = int(min(spec.cap if cap is None else cap, data.max_new_tokens)) + 1
    hist = np.zeros((repeats, k_width), np.int64)
    alive = s < end
    s, end, lanes_p, rep, sched = s[alive], end[alive], lanes_p[alive], rep[alive], sched[alive]
    acc_p = data.accept_expected
    eos_row = data.is_eos(data.token)
    while len(s):
        pos = s - data.offsets[lanes_p]
        if heuristic:
            rem = data.max_new_tokens - pos
            k = np.minimum(np.maximum(1, np.minimum(sched, spec.sl_max)), np.minimum(rem - 1, end - s))
            k = np.maximum(k, 0)
        else:
            k = k_tab[s]
        km = int(k.max(initial=0))
        js = np.arange(km)
        idx = np.minimum(s[:, None] + js[None, :], len(acc_p) - 1)
        valid = js[None, :] < k[:, None]
        if heuristic and km:
            # The heuristic also stops at EOS.
            e = valid & eos_row[idx]
            k = np.where(e.any(1), np.minimum(k, e.argmax(1) + 1), k)
            valid = js[None, :] < k[:, None]
        if use_recorded:
            ok = data.verified[idx]
        else:
            ok = rng.random(idx.shape) < acc_p[idx]
        rej = valid & ~ok
        n_acc = np.where(rej.any(1), rej.argmax(1), k)
        last = np.maximum(s + k - 1, 0)
        eos_acc = (n_acc == k) & (k > 0) & eos_row[last]
        emitted = np.where(eos_acc, n_acc, n_acc + 1)
        for name, val in (
            ("rounds", np.ones_like(k)),
            ("drafted", k),
            ("accepted", n_acc),
            ("emitted", emitted),
            ("rejections", (n_acc < k).astype(np.int64)),
            ("target_only", (k == 0).astype(np.int64)),
        ):
            np.add.at(tot[name], rep, val)
        np.add.at(hist, (rep, k), 1)
        if heuristic:
            sched = np.where((k > 0) & (n_acc == k), sched + 2, np.maximum(1, sched - 1))
        s = s + emitted
        keep = s < end
        s, end, lanes_p, rep, sched = s[keep], end[keep], lanes_p[keep], rep[keep], sched[keep]
    lat = cost.latency_from_hist(hist, tot["emitted"])
    mean = Counts(
        n=int(round(tot["emitted"].mean())),
        rounds=int(round(tot["rounds"].mean())),
        drafted=int(round(tot["drafted"].mean())),
        accepted=int(round(tot["accepted"].mean())),
        target_only=int(round(tot["target_only"].mean())),
        prompts=n_p,
        k_hist=hist.mean(0).round().astype(np.int64),
    )
    out = mean.metrics(cost)
    out.update(
        {
            "latency_per_token": float(lat.mean()),
            "latency_ci95": float(Z95 * lat.std(ddof=1) / np.sqrt(repeats)) if repeats > 1 else None,
            "speedup": float(cost.target_only_per_token / lat.mean()),
            "rejections_mean": float(tot["rejections"].mean()),
            "repeats": repeats,
            "approximation": "independent acceptance with prob. 1-TV per position; continues along recorded rows after a rejection",
        }
    )
    return out


def rejection_check(
    data: ReplayData, cost: CostModel | None = None, *, repeats: int = 50, seed: int = 0
) -> dict:
    """Theory paper Theorem 1: mean rejections with unbounded drafting vs sum of E[TV].

    Unbounded drafting drafts every position except a round's final bonus, so the expected number
    of rejections is the sum of TV over drafted positions (``sum_tv``; the last position of each
    response can be a bonus, hence also ``sum_tv_excl_last``).
    """
    from specstop.eval.cost import PRESETS

    cost = cost or PRESETS["llama2-7b-70b"]
    unb = PolicySpec(kind="static", k=1)
    mc = mc_replay(data, unb, cost, repeats=repeats, seed=seed, cap=10**9)
    last = data.offsets[1:] - 1
    sum_tv = float(data.tv.sum())
    out = {
        "rejections_mc_mean": mc["rejections_mean"],
        "sum_tv": sum_tv,
        "sum_tv_excl_last": sum_tv - float(data.tv[last[data.lengths > 0]].sum()),
        "repeats": repeats,
    }
    if data.verified is not None:
        out["rejections_recorded_draws"] = mc_replay(data, unb, cost, cap=10**9, use_recorded=True)[
            "rejections_mean"
        ]
    return out
