"""A specstop cost model measured inside a serving engine (vLLM), not through transformers.

``specstop calibrate-cost --engine vllm`` starts vLLM (its own virtualenv, ``make vllm-env``) with
specstop's proposer in its cost sweep: every row drafts exactly K tokens, K cycling over the grid
(``SpecstopProposer.cost_sweep``), on held-out prompts at each batch size B. The proposer times, in
the engine's own process and with the engine's own kernels for the target:

* ``draft_call[B x K]``: one ``propose`` call in which each of B rows drafted K tokens (the draft's
  catch-up feed and the policy's decisions included), and
* ``target_step[B x L]``: the wall time from one ``propose`` to the next after every row verified L
  = K + 1 tokens (the target's forward, sampling, rejection and vLLM's scheduling).

A round of K drafted tokens then costs ``draft_call(K) + target_step(K + 1)``; this module writes
that as the usual :class:`~specstop.eval.cost.CostModel` (a per-drafted-token slope fitted over K >= 1
and a per-K table holding the rest), so ``specstop tune``, ``eval`` and ``export`` price policies
with the engine's costs, and every engine file says which costs priced it.

vLLM's own draft-model runner (a fixed K, the draft in vLLM's kernels) costs what it costs, not what
specstop's proposer does: its decode step per K, and vLLM's step without speculation, are kept as
``fit["vllm_runner"]`` (by batch size and K) and price the options vLLM runs itself, a fixed K and
the per-batch schedule (:func:`specstop.eval.cost.runner_speedup`).
"""

from __future__ import annotations

import numpy as np

from specstop.errors import UserError
from specstop.eval.cost import CostModel

#: Where ``calibrate-cost --engine vllm`` ran specstop's stop (``machine["vllm_path"]``), as the cost model says it.
SWEPT_IN = {"runner": "specstop's stop in vLLM's batched draft runner",
            "proposer": "specstop's side-path proposer (transformers, one request after another)"}


def _by_batch(table: dict, shift: int = 0) -> dict[int, dict[int, float]]:
    """``{"BxN": s}`` -> ``{B: {N - shift: s}}``."""
    out: dict[int, dict[int, float]] = {}
    for key, seconds in table.items():
        b, n = (int(v) for v in str(key).split("x"))
        out.setdefault(b, {})[n - shift] = float(seconds)
    return out


def _round_table(calls: dict[int, float], steps: dict[int, float]) -> tuple[float, dict[int, float]] | None:
    """(seconds per drafted token, {K: round seconds minus K x that}) from one batch size's timings;
    None without K = 0 and two K >= 1 timed both ways."""
    ks = sorted(set(calls) & set(steps))
    drafted = [k for k in ks if k >= 1]
    if 0 not in ks or len(drafted) < 2:
        return None
    slope = float(np.polyfit(np.array(drafted, dtype=np.float64), np.array([calls[k] for k in drafted]), 1)[0])
    slope = max(slope, 0.0)
    return slope, {k: steps[k] + calls[k] - k * slope for k in ks}


def _reproduced_shape(costs: dict, table: dict[int, float]) -> dict:
    """The cost check's record: K whose cheaper-than-shorter verification holds in both halves of the
    samples, timed apart (a kernel's shape, priced as measured; see :mod:`specstop.eval.cost_check`)."""
    from specstop.eval.cost_check import order_problems

    halves = costs.get("halves") or {}
    suspects = {ks for ks, _ in order_problems(table)}
    if not suspects or not halves:
        return {"reproduced": [], "warnings": [], "problems": []}
    held = []
    for i in (0, 1):
        steps = _by_batch({k: v[i] for k, v in (halves.get("target_step") or {}).items()}, shift=1).get(1, {})
        calls = _by_batch({k: v[i] for k, v in (halves.get("draft_call") or {}).items()}).get(1, {})
        part = _round_table(calls, steps)
        held.append({k for ks, _ in order_problems(part[1]) for k in ks} if part else set())
    # A suspect K (and the longer K it undercuts) counts as reproduced when each half flags it on its own.
    reproduced = sorted({k for ks in suspects for k in ks if k in held[0] and k in held[1]})
    return {"reproduced": reproduced, "warnings": [], "problems": [],
            "note": "verification cheaper than a shorter one at these K, in both halves of the engine's samples"
            if reproduced else ""}


def cost_model_from_engine(costs: dict, *, engine: str, name: str, machine: dict,
                           runner: dict | None = None) -> CostModel:
    """The cost model of an engine's measured costs (``SpecstopProposer.engine_costs()`` of a cost sweep).

    Args:
        costs: ``{"target_step": {"BxL": s}, "draft_call": {"BxK": s}, ...}``.
        runner: vLLM's own draft-model runner, ``{"B": {"K": {"step_s": s, ...}}}`` (K = "0": without
            speculation), from :func:`specstop.measure.vllm_cost.time_runner`; kept as ``fit["vllm_runner"]``.
        engine: the engine and version that ran (``"vllm 0.32.0"``), recorded in ``machine`` and ``fit``.
        name: the cost model's name (reports print it).
        machine: where it ran (cpu, dtype, ...), as calibrate-cost records it.

    Returns:
        A measured :class:`CostModel`: batch size 1 as the chain model (``t_draft`` = seconds per drafted
        token, ``target_by_k`` = the rest of a round of K), and a ``batch`` section when 2+ batch sizes
        were timed.

    Raises:
        UserError: when batch size 1 lacks K = 0 or two K >= 1 (too short a sweep).
    """
    steps = _by_batch(costs.get("target_step") or {}, shift=1)
    calls = _by_batch(costs.get("draft_call") or {})
    tables = {b: t for b in sorted(calls) if (t := _round_table(calls[b], steps.get(b, {}))) is not None}
    if 1 not in tables:
        raise UserError(f"{engine}: the cost sweep timed too few draft lengths at batch size 1 (need K = 0 and two "
                        "K >= 1 both drafted and verified); give more prompts, tokens or a longer --budget")
    slope, table = tables[1]
    check = _reproduced_shape(costs, table)
    swept_in = SWEPT_IN.get(machine.get("vllm_path"), "specstop's proposer")
    batch = None
    if len(tables) >= 2:
        sizes = sorted(tables)
        common = sorted(set.intersection(*(set(tables[b][1]) for b in sizes)))
        batch = {"batch_sizes": sizes, "k_grid": common,
                 "t_draft": {str(b): tables[b][0] for b in sizes},
                 "t_target": {str(b): {str(k): tables[b][1][k] for k in common} for b in sizes},
                 "source": f"{engine}, {swept_in} (draft calls and target steps timed in the engine)"}
    positive = {k: max(v, 1e-6) for k, v in table.items()}
    return CostModel(
        t_draft=slope, t_target=positive[min(k for k in positive if k >= 1)], target_by_k=positive,
        t_target_single=positive[0], provenance="measured", name=name,
        machine={**machine, "engine": engine},
        fit={"engine": engine, "method": f"cost sweep of {swept_in}: round(K) = draft_call(K) + target_step(K+1)",
             "raw": costs, "check": check,
             **({"vllm_runner": {"step_s": runner,
                                 "method": "vLLM's draft-model runner at a fixed K (K = 0: no speculation), B "
                                           "different prompts per batch: each engine step timed, the median "
                                           "of the decode steps in which all B rows decoded"}} if runner else {})},
        batch=batch,
    )
