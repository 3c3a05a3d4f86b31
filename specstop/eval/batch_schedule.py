"""Schedules per batch size: the static K, or the confidence threshold and SL_max, that a batch of B
sequences decodes fastest with, priced from the cost model's measured ``batch`` section.

A batch round (:class:`~specstop.decode.batched.BatchedSpeculativeDecoder`) drafts until every row has
stopped and verifies all rows in one target forward, so with per-row drafted lengths K_1..K_B it costs

    c_B(K_max) = K_max * (t_draft(B) + B * decision) + t_target(B, K_max),   K_max = max_b K_b

(c_B(0) = t_target(B, 0), a plain batched target step; the chain round formula of
:mod:`specstop.eval.cost` at batch size B; the decision, e.g. the confidence rule's softmax, is paid
per row) and emits sum_b (n_b + 1) tokens. Rows are independent: each follows its own sequence's
rounds exactly as it would alone (the replay's rounds). In a serving batch of B running sequences
(a finished sequence's slot taken by the next request) each slot is, round after round, in a round
drawn uniformly from all rounds of the workload, independently of the other slots. So with the
per-sequence replay's K histogram h (rounds per K over the split: ``Counts.k_hist``, or every
threshold interval's histogram of a :class:`~specstop.eval.segments.Curve` at once) and N tokens
over R rounds:

    P(K_max <= k) = F(k)^B,  F(k) = sum_{j <= k} h_j / R
    throughput(B) = B * (N / R) / E[c_B(K_max)],   no speculation: B / t_target(B, 0)
    speedup(B)    = (N / R) * t_target(B, 0) / E[c_B(K_max)]

which is exact for that model and needs no sampling; :func:`simulate_serving` plays it out slot by
slot (the brute-force check the tests compare it with). The threshold search is the tuner's exact
breakpoint search (:func:`specstop.eval.segments.sweep`) priced this way on every interval.

A fixed batch that is not refilled (the benchmark decodes B held-out prompts together, and rows
leave as they finish) is priced round by round instead (:func:`fixed_batch_seconds`), at the cost of
the rows still decoding. Costs at batch sizes between the measured ones are interpolated linearly.

``specstop tune`` writes the schedule into tuned.json when the cost model has a ``batch`` section::

    "batch_schedule": {"format": 1, "cost_model": NAME, "entries": [
        {"batch_size": B, "k": K, "predicted_speedup": s, "predicted_speedup_by_k": {"0": 1.0, "1": ...},
         "threshold": {"threshold": tau, "sl_max": L, "predicted_speedup": s} | null}, ...]}
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from specstop.errors import UserError
from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData
from specstop.eval.replay import ReplayTrace, replay_prompt
from specstop.eval.segments import SlotLayout, build_layout, fast_replay, sweep, threshold_from_x
from specstop.policy import PolicySpec

SCHEDULE_FORMAT = 1


# ---------------------------------------------------------------------------------------------- costs
def batch_section(cost: CostModel) -> dict:
    """The cost model's ``batch`` section, or a one-line :class:`UserError` naming the fix."""
    sec = getattr(cost, "batch", None)
    if not sec or not sec.get("t_draft") or not sec.get("t_target"):
        raise UserError(f"cost model {cost.name} has no batch costs; measure them with "
                        "`specstop calibrate-cost --batch-grid 1,2,4,8`")
    return sec


def measured_batch_sizes(cost: CostModel) -> list[int]:
    return sorted(int(b) for b in batch_section(cost)["t_draft"])


def measured_k_max(cost: CostModel) -> int:
    """The largest K the batch section timed (larger K would be extrapolated)."""
    return min(max(int(k) for k in tab) for tab in batch_section(cost)["t_target"].values())


def cost_at(cost: CostModel, batch_size: float) -> CostModel:
    """The chain cost model of one batch round at ``batch_size`` rows: t_draft(B) per draft step and
    the t_target(B, K) table, linear in B between measured sizes (along the last two beyond them,
    flat below the smallest); per-step decision costs times B (each row decides)."""
    sec = batch_section(cost)
    sizes = measured_batch_sizes(cost)
    b = float(batch_size)

    def at(values: dict) -> float:
        ys = [float(values[str(s)] if str(s) in values else values[s]) for s in sizes]
        if b > sizes[-1] and len(sizes) >= 2:
            slope = max((ys[-1] - ys[-2]) / (sizes[-1] - sizes[-2]), 0.0)
            return ys[-1] + slope * (b - sizes[-1])
        return float(np.interp(b, sizes, ys))

    tables = {int(s): {int(k): float(v) for k, v in tab.items()} for s, tab in sec["t_target"].items()}
    ks = sorted(set.intersection(*(set(t) for t in tables.values())))
    table = {k: at({s: tables[s][k] for s in sizes}) for k in ks}
    per = {name: v * b for name, v in (cost.policy_per_step or {}).items()}
    return replace(cost, t_draft=at(sec["t_draft"]), draft_per_token=None, target_by_k=table,
                   t_target_single=table.get(0), predictor_per_step=cost.predictor_per_step * b,
                   policy_per_step=per or None, batch=None, name=f"{cost.name}@B={batch_size:g}")


def expected_round_cost(k_hist, batch_size: int, cost_b: CostModel) -> np.ndarray:
    """E[c_B(K_max)] for rows drawing K independently from ``k_hist`` ``[..., K_max + 1]``."""
    h = np.asarray(k_hist, dtype=np.float64)
    f = np.cumsum(h, axis=-1) / np.maximum(h.sum(-1, keepdims=True), 1.0)
    p_max = np.diff(f ** int(batch_size), axis=-1, prepend=0.0)
    return p_max @ cost_b.round_costs(h.shape[-1] - 1)


def batch_speedup(k_hist, n_tokens, batch_size: int, cost_b: CostModel) -> np.ndarray:
    """Predicted throughput at batch size B over no speculation at B (module docstring).

    Args:
        k_hist: ``[..., K_max + 1]`` one sequence's rounds per drafted length over the workload.
        n_tokens: ``[...]`` tokens those rounds emit.
        cost_b: :func:`cost_at` for B (with the policy's decision cost: ``for_policy``).
    """
    h = np.asarray(k_hist, dtype=np.float64)
    per_round = np.asarray(n_tokens, dtype=np.float64) / np.maximum(h.sum(-1), 1.0)
    return per_round * cost_b.target_cost(0) / expected_round_cost(h, batch_size, cost_b)


# ---------------------------------------------------------------------------------------------- schedule
def schedule_entry(data: ReplayData, cost: CostModel, batch_size: int, *, k_max: int, sl_max_grid,
                   layout: SlotLayout | None = None, static_counts: dict | None = None) -> dict:
    """One batch size's entry: the best static K (0 = no speculation), the speedup of every K, and
    the best confidence threshold and SL_max (exact breakpoint search) with its speedup."""
    layout = layout or build_layout(data)
    cost_b = cost_at(cost, batch_size)
    static_counts = static_counts if static_counts is not None else static_replays(data, k_max, layout)
    by_k = {0: 1.0}
    static_cost = cost_b.for_policy("static")
    for k, counts in static_counts.items():
        by_k[k] = float(batch_speedup(counts.k_hist, counts.n, batch_size, static_cost))
    best_k = max(by_k, key=lambda k: (by_k[k], -k))  # ties: the shorter draft
    threshold = None
    best = None
    for sl in sorted({int(v) for v in sl_max_grid}):
        spec = PolicySpec(kind="confidence", threshold=0.4, sl_max=sl)
        curve = sweep(data, spec, layout)
        s = batch_speedup(curve.hist, curve.n, batch_size, cost_b.for_policy(spec))
        i = int(np.argmax(s))
        if best is None or s[i] > best[0] + 1e-12:
            best = (float(s[i]), sl, threshold_from_x(spec, curve.representative(i)))
    if best is not None:
        threshold = {"threshold": float(best[2]), "sl_max": best[1], "predicted_speedup": round(best[0], 4)}
    return {
        "batch_size": int(batch_size),
        "k": int(best_k),
        "predicted_speedup": round(by_k[best_k], 4),
        "predicted_speedup_by_k": {str(k): round(v, 4) for k, v in sorted(by_k.items())},
        "threshold": threshold,
    }


def static_replays(data: ReplayData, k_max: int, layout: SlotLayout | None = None) -> dict:
    """``{K: Counts}`` of static K = 1..k_max (one sequence at a time: rows are independent)."""
    layout = layout or build_layout(data)
    return {k: fast_replay(data, PolicySpec(kind="static", k=k), layout) for k in range(1, int(k_max) + 1)}


def batch_schedule(data: ReplayData, cost: CostModel, *, k_max: int = 20, sl_max_grid=(4, 8, 12, 16, 20),
                   layout: SlotLayout | None = None) -> dict:
    """The ``batch_schedule`` section of tuned.json (module docstring) for every measured batch size.

    Static K and SL_max are limited to the K the batch section measured (no extrapolated costs).
    """
    layout = layout or build_layout(data)
    k_top = measured_k_max(cost)
    k_max = max(min(int(k_max), k_top), 1)
    grid = [s for s in sl_max_grid if int(s) <= k_top] or [k_max]
    counts = static_replays(data, k_max, layout)
    entries = [schedule_entry(data, cost, b, k_max=k_max, sl_max_grid=grid, layout=layout, static_counts=counts)
               for b in measured_batch_sizes(cost)]
    return {"format": SCHEDULE_FORMAT, "cost_model": cost.name, "entries": entries}


# ---------------------------------------------------------------------------------------------- replays
def prompt_rounds(data: ReplayData, spec: PolicySpec, prompts=None) -> list[list[tuple[int, int]]]:
    """Per prompt, its rounds under ``spec`` as ``(K drafted, tokens emitted)`` (the exact replay)."""
    out = []
    for p in range(data.num_prompts) if prompts is None else prompts:
        trace = ReplayTrace()
        counts = replay_prompt(data, int(p), spec, trace=trace)
        ends = trace.start[1:] + [counts.n]
        out.append([(int(k), int(e - s)) for k, s, e in zip(trace.k, trace.start, ends)])
    return out


def fixed_batch_seconds(rounds: list[list[tuple[int, int]]], batch_size: int, cost: CostModel,
                        spec: PolicySpec | str = "static") -> tuple[float, int]:
    """Seconds and tokens of decoding ``rounds`` (per prompt, from :func:`prompt_rounds`) in fixed
    batches of ``batch_size`` consecutive prompts, rows leaving as they finish; each batch round is
    priced at the rows still decoding, ``c_B'(max K)`` with ``B'`` those rows."""
    round_k, round_rows, tokens = [], [], 0
    for start in range(0, len(rounds), batch_size):
        group = rounds[start : start + batch_size]
        for r in range(max((len(g) for g in group), default=0)):
            live = [g[r] for g in group if r < len(g)]
            round_k.append(max(k for k, _ in live))
            round_rows.append(len(live))
            tokens += sum(e for _, e in live)
    return priced_rounds(round_k, round_rows, cost, spec), tokens


def priced_rounds(round_k: list[int], round_rows: list[int], cost: CostModel,
                  spec: PolicySpec | str = "static") -> float:
    """Seconds the cost model gives batch rounds that drafted ``round_k[i]`` steps with ``round_rows[i]``
    rows decoding (a :class:`~specstop.decode.batched.BatchDecodeResult`'s ``batch`` counters)."""
    priced: dict[int, CostModel] = {}
    seconds = 0.0
    for k, rows in zip(round_k, round_rows):
        if rows not in priced:
            priced[rows] = cost_at(cost, rows).for_policy(spec)
        seconds += priced[rows].round_cost(int(k))
    return seconds


def simulate_serving(rounds: list[list[tuple[int, int]]], batch_size: int, cost: CostModel, *,
                     batch_rounds: int = 20000, seed: int = 0, spec: PolicySpec | str = "static") -> float:
    """Brute force of the serving model: ``batch_size`` slots, each decoding a random prompt's rounds in
    order and taking another random prompt when done; returns the speedup over no speculation at the
    same batch size (tokens per second over ``B / t_target(B, 0)``)."""
    rng = random.Random(seed)
    cost_b = cost_at(cost, batch_size).for_policy(spec)
    slots = [[rng.randrange(len(rounds)), 0] for _ in range(batch_size)]
    seconds, tokens = 0.0, 0
    for _ in range(batch_rounds):
        drawn = []
        for slot in slots:
            drawn.append(rounds[slot[0]][slot[1]])
            slot[1] += 1
            if slot[1] == len(rounds[slot[0]]):
                slot[0], slot[1] = rng.randrange(len(rounds)), 0
        seconds += cost_b.round_cost(max(k for k, _ in drawn))
        tokens += sum(e for _, e in drawn)
    return (tokens / seconds) / (batch_size / cost_b.target_cost(0))
