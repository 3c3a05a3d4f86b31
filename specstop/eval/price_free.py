"""Price-free statistics: what a replay counted, kept so that any cost table re-prices it with no data.

A replay's latency is its K histogram priced by a cost table (``Counts.k_hist`` and
:meth:`~specstop.eval.cost.CostModel.total_hist`); the counts themselves do not depend on the table.
``specstop tune`` keeps, for every tuned policy, the counts of the candidates a re-pricing could pick:

* static K: every K it tried; the heuristic schedule: every start it tried;
* thresholds (confidence, learned predictors): for every SL_max (and stopping rule) tried, the threshold
  intervals that are optimal under the tuning table with its draft step scaled by 1/4 to 4x, its
  one-row target step by 0.7 to 1.4x and its verification slope by 0.5 to 2x (the ways step costs were
  seen to move between machines and processes), plus intervals spread evenly over the sweep, plus the
  tuned one.

Each candidate holds tokens N, rounds, drafted and accepted tokens, target-only steps and the histogram of
drafted lengths K (the verification sizes, K + 1 tokens each). :func:`reprice` prices every candidate
with another table and returns the fastest: a re-priced candidate's latency is exactly the one a fresh
replay of the same policy prices with that table (both are ``Counts.metrics`` of the same counts).
``specstop tune --reprice`` re-picks every policy of a tuned file this way, exports and engine files
carry the exported policy's statistics, and the decoders re-pick from them as live costs move
(:mod:`specstop.decode.live_pricing`).

The ``stats`` mapping (tuned.json ``policies.NAME.stats``, export ``config.json`` ``stats``)::

    {"format": 1, "n": N, "prompts": P, "chosen": i,
     "candidates": [{"params": {"threshold": t, "sl_max": s, "rule": r} | {"k": K} | {"start": S, "sl_max": s},
                     "rounds": R, "drafted": D, "accepted": A, "target_only": T, "unproposed": U,
                     "k_hist": [rounds with K = 0, 1, ...]}, ...]}
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from specstop.errors import UserError
from specstop.eval.cost import CostModel
from specstop.eval.replay import Counts
from specstop.eval.segments import Curve, threshold_from_x
from specstop.policy import PolicySpec

STATS_FORMAT = 1
#: How far each part of a table is moved when choosing which threshold intervals to keep.
DRAFT_SCALES = tuple(float(x) for x in 2.0 ** np.linspace(-2.0, 2.0, 13))
SINGLE_SCALES = (0.7, 0.85, 1.0, 1.2, 1.4)
SLOPE_SCALES = (0.5, 1.0, 2.0)
#: Intervals kept evenly spread over each sweep, whatever the table.
SPREAD = 12


def perturbed_round_costs(cost: CostModel, k_max: int) -> np.ndarray:
    """``[k_max + 1, P]`` round costs c(K) under every scaling of :data:`DRAFT_SCALES` x
    :data:`SINGLE_SCALES` x :data:`SLOPE_SCALES` of ``cost`` (its decision cost included)."""
    t = cost.target_costs(k_max)
    ks = np.arange(k_max + 1, dtype=np.float64)
    cols = []
    for fd in DRAFT_SCALES:
        for f0 in SINGLE_SCALES:
            for fs in SLOPE_SCALES:
                tt = t.copy()
                if k_max >= 1:
                    tt[1:] = t[1] + fs * (t[1:] - t[1])
                tt[0] = t[0] * f0
                cols.append(tt + fd * ks * cost.per_drafted)
    return np.stack(cols, axis=1)


def kept_intervals(curve: Curve, cost: CostModel, *, also=()) -> list[int]:
    """The intervals of ``curve`` worth keeping (module docstring), plus the indices in ``also``."""
    m = len(curve.rounds)
    hist = np.asarray(curve.hist, dtype=np.float64)
    seconds = hist @ perturbed_round_costs(cost, hist.shape[1] - 1)  # [M + 1, P]; N is the same everywhere
    keep = set(np.argmin(seconds, axis=0).tolist())
    keep |= set(np.unique(np.linspace(0, m - 1, min(m, SPREAD)).round().astype(np.int64)).tolist())
    keep |= {int(i) for i in also}
    return sorted(keep)


def candidate(params: dict, counts: Counts) -> dict:
    d = counts.to_dict()
    return {"params": params, "rounds": d["rounds"], "drafted": d["drafted"], "accepted": d["accepted"],
            "target_only": d["target_only"], "unproposed": d["unproposed"], "k_hist": d["k_hist"]}


def threshold_candidates(curve: Curve, spec: PolicySpec, cost: CostModel, *, also=()) -> list[dict]:
    """The kept intervals of one threshold sweep (``spec`` gives its SL_max and rule) as candidates."""
    out = []
    for i in kept_intervals(curve, cost.for_policy(spec), also=also):
        params = {"threshold": float(threshold_from_x(spec, curve.representative(i))), "sl_max": int(spec.sl_max),
                  "rule": spec.rule}
        out.append(candidate(params, curve.counts(i)))
    return out


def make_stats(candidates: list[dict], chosen: dict, n: int, prompts: int) -> dict:
    """The ``stats`` mapping; ``chosen`` is the tuned candidate's params (it must be among them)."""
    index = next((i for i, c in enumerate(candidates) if c["params"] == chosen), None)
    if index is None:
        raise ValueError(f"the tuned candidate {chosen} is not among the candidates")
    return {"format": STATS_FORMAT, "n": int(n), "prompts": int(prompts), "chosen": index, "candidates": candidates}


def counts(stats: dict, i: int) -> Counts:
    """Candidate ``i`` of ``stats`` as replay counts."""
    c = stats["candidates"][i]
    return Counts(n=int(stats["n"]), rounds=int(c["rounds"]), drafted=int(c["drafted"]), accepted=int(c["accepted"]),
                  target_only=int(c["target_only"]), prompts=int(stats["prompts"]),
                  k_hist=np.asarray(c["k_hist"], dtype=np.int64), unproposed=int(c.get("unproposed", 0)))


def with_params(spec: PolicySpec, params: dict) -> PolicySpec:
    """``spec`` with a candidate's parameters (threshold, SL_max, rule, K or start)."""
    return replace(spec, **{k: (float(v) if k == "threshold" else v) for k, v in params.items()})


def check_stats(stats, where: str = "stats") -> dict:
    """Refuse statistics that cannot be priced, in one line naming ``where``."""
    if not isinstance(stats, dict) or stats.get("format") != STATS_FORMAT or not stats.get("candidates"):
        raise UserError(f"{where}: not specstop's price-free statistics (format {STATS_FORMAT}); re-run `specstop tune`")
    try:
        n = int(stats["n"])
        for c in stats["candidates"]:
            if not isinstance(c.get("params"), dict) or min(int(v) for v in c["k_hist"]) < 0:
                raise ValueError
        if n < 1 or not 0 <= int(stats["chosen"]) < len(stats["candidates"]):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: malformed price-free statistics (n, chosen, candidates' params and k_hist); "
                        "re-run `specstop tune`") from None
    return stats


def _hists(stats: dict) -> np.ndarray:
    """``[candidates, K_max + 1]`` every candidate's K histogram, zero-padded to one width."""
    hists = [c["k_hist"] for c in stats["candidates"]]
    out = np.zeros((len(hists), max(len(h) for h in hists)), dtype=np.float64)
    for i, h in enumerate(hists):
        out[i, : len(h)] = h
    return out


def latencies(stats: dict, spec: PolicySpec, cost: CostModel) -> np.ndarray:
    """Seconds per token of every candidate under ``cost`` (with ``spec``'s decision cost): each K
    histogram priced at one go, as the tuner prices a sweep (:meth:`Counts.metrics` prices one candidate
    the same way: :func:`reprice` returns its figures)."""
    cost = cost.for_policy(spec)
    unproposed = np.array([float(c.get("unproposed", 0)) for c in stats["candidates"]])
    seconds = cost.total_hist(_hists(stats)) + unproposed * cost.per_drafted
    return seconds / max(float(stats["n"]), 1.0)


def batch_latencies(stats: dict, spec: PolicySpec, cost_b: CostModel, batch_size: int) -> np.ndarray:
    """Seconds per token of every candidate in a serving batch of ``batch_size`` rows, priced with
    ``cost_b`` (a round at that batch size, :func:`specstop.eval.batch_schedule.cost_at`): the expected
    cost of a batch round, whose length is the longest of the rows' K, per token the batch emits."""
    from specstop.eval.batch_schedule import expected_round_cost

    hists = _hists(stats)
    rounds = np.maximum(hists.sum(-1), 1.0)
    return expected_round_cost(hists, batch_size, cost_b.for_policy(spec)) * rounds / (batch_size * float(stats["n"]))


def reprice(stats: dict, spec: PolicySpec, cost: CostModel) -> tuple[PolicySpec, dict, int]:
    """The fastest candidate under ``cost``: ``(its spec, its metrics, its index)``.

    The metrics are those :meth:`Counts.metrics` prices a fresh replay of that spec with (latency per
    token, speedup, rounds, ...), exactly.
    """
    lat = latencies(stats, spec, cost)
    i = int(np.argmin(lat))
    best = with_params(spec, stats["candidates"][i]["params"])
    return best, counts(stats, i).metrics(cost.for_policy(best)), i


def reprice_tuned(tuned: dict, cost: CostModel, *, source: str = "tuned.json") -> tuple[dict, list[str]]:
    """A tuned file's every policy re-picked from its statistics under ``cost`` (no data is read).

    Returns:
        ``(the new tuned mapping, one line per change)``. Policies without statistics (tuned before
        they were kept) and token-tree policies keep their spec; the lines say so. ``best`` is chosen
        again among the re-priced policies, and the batch schedule is rebuilt from the static and
        confidence candidates when ``cost`` has batch costs.

    Raises:
        UserError: ``tuned`` holds no policy with statistics.
    """
    if not any(e.get("stats") for e in tuned["policies"].values()):
        raise UserError(f"{source} holds no price-free statistics (tuned before they were kept): re-run `specstop "
                        "tune` on the data to re-price it")
    policies, lines = {}, []
    for name, entry in tuned["policies"].items():
        spec = PolicySpec.from_dict(entry["spec"])
        if not entry.get("stats"):
            policies[name] = entry
            lines.append(f"{name}: no price-free statistics (tuned before they were kept), kept as {spec.label}")
            continue
        stats = check_stats(entry["stats"], f"{source} policy {name}")
        new, metrics, i = reprice(stats, spec, cost)
        old = entry["validation"].get("latency_per_token")
        policies[name] = {**entry, "spec": new.to_dict(), "stats": {**stats, "chosen": i},
                          "validation": {**{k: v for k, v in entry["validation"].items()
                                            if k not in metrics}, **metrics,
                                         "repriced": {"cost_model": cost.name, "was": spec.to_dict(),
                                                      "latency_per_token_was": old}}}
        change = "unchanged" if new == spec else f"{spec.label} -> {new.label}"
        lines.append(f"{name}: {change}, predicted speedup {metrics['speedup']:.3f}x")
    out = {**tuned, "policies": policies, "cost_model": cost.to_dict()}
    out["best"] = min(policies, key=lambda n: policies[n]["validation"]["latency_per_token"])
    if tuned.get("tree_policies"):
        lines.append("tree_policies: token trees carry no price-free statistics; kept as tuned")
    if getattr(cost, "batch", None) and "static_opt" in policies and "confidence_opt" in policies:
        out["batch_schedule"] = reprice_batch_schedule(policies["static_opt"]["stats"],
                                                       policies["confidence_opt"]["stats"], cost)
        lines.append(f"batch_schedule: re-picked at batch sizes {[e['batch_size'] for e in out['batch_schedule']['entries']]}")
    elif tuned.get("batch_schedule"):
        out.pop("batch_schedule")
        lines.append(f"batch_schedule: dropped ({cost.name} has no batch costs to price it with)")
    return out, lines


def reprice_batch_schedule(static: dict, confidence: dict, cost: CostModel) -> dict:
    """A ``batch_schedule`` (:mod:`specstop.eval.batch_schedule`) from the statistics of static K and of the
    confidence rule's candidates, priced at every batch size ``cost`` measured."""
    from specstop.eval.batch_schedule import (
        SCHEDULE_FORMAT,
        batch_speedup,
        cost_at,
        measured_batch_sizes,
        measured_k_max,
    )

    k_top = measured_k_max(cost)
    entries = []
    for b in measured_batch_sizes(cost):
        cost_b = cost_at(cost, b)
        by_k = {0: 1.0}
        for i, c in enumerate(static["candidates"]):
            k = int(c["params"]["k"])
            if k <= k_top:
                by_k[k] = float(batch_speedup(counts(static, i).k_hist, static["n"], b, cost_b.for_policy("static")))
        best_k = max(by_k, key=lambda k: (by_k[k], -k))
        conf = PolicySpec(kind="confidence")
        best = None
        for i, c in enumerate(confidence["candidates"]):
            if int(c["params"]["sl_max"]) > k_top:
                continue
            s = float(batch_speedup(counts(confidence, i).k_hist, confidence["n"], b, cost_b.for_policy(conf)))
            if best is None or s > best[0] + 1e-12:
                best = (s, c["params"])
        entries.append({
            "batch_size": int(b), "k": int(best_k), "predicted_speedup": round(by_k[best_k], 4),
            "predicted_speedup_by_k": {str(k): round(v, 4) for k, v in sorted(by_k.items())},
            "threshold": None if best is None else {"threshold": float(best[1]["threshold"]),
                                                    "sl_max": int(best[1]["sl_max"]),
                                                    "predicted_speedup": round(best[0], 4)},
        })
    return {"format": SCHEDULE_FORMAT, "cost_model": cost.name, "entries": entries,
            "note": "re-picked from the tuned policies' price-free statistics"}
