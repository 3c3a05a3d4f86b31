"""Threshold tuning: choose tau / h / beta and SL_max minimising simulated latency, exactly.

The latency of a threshold policy on a split is piecewise constant in the threshold, with
breakpoints at the distinct step values the policy can compare against (scores for ``below``,
reachable prefix products for SpecDec++'s ``cumprod``). :func:`specstop.eval.segments.sweep`
computes the counts on *every* interval between breakpoints at once (per-segment step functions
merged by one sort + cumulative sum), so the optimum found here is the exact optimum over all
thresholds, not a grid's. Static K, the heuristic's start and the confidence threshold are tuned
on the same split for fair comparisons. The papers' grid (SpecDec++ h in {0.1, ..., 0.9}) is
read off the same step function for comparison.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData
from specstop.eval.price_free import candidate, make_stats, threshold_candidates
from specstop.eval.replay import Counts
from specstop.eval.segments import Curve, SlotLayout, build_layout, fast_replay, sweep, threshold_from_x
from specstop.policy import PolicySpec

SPECDECPP_GRID = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_SL_MAX_GRID = (4, 8, 12, 16, 20)
PARETO_POINTS = 400


def curve_latency(curve: Curve, cost: CostModel) -> np.ndarray:
    """[M+1] latency per token on each interval of the step function (each interval's K histogram
    priced by the cost model's per-K round costs)."""
    return cost.latency_from_hist(curve.hist, curve.n)


def pareto_points(curve: Curve, max_points: int = PARETO_POINTS) -> dict:
    """Verification rate vs discard rate along a threshold sweep (subsampled, endpoints kept)."""
    m = len(curve.rounds)
    idx = np.unique(np.linspace(0, m - 1, min(m, max_points)).round().astype(np.int64))
    n = max(curve.n, 1)
    return {
        "verification_rate": (curve.rounds[idx] / n).tolist(),
        "discard_rate": ((curve.drafted[idx] - curve.accepted[idx]) / n).tolist(),
    }


def tune_threshold(
    data: ReplayData,
    base: PolicySpec,
    cost: CostModel,
    sl_max_grid=DEFAULT_SL_MAX_GRID,
    *,
    layout: SlotLayout | None = None,
    paper_grid=None,
) -> tuple[PolicySpec, dict]:
    """Exact search over every threshold interval and each SL_max in the grid.

    Args:
        data: the tuning split (with scores for predictor policies).
        base: a ``confidence`` or ``predictor`` spec (its threshold and sl_max are replaced).
        cost: the latency model minimised.
        sl_max_grid: SL_max candidates.
        paper_grid: thresholds to report for comparison (e.g. SpecDec++'s h grid) at the best SL_max.

    Returns:
        (best spec, validation record: metrics of the best, per-SL_max optima, number of
        breakpoints searched, the paper grid's latencies, Pareto points of the best SL_max's sweep,
        and ``stats``: the price-free statistics of the candidates a re-pricing could pick,
        :mod:`specstop.eval.price_free`).
    """
    layout = layout or build_layout(data)
    cost = cost.for_policy(base)  # its decision cost per draft step, measured when calibrated
    per = []
    best = None
    curves = {}
    candidates = []
    for sl in sorted(set(int(v) for v in sl_max_grid)):
        spec = replace(base, sl_max=sl)
        curve = sweep(data, spec, layout)
        lat = curve_latency(curve, cost)
        i = int(np.argmin(lat))
        thr = threshold_from_x(spec, curve.representative(i))
        candidates += threshold_candidates(curve, spec, cost, also=(i,))
        rec = {
            "sl_max": sl,
            "threshold": thr,
            "latency_per_token": float(lat[i]),
            "breakpoints": int(len(curve.b)),
        }
        per.append(rec)
        curves[sl] = curve
        if best is None or lat[i] < best[0] - 1e-15:
            best = (float(lat[i]), sl, thr, i)
    _, sl, thr, i = best
    spec = replace(base, sl_max=sl, threshold=float(thr))
    curve = curves[sl]
    record = {
        **curve.counts(i).metrics(cost),
        "search": {
            "method": "exact: every breakpoint of the piecewise-constant objective",
            "per_sl_max": per,
            "interval": _interval(curve, i, spec),
        },
        "pareto": pareto_points(curve),
        "stats": make_stats(candidates, {"threshold": float(thr), "sl_max": int(sl), "rule": spec.rule}, curve.n,
                            curve.prompts),
    }
    if paper_grid:
        record["paper_grid"] = [
            {
                "threshold": float(t),
                **curve.counts(curve.index(-t if spec.rule == "cumprod" else t)).metrics(cost),
            }
            for t in paper_grid
        ]
    return spec, record


RULE_NOTE = (
    "rule chosen on validation among 'below' (stop when the step's score < tau: DISCO, MCSD, HF confidence) "
    "and 'cumprod' (stop when 1 - prod of the round's scores > h: SpecDec++ Algorithm 1); the papers fix "
    "one rule per family, specstop tries both and keeps the faster"
)


def tune_rules(
    data: ReplayData, base: PolicySpec, cost: CostModel, sl_max_grid=DEFAULT_SL_MAX_GRID, *,
    rules=("below", "cumprod"), layout: SlotLayout | None = None, paper_grid=None,
) -> tuple[PolicySpec, dict]:
    """:func:`tune_threshold` under each stopping rule in ``rules``; the fastest on ``data`` wins.

    The record gets ``rules``: ``{rule: best validation latency per token}`` and a note, so reports
    can say which rule was used and by how much it beat the other.
    """
    layout = layout or build_layout(data)
    best = None
    lat_by_rule = {}
    paper = None
    candidates = []
    for rule in rules:
        grid = paper_grid if rule == "cumprod" else None
        spec, rec = tune_threshold(data, replace(base, rule=rule), cost, sl_max_grid, layout=layout, paper_grid=grid)
        candidates += rec["stats"]["candidates"]
        lat_by_rule[rule] = rec["latency_per_token"]
        paper = rec.get("paper_grid", paper)
        if best is None or rec["latency_per_token"] < best[1]["latency_per_token"] - 1e-15:
            best = (spec, rec)
    spec, rec = best
    rec["stats"] = make_stats(candidates, {"threshold": float(spec.threshold), "sl_max": int(spec.sl_max),
                                           "rule": spec.rule}, rec["stats"]["n"], rec["stats"]["prompts"])
    if paper is not None:
        # The paper's grid is a comparison under its own rule, reported whichever rule won.
        rec["paper_grid"] = paper
    if len(rules) > 1:
        rec["rules"] = {"latency_per_token": lat_by_rule, "chosen": spec.rule, "note": RULE_NOTE}
    return spec, rec


def _interval(curve: Curve, i: int, spec: PolicySpec) -> dict:
    """The optimal threshold interval, in threshold units."""
    lo = float(curve.b[i - 1]) if i > 0 else -np.inf
    hi = float(curve.b[i]) if i < len(curve.b) else np.inf
    a, b = threshold_from_x(spec, lo), threshold_from_x(spec, hi)
    if spec.rule == "cumprod":  # x in (lo, hi]  <=>  h in [-hi, -lo)
        return {"from": _num(b), "to": _num(a), "closed": "left"}
    return {"from": _num(a), "to": _num(b), "closed": "right"}


def _num(v: float):
    return v if np.isfinite(v) else None


def tune_static(
    data: ReplayData, cost: CostModel, k_max: int, *, layout: SlotLayout | None = None
) -> tuple[PolicySpec, dict]:
    """Static SL-opt (DISCO): the best K in 1..k_max."""
    layout = layout or build_layout(data)
    cost = cost.for_policy("static")
    table, candidates = [], []
    for k in range(1, int(k_max) + 1):
        c = fast_replay(data, PolicySpec(kind="static", k=k), layout)
        table.append({"k": k, **c.metrics(cost)})
        candidates.append(candidate({"k": k}, c))
    best = min(table, key=lambda r: r["latency_per_token"])
    return PolicySpec(kind="static", k=best["k"]), {
        **best,
        "stats": make_stats(candidates, {"k": best["k"]}, best["n"], best["prompts"]),
        # tokens_per_round per K: an engine that runs a fixed K with its own draft costs reprices every K.
        "search": {"per_k": [{"k": r["k"], "latency_per_token": r["latency_per_token"],
                              "tokens_per_round": r["tokens_per_round"]} for r in table]},
    }


def tune_heuristic(
    data: ReplayData,
    cost: CostModel,
    starts=range(1, 11),
    sl_max: int = 20,
    *,
    layout: SlotLayout | None = None,
) -> tuple[PolicySpec, dict]:
    """The heuristic schedule's start value (cap ``sl_max``)."""
    layout = layout or build_layout(data)
    cost = cost.for_policy("heuristic")
    table, candidates = [], []
    for st in starts:
        c = fast_replay(data, PolicySpec(kind="heuristic", start=int(st), sl_max=sl_max), layout)
        table.append({"start": int(st), **c.metrics(cost)})
        candidates.append(candidate({"start": int(st)}, c))
    best = min(table, key=lambda r: r["latency_per_token"])
    spec = PolicySpec(kind="heuristic", start=best["start"], sl_max=sl_max)
    return spec, {
        **best,
        "stats": make_stats(candidates, {"start": best["start"]}, best["n"], best["prompts"]),
        "search": {
            "per_start": [{"start": r["start"], "latency_per_token": r["latency_per_token"]} for r in table]
        },
    }


def evaluate(
    data: ReplayData, spec: PolicySpec, cost: CostModel, *, layout: SlotLayout | None = None
) -> dict:
    """Metrics of one policy on a split (fast exact replay)."""
    return fast_replay(data, spec, layout).metrics(cost.for_policy(spec))


def max_sl_supported(data: ReplayData) -> int | None:
    """Largest SL_max the stored rollouts support everywhere (None: no mismatches)."""
    mm = np.flatnonzero(~data.greedy_match)
    if not len(mm):
        return None
    r = data.rollout_of_row[mm]
    if (r < 0).any():
        return 1
    lens = np.diff(data.r_offsets)[r]
    ends_eos = np.zeros(len(r), dtype=bool)
    has = lens > 0
    ends_eos[has] = data.is_eos(data.r_tokens[data.r_offsets[r[has]] + lens[has] - 1])
    prompt = np.searchsorted(data.offsets, mm, side="right") - 1
    pos = mm - data.offsets[prompt]
    # Truncated at max_new_tokens - 2 or ended by EOS: long enough for any SL_max.
    full = ends_eos | (pos + lens >= data.max_new_tokens - 2)
    short = lens[~full]
    return None if not len(short) else int(short.min()) + 1


def check_sl_max(data: ReplayData, sl_max: int) -> None:
    cap = max_sl_supported(data)
    if cap is not None and sl_max > cap:
        raise ValueError(
            f"SL_max {sl_max} needs rollouts of {sl_max - 1} steps but {data.source or 'the data'} stores only "
            f"{cap - 1}; regenerate with a longer --rollout-length (labels.rollouts.length) or lower SL_max to {cap}"
        )


def counts_of(curve: Curve, spec: PolicySpec) -> Counts:
    return curve.counts(curve.index(-spec.threshold if spec.rule == "cumprod" else spec.threshold))


def best_throughput(checkpoint: str, data_dir: str, *, split: str = "validation", cost_model="llama2-7b-70b",
                    sl_max_grid=DEFAULT_SL_MAX_GRID) -> dict:
    """Tune one checkpoint's threshold exactly on ``split`` and return its best simulated throughput.

    Used by ``specstop sweep`` for its SpecDec++-Table-3 column. Returns
    ``{"throughput": tokens/s, "threshold", "sl_max", "speedup", "latency_per_token"}``.
    """
    from specstop.eval.cost import load_cost_model
    from specstop.eval.episodes import load_replay_data
    from specstop.eval.sampled import replayable
    from specstop.eval.scoring import family_rule, score_split
    from specstop.models.checkpoint import load_predictor

    cost = load_cost_model(cost_model)
    data = load_replay_data(data_dir, split)
    predictor, meta = load_predictor(checkpoint)
    family = meta.get("family") or predictor.family
    score_split(data, data_dir, split, family, predictor)
    # Sampled data (SpecDec++'s own setting): realisations of the acceptance draws, see eval.sampled.
    data = replayable(data, data_dir, split, max_steps=max(sl_max_grid))
    if data.temperature <= 0:
        supported = max_sl_supported(data)
        if supported is not None:
            sl_max_grid = [s for s in sl_max_grid if s <= supported] or [supported]
    rule, reads = family_rule(family, predictor.feature_spec.kind)
    base = PolicySpec(kind="predictor", family=family, rule=rule, reads=reads, extra={"scores": family})
    spec, rec = tune_threshold(data, base, cost, sl_max_grid)
    lat = rec["latency_per_token"]
    return {"throughput": 1.0 / lat, "threshold": spec.threshold, "sl_max": spec.sl_max,
            "speedup": rec.get("speedup"), "latency_per_token": lat, "cost_model": cost.name,
            "cost_provenance": cost.provenance}
