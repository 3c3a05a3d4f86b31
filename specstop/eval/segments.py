"""Fast exact replay and exact threshold sweeps via independent segments (numpy, no per-step Python).

The segment fact (docs/design.md): every mismatch position m + 1 is a start point of every
policy's path, so with a policy whose state resets each round (static, confidence, predictor
rules, oracle) a response splits into independent segments [a, m] (m a mismatch, or the last
position). Segment g is laid out as *slots*: its trajectory rows a..m followed by the rollout
steps r_1..r_L of m, so the tokens a round starting at slot s drafts are slots s, s+1, ...

Threshold policies all have the form "stop after step j iff V_j < x", where V_j is
non-increasing in j within a round:

* ``below`` (confidence, DISCO, MCSD): stop iff score_j < tau  ->  V_j = min(score_1..score_j), x = tau;
* ``cumprod`` (SpecDec++): stop iff 1 - prod(score) > h  ->  V_j = -(1 - cum_j), x = -h
  (floats: negation is exact and cum_j is the same sequential float64 product RoundPolicy takes);
* a step without a score (hidden predictors at j = 1) has V_j = +inf (never stops there).

So the drafted length of a round is a step function of x with breakpoints V_1..V_J. A *lane* is
(segment, current start slot, an x-interval (lo, hi], counters). Each iteration plays one round of
every lane and splits it into the sub-intervals on which K differs; lanes leave when their segment
ends. The leaves of a segment partition the x axis, giving its piecewise-constant counts; the
objective over the whole split is their sum, built from per-segment events by one sort + cumsum.
Evaluating one fixed x is the same machinery with the degenerate interval (prev(x), x].

The heuristic schedule carries state across rounds, so it runs with one lane per prompt that
moves on to the next segment ("chain" mode) and never splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstop.eval.episodes import ReplayData, _ranges
from specstop.eval.replay import Counts, rollout_error, score_key, truncated_error
from specstop.policy import PolicySpec

_CHUNK = 1 << 16  # lanes per vectorised block: bounds the [lanes, SL_max] temporaries


@dataclass
class SlotLayout:
    """Slots of every segment (see module docstring). S slots, G segments.

    Attributes:
        pos: [S] response position. eos: [S] drafted token is EOS. top1: [S] float64.
        row: [S] token row (trajectory slots) or -1. rstep: [S] rollout step index or -1.
        mm: [S] the slot is a mismatch row.
        seg_start / seg_last / seg_end: [G] first trajectory slot, last trajectory slot, one past
            the last slot (rollout included). seg_mm: [G] mismatch slot or -1 (final segment).
        seg_prompt: [G]. prompt_seg: [P+1] segment offsets per prompt.
    """

    pos: np.ndarray
    eos: np.ndarray
    top1: np.ndarray
    row: np.ndarray
    rstep: np.ndarray
    mm: np.ndarray
    seg_start: np.ndarray
    seg_last: np.ndarray
    seg_end: np.ndarray
    seg_mm: np.ndarray
    seg_prompt: np.ndarray
    prompt_seg: np.ndarray
    max_new_tokens: int
    prompt_ids: np.ndarray

    def values(self, data: ReplayData, key: str, reads: str) -> np.ndarray:
        """[S] per-slot score of the slot's own token: dist -> its distribution features' score;
        hidden -> the score of the hidden state after it is fed in (mismatch slots: d_m's)."""
        out = np.empty(len(self.pos), dtype=np.float64)
        is_row = self.row >= 0
        out[is_row] = data.row_scores[key][self.row[is_row]]
        out[~is_row] = data.rollout_scores[key][self.rstep[~is_row]]
        if reads == "hidden":
            mm_slots = np.flatnonzero(self.mm)
            rid = data.rollout_of_row[self.row[mm_slots]]
            ok = rid >= 0
            out[mm_slots[ok]] = data.mismatch_scores[key][rid[ok]]
            out[mm_slots[~ok]] = np.nan
        return out


def build_layout(data: ReplayData) -> SlotLayout:
    """Split every response at its mismatches and lay the segments out as slots."""
    t = data.num_tokens
    gm = data.greedy_match
    lens = data.lengths
    last_rows = (data.offsets[1:] - 1)[lens > 0]
    ends = np.union1d(np.flatnonzero(~gm), last_rows).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    g = len(ends)
    seg_prompt = np.searchsorted(data.offsets, ends, side="right") - 1
    is_mm = ~gm[ends]
    rid = np.where(is_mm, data.rollout_of_row[ends], -1)
    r_len = np.diff(data.r_offsets)
    lr = np.where(rid >= 0, r_len[np.maximum(rid, 0)], 0) if len(r_len) else np.zeros(g, dtype=np.int64)
    lt = ends - starts + 1
    n_slots = lt + lr
    seg_slot0 = np.concatenate([[0], np.cumsum(n_slots)[:-1]]).astype(np.int64)
    s_total = int(n_slots.sum())
    row = np.full(s_total, -1, dtype=np.int64)
    rstep = np.full(s_total, -1, dtype=np.int64)
    rows = np.arange(t, dtype=np.int64)
    slot_of_row = rows + np.repeat(seg_slot0 - starts, lt)
    row[slot_of_row] = rows
    pos = np.empty(s_total, dtype=np.int64)
    prompt_of_row = np.repeat(np.arange(data.num_prompts), lens)
    pos[slot_of_row] = rows - data.offsets[prompt_of_row]
    eos = np.zeros(s_total, dtype=bool)
    drafted_tok = np.where(gm, data.token, data.draft_argmax)
    eos[slot_of_row] = data.is_eos(drafted_tok)
    top1 = np.empty(s_total, dtype=np.float64)
    top1[slot_of_row] = data.top1
    mm = np.zeros(s_total, dtype=bool)
    mm[slot_of_row] = ~gm
    # Rollout slots follow their segment's trajectory slots.
    has_r = lr > 0
    r_slots = _ranges(seg_slot0[has_r] + lt[has_r], lr[has_r])
    r_steps = _ranges(data.r_offsets[rid[has_r]], lr[has_r])
    t_in = np.arange(len(r_slots)) - np.repeat(np.cumsum(lr[has_r]) - lr[has_r], lr[has_r]) + 1
    rstep[r_slots] = r_steps
    pos[r_slots] = np.repeat(pos[slot_of_row[ends[has_r]]], lr[has_r]) + t_in
    eos[r_slots] = data.is_eos(data.r_tokens[r_steps])
    top1[r_slots] = data.r_top1[r_steps]
    seg_start = seg_slot0
    seg_last = seg_slot0 + lt - 1
    prompt_seg = np.searchsorted(seg_prompt, np.arange(data.num_prompts + 1), side="left").astype(np.int64)
    return SlotLayout(
        pos=pos,
        eos=eos,
        top1=top1,
        row=row,
        rstep=rstep,
        mm=mm,
        seg_start=seg_start,
        seg_last=seg_last,
        seg_end=seg_slot0 + n_slots,
        seg_mm=np.where(is_mm, seg_last, -1),
        seg_prompt=seg_prompt,
        prompt_seg=prompt_seg,
        max_new_tokens=data.max_new_tokens,
        prompt_ids=data.prompt_ids,
    )


@dataclass
class Leaves:
    """Finished lanes: segment (or prompt, in chain mode) ``seg``, interval (lo, hi], counters. [L]."""

    seg: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rounds: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray
    target_only: np.ndarray
    hist: np.ndarray  # [L, K_max + 1] rounds per drafted length K


def simulate(
    layout: SlotLayout,
    *,
    cap: int,
    values: np.ndarray | None = None,
    rule: str = "below",
    reads: str = "dist",
    x: float | None = None,
    kind: str = "threshold",
    start: int = 5,
) -> Leaves:
    """Play every segment's rounds for all x at once (``x`` None) or for one x.

    Args:
        layout: from :func:`build_layout`.
        cap: the policy's cap per round (sl_max or static k; heuristic: sl_max).
        values: [S] slot scores (see :meth:`SlotLayout.values`; top-1 for confidence); None for
            policies that never stop on a value (static, heuristic, oracle).
        rule / reads: ``below`` | ``cumprod`` and ``dist`` | ``hidden`` (module docstring).
        x: evaluate only this x (tau, or -h for cumprod); None sweeps the whole axis.
        kind: ``threshold`` (incl. static), ``oracle`` or ``heuristic`` (chain mode, start = ``start``).
    """
    chain = kind == "heuristic"
    if chain and values is not None:
        raise ValueError("the heuristic schedule does not read scores")
    if chain:
        prompts = np.flatnonzero(np.diff(layout.prompt_seg) > 0)
        seg = layout.prompt_seg[prompts].astype(np.int64)
    else:
        seg = np.arange(len(layout.seg_start), dtype=np.int64)
    n0 = len(seg)
    # Widest K a round can draft: the cap, or (oracle) the whole remaining response.
    width = (layout.max_new_tokens if kind == "oracle" else max(int(cap), 0)) + 1
    if x is None:
        lo, hi = np.full(n0, -np.inf), np.full(n0, np.inf)
    else:
        lo, hi = np.full(n0, np.nextafter(x, -np.inf)), np.full(n0, float(x))
    lanes = {
        "seg": seg,
        "s": layout.seg_start[seg].copy(),
        "lo": lo,
        "hi": hi,
        "rounds": np.zeros(n0, np.int64),
        "drafted": np.zeros(n0, np.int64),
        "accepted": np.zeros(n0, np.int64),
        "emitted": np.zeros(n0, np.int64),
        "target_only": np.zeros(n0, np.int64),
        "hist": np.zeros((n0, width), np.int32),
        "sched": np.full(n0, start, np.int64),
        "owner": seg.copy(),
    }
    done: list[dict] = []
    while len(lanes["s"]):
        parts = [
            _round({k: v[i : i + _CHUNK] for k, v in lanes.items()}, layout, cap, values, rule, reads, kind)
            for i in range(0, len(lanes["s"]), _CHUNK)
        ]
        nxt = {k: np.concatenate([p[0][k] for p in parts]) for k in lanes}
        fin = {k: np.concatenate([p[1][k] for p in parts]) for k in lanes}
        if chain:
            # Move finished-segment lanes on to their prompt's next segment.
            more = fin["seg"] + 1 < layout.prompt_seg[layout.seg_prompt[fin["seg"]] + 1]
            moved = {k: v[more] for k, v in fin.items()}
            moved["seg"] = moved["seg"] + 1
            moved["s"] = layout.seg_start[moved["seg"]]
            nxt = {k: np.concatenate([nxt[k], moved[k]]) for k in lanes}
            fin = {k: v[~more] for k, v in fin.items()}
        done.append(fin)
        lanes = nxt
    out = {k: np.concatenate([d[k] for d in done]) if done else np.zeros((0,) + lanes[k].shape[1:]) for k in lanes}
    return Leaves(
        seg=out["owner"].astype(np.int64),
        lo=out["lo"],
        hi=out["hi"],
        rounds=out["rounds"].astype(np.int64),
        drafted=out["drafted"].astype(np.int64),
        accepted=out["accepted"].astype(np.int64),
        emitted=out["emitted"].astype(np.int64),
        target_only=out["target_only"].astype(np.int64),
        hist=out["hist"].astype(np.int64),
    )


def _round(lane, layout, cap, values, rule, reads, kind):
    """One round for every lane in the block; returns (continuing lanes, finished lanes)."""
    s, seg = lane["s"], lane["seg"]
    n = len(s)
    rem = layout.max_new_tokens - layout.pos[s]
    if kind == "heuristic":
        pcap = np.maximum(1, np.minimum(lane["sched"], cap))
    elif kind == "oracle":
        mm = layout.seg_mm[seg]
        # Leading matches from s: up to the mismatch slot, or the whole final segment.
        pcap = np.where(mm >= 0, mm - s, layout.seg_last[seg] - s + 1)
    else:
        pcap = np.full(n, cap, np.int64)
    c = np.minimum(pcap, rem - 1)
    avail = layout.seg_end[seg] - s  # slots that exist from s on
    cm = int(max(c.max(initial=0), 1))
    js = np.arange(1, cm + 1)
    idx = s[:, None] + js[None, :] - 1  # [n, cm] slot of step j
    in_seg = js[None, :] <= avail[:, None]
    idxc = np.where(in_seg, idx, 0)
    eos = layout.eos[idxc] & in_seg
    e = np.where(eos.any(1), eos.argmax(1) + 1, np.iinfo(np.int64).max)
    jj = np.minimum(c, e)  # K if the policy never stops on a value
    target_only = c <= 0
    jj = np.where(target_only, 0, jj)

    if values is None or kind != "threshold":
        rows = np.arange(n)
        k = jj
        lo, hi = lane["lo"], lane["hi"]
    else:
        v = _stop_values(values, idxc, in_seg, rule, reads)  # [n, cm], non-increasing in j
        vprev = np.concatenate([np.full((n, 1), np.inf), v[:, :-1]], axis=1)
        lo_m = np.where(js[None, :] < jj[:, None], v, -np.inf)
        lo_m = np.maximum(lane["lo"][:, None], lo_m)
        hi_m = np.minimum(lane["hi"][:, None], vprev)
        ok = (lo_m < hi_m) & (js[None, :] <= jj[:, None])
        # Target-only lanes take one piece, K = 0, over their whole interval.
        ok[target_only] = False
        ok[target_only, 0] = True
        lo_m[target_only, 0] = lane["lo"][target_only]
        hi_m[target_only, 0] = lane["hi"][target_only]
        rows, cols = np.nonzero(ok)
        k = np.where(target_only[rows], 0, cols + 1)
        lo, hi = lo_m[rows, cols], hi_m[rows, cols]
    lane = {key: val[rows] for key, val in lane.items()}
    lane["lo"], lane["hi"] = lo, hi
    s, seg = lane["s"], lane["seg"]
    over = k > avail[rows]
    if over.any():
        i = int(np.flatnonzero(over)[0])
        g = int(seg[i])
        m_slot = int(layout.seg_mm[g])
        if m_slot < 0:
            raise ValueError(
                truncated_error(str(layout.prompt_ids[layout.seg_prompt[g]]), layout.max_new_tokens)
            )
        stored = int(layout.seg_end[g] - layout.seg_last[g] - 1)
        needed = int(s[i] + k[i] - 1 - m_slot)
        raise rollout_error(
            str(layout.prompt_ids[layout.seg_prompt[g]]), int(layout.pos[max(m_slot, 0)]), stored, needed
        )
    mm = layout.seg_mm[seg]
    last = s + k - 1
    reached = (mm >= 0) & (last >= mm) & (k > 0)
    n_acc = np.where(reached, mm - s, k)
    eos_acc = (~reached) & (k > 0) & layout.eos[np.maximum(last, 0)]
    emitted = np.where(eos_acc, n_acc, n_acc + 1)
    lane["rounds"] = lane["rounds"] + 1
    lane["drafted"] = lane["drafted"] + k
    lane["accepted"] = lane["accepted"] + n_acc
    lane["emitted"] = lane["emitted"] + emitted
    lane["target_only"] = lane["target_only"] + (k == 0)
    hist = lane["hist"].copy()
    hist[np.arange(len(k)), k] += 1
    lane["hist"] = hist
    if kind == "heuristic":
        full = (k > 0) & (n_acc == k)
        lane["sched"] = np.where(full, lane["sched"] + 2, np.maximum(1, lane["sched"] - 1))
    new_s = s + emitted
    lane["s"] = new_s
    fin = reached | eos_acc | (new_s > layout.seg_last[seg])
    return {key: val[~fin] for key, val in lane.items()}, {key: val[fin] for key, val in lane.items()}


def _stop_values(values, idxc, in_seg, rule, reads):
    """[n, cm] V_j (module docstring). Steps past the stored slots get -inf (any piece needing them
    is reported as a too-short rollout)."""
    n, cm = idxc.shape
    if reads == "hidden":
        # Step j reads the score of the token drafted at step j - 1; none at j = 1.
        w = np.empty((n, cm))
        w[:, 0] = np.nan
        w[:, 1:] = values[idxc[:, :-1]]
    else:
        w = values[idxc]
    if rule == "cumprod":
        if reads == "hidden":
            cum = np.ones((n, cm))
            cum[:, 1:] = np.cumprod(w[:, 1:], axis=1)
        else:
            cum = np.cumprod(w, axis=1)
        v = -(1.0 - cum)
    else:
        v = (
            np.minimum.accumulate(np.where(np.isnan(w), np.inf, w), axis=1)
            if reads == "hidden"
            else np.minimum.accumulate(w, axis=1)
        )
    if reads == "hidden":
        v[:, 0] = np.inf
    # A NaN score (e.g. no stored mismatch hidden state) never stops the round, as in RoundPolicy.
    v = np.fmin.accumulate(v, axis=1)
    v = np.where(np.isnan(v), np.inf, v)
    return np.where(in_seg, v, -np.inf)


@dataclass
class Curve:
    """The split's counts as a step function of x. M breakpoints ``b`` (sorted, unique); interval i
    is (-inf, b_0] for i = 0, (b_{i-1}, b_i] in between, (b_{M-1}, +inf) for i = M.

    Attributes:
        b: [M]. rounds, drafted, accepted, target_only: [M+1] totals on each interval.
        hist: [M+1, K_max + 1] rounds per drafted length K on each interval. n: emitted tokens.
    """

    b: np.ndarray
    rounds: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    target_only: np.ndarray
    hist: np.ndarray
    n: int
    prompts: int

    def index(self, x: float) -> int:
        """Interval holding x (number of breakpoints strictly below x)."""
        return int(np.searchsorted(self.b, x, side="left"))

    def representative(self, i: int) -> float:
        """An x inside interval i: the midpoint where finite (robust to small score shifts on
        other data), the lowest breakpoint for i = 0, just above the last for i = M."""
        m = len(self.b)
        if m == 0:
            return 0.0
        if i == 0:
            return float(self.b[0])
        if i == m:
            return float(np.nextafter(self.b[-1], np.inf))
        a, c = float(self.b[i - 1]), float(self.b[i])
        mid = a + (c - a) / 2.0
        return mid if a < mid <= c else c

    def counts(self, i: int) -> Counts:
        return Counts(
            n=self.n,
            rounds=int(self.rounds[i]),
            drafted=int(self.drafted[i]),
            accepted=int(self.accepted[i]),
            target_only=int(self.target_only[i]),
            prompts=self.prompts,
            k_hist=self.hist[i],
        )


def curve_from_leaves(leaves: Leaves, n_total: int, prompts: int) -> Curve:
    """Sum per-segment step functions: per-segment deltas at each leaf's lower end, one global sort."""
    order = np.lexsort((leaves.lo, leaves.seg))
    seg = leaves.seg[order]
    lo = leaves.lo[order]
    # One matrix of every counter: [L, 4 + K_max + 1].
    cols = np.column_stack(
        [leaves.rounds, leaves.drafted, leaves.accepted, leaves.target_only, leaves.hist.reshape(len(leaves.seg), -1)]
    )[order]
    first = np.ones(len(seg), dtype=bool)
    first[1:] = seg[1:] != seg[:-1]
    base = cols[first].sum(0)
    ev = ~first
    b_all = lo[ev]
    deltas = (cols[1:] - cols[:-1])[ev[1:]]
    o = np.argsort(b_all, kind="stable")
    b_sorted = b_all[o]
    b, starts = np.unique(b_sorted, return_index=True)
    per_b = np.add.reduceat(deltas[o], starts, axis=0) if len(b) else np.zeros((0, cols.shape[1]), np.int64)
    out = np.concatenate([base[None, :], base[None, :] + np.cumsum(per_b, axis=0)], axis=0)
    return Curve(
        b=b, rounds=out[:, 0], drafted=out[:, 1], accepted=out[:, 2], target_only=out[:, 3], hist=out[:, 4:],
        n=n_total, prompts=prompts,
    )


def policy_x(spec: PolicySpec) -> float:
    """The x of a threshold policy (tau, or -h for cumprod)."""
    return -spec.threshold if spec.rule == "cumprod" else spec.threshold


def threshold_from_x(spec: PolicySpec, x: float) -> float:
    return -x if spec.rule == "cumprod" else x


def policy_values(
    layout: SlotLayout, data: ReplayData, spec: PolicySpec
) -> tuple[np.ndarray | None, str, str]:
    """(slot values, rule, reads) the segment engine needs for ``spec``."""
    if spec.kind == "confidence":
        return layout.top1, spec.rule, "dist"
    if spec.kind == "predictor":
        key = score_key(spec)
        if key not in data.row_scores:
            raise KeyError(
                f"no predictor scores {key!r} in the replay data (have: {sorted(data.row_scores)}); score it first"
            )
        reads = data.score_reads.get(key, spec.reads)
        return layout.values(data, key, reads), spec.rule, reads
    return None, "below", "dist"


def fast_replay(data: ReplayData, spec: PolicySpec, layout: SlotLayout | None = None) -> Counts:
    """Exact replay of ``spec`` (any kind but pearl) with the vectorised segment engine."""
    layout = layout or build_layout(data)
    kind = {"oracle": "oracle", "heuristic": "heuristic"}.get(spec.kind, "threshold")
    values, rule, reads = policy_values(layout, data, spec)
    x = policy_x(spec) if values is not None else None
    leaves = simulate(
        layout, cap=spec.cap, values=values, rule=rule, reads=reads, x=x, kind=kind, start=spec.start
    )
    return Counts(
        n=int(leaves.emitted.sum()),
        rounds=int(leaves.rounds.sum()),
        drafted=int(leaves.drafted.sum()),
        accepted=int(leaves.accepted.sum()),
        target_only=int(leaves.target_only.sum()),
        prompts=data.num_prompts,
        k_hist=leaves.hist.sum(0),
    )


def sweep(data: ReplayData, spec: PolicySpec, layout: SlotLayout | None = None) -> Curve:
    """Counts of ``spec``'s rule at every threshold at once (``spec.threshold`` is ignored)."""
    layout = layout or build_layout(data)
    values, rule, reads = policy_values(layout, data, spec)
    if values is None:
        raise ValueError(f"policy kind {spec.kind!r} has no threshold to sweep")
    leaves = simulate(layout, cap=spec.cap, values=values, rule=rule, reads=reads, x=None)
    return curve_from_leaves(leaves, int(data.num_tokens), data.num_prompts)
