"""Shared pricing: what a settings file predicts for each option and batch size, and whose costs priced it.

Every engine's file carries the tuned replay's prediction (read from ``tuned.json``) and one line saying
whether the cost model was measured in that engine or is an estimate for it.
"""

from __future__ import annotations

_PREDICTED_KEYS = ("speedup", "latency_per_token", "tokens_per_round", "accepted_per_round", "verification_rate",
                   "discard_rate")


def prediction(entry: dict) -> dict:
    """The replay's predicted metrics of a tuned policy entry (those it has)."""
    v = entry["validation"]
    return {k: v.get(k) for k in _PREDICTED_KEYS if k in v}


def stats(entry: dict) -> dict:
    """An option's price-free statistics (:mod:`specstop.eval.price_free`): what the replay counted for
    the policy's candidates, so another cost table - this engine's own - re-prices it with no data."""
    return {"stats": entry["stats"]} if entry.get("stats") else {}


def speedup_at(entry: dict, k: int) -> float | None:
    """The predicted speedup of running K = ``k`` at a schedule entry's batch size (None when not priced)."""
    if k == entry["k"]:
        return entry["predicted_speedup"]
    return entry["predicted_speedup_by_k"].get(str(k))


def schedule_rows(sched: dict, ks: list[int]) -> list[dict]:
    """Per batch size: the K the engine runs and its predicted speedup (the tuned one unless K was changed)."""
    rows = []
    for e, k in zip(sched["entries"], ks):
        row = {"batch_size": e["batch_size"], "k": k, "predicted_speedup": speedup_at(e, k)}
        if k != e["k"]:
            row["tuned_k"] = e["k"]
        rows.append(row)
    return rows


def priced_by(cost_model: dict | None, engine: str) -> str:
    """One line: whose step costs priced the predictions of ``engine``'s file (the engine's own, measured in
    it by ``specstop calibrate-cost --engine``, or specstop's decoders' and so only an estimate for it)."""
    cost = cost_model or {}
    measured_in = ((cost.get("machine") or {}).get("engine") or "").split(" ")[0]
    name = cost.get("name") or "?"
    if measured_in and measured_in == engine:
        path = (cost.get("machine") or {}).get("vllm_path")
        where = {"runner": "; specstop's stop timed in vLLM's batched draft runner",
                 "proposer": "; specstop's stop timed in the side-path proposer"}.get(path, "")
        return f"{engine}'s own costs, measured inside {(cost.get('machine') or {}).get('engine')} (cost model {name}{where})"
    if measured_in:
        return (f"{measured_in}'s costs (cost model {name}), not {engine}'s: an estimate for {engine}")
    if cost.get("provenance") == "measured":
        return (f"specstop's transformers decoders' costs on this machine (cost model {name}), not {engine}'s: an "
                f"estimate for {engine}" + ("; `specstop calibrate-cost --engine vllm` measures vLLM's own"
                                            if engine == "vllm" else ""))
    return f"the preset cost model {name} (not measured): an estimate"
