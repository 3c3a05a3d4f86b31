"""Live re-pricing: a decoder times its own steps and re-picks its policy as the costs it meets move.

A policy is tuned against a cost table measured once; the steps a decoder then pays move with the
process, the minute and the machine (on a 2-core AMD EPYC the one-row bf16 target step sat 25% higher
in one process than in the next, and vLLM's steps moved by up to a third between engine starts). So a
decoder keeps robust running estimates of what it pays, as ratios to the table:

* the draft: a round's draft forwards per drafted token, against the table's draft step;
* the decision: the policy's own seconds per drafted token, against the table's decision cost;
* a verification: the target forward over K + 1 tokens, against the table's t_target(K);
* a target-only step: against t_target(0) (the verification's ratio until such steps are seen).

Each estimate is the median of the last :data:`WINDOW` rounds' ratios (one slow round moves nothing).
Every :data:`EVERY` rounds the table, scaled by the four estimates, prices the policy's price-free
statistics (:mod:`specstop.eval.price_free`: the candidate thresholds, SL_max or K the tuning kept),
and where another candidate is predicted faster than the one in use by more than :data:`MARGIN` the
policy switches to it between rounds and the decoder logs what changed and why. Only where drafting
stops changes, so decoding stays lossless. On by default for a policy that carries statistics and a
table (an export from ``specstop export``); ``live_pricing=False`` (``--pin-policy``) keeps the tuned
policy as it is.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.price_free import batch_latencies, check_stats, latencies, with_params

log = logging.getLogger("specstop")

WINDOW = 24
EVERY = 8
MIN_ROUNDS = 8
MARGIN = 0.03


def scaled(table: CostModel, *, draft: float = 1.0, decision: float = 1.0, verify: float = 1.0,
           single: float = 1.0) -> CostModel:
    """``table`` with its draft step, decision costs, verifications (K >= 1) and one-row target step (K = 0)
    each multiplied by a factor."""
    target_by_k = None
    if table.target_by_k:
        target_by_k = {k: v * (single if k == 0 else verify) for k, v in table.target_by_k.items()}
    policy = {k: v * decision for k, v in (table.policy_per_step or {}).items()} or None
    return replace(table, t_draft=table.t_draft * draft,
                   draft_per_token=None if table.draft_per_token is None else table.draft_per_token * draft,
                   predictor_per_step=table.predictor_per_step * decision, policy_per_step=policy,
                   t_target=table.t_target * verify, verify_per_token=table.verify_per_token * verify,
                   t_target_single=table.target_cost(0) * single, target_by_k=target_by_k,
                   name=f"{table.name} (live)")


@dataclass
class Switch:
    """One re-pick: after ``round`` rounds the policy went from ``before`` to ``after`` because the live
    costs (``scales``: ratios to the table) predicted ``gain`` less time per token."""

    round: int
    before: str
    after: str
    scales: dict
    predicted_before: float
    predicted_after: float

    @property
    def gain(self) -> float:
        return 1.0 - self.predicted_after / self.predicted_before

    def line(self) -> str:
        s = self.scales
        return (f"live pricing: {self.before} -> {self.after} after {self.round} rounds (draft step {s['draft']:.2f}x, "
                f"verification {s['verify']:.2f}x, target-only step {s['single']:.2f}x, decision {s['decision']:.2f}x "
                f"the table's; predicted {1e3 * self.predicted_before:.1f} -> {1e3 * self.predicted_after:.1f} ms per "
                f"token, {100 * self.gain:.1f}% less)")


class LiveCosts:
    """Robust running ratios of a decoder's measured step costs to ``table`` (module docstring)."""

    def __init__(self, table: CostModel, window: int = WINDOW) -> None:
        self.table = table
        self.ratios = {name: deque(maxlen=window) for name in ("draft", "decision", "verify", "single")}
        self.rounds = 0
        self._at: dict[int, CostModel] = {1: table}

    def priced_at(self, batch_size: int) -> CostModel:
        """The table for rounds of ``batch_size`` rows: its measured ``batch`` section where it has one
        (:func:`specstop.eval.batch_schedule.cost_at`), else the batch-1 table (the ratios then hold
        the batch's own cost too)."""
        b = int(batch_size)
        if b not in self._at:
            from specstop.eval.batch_schedule import cost_at

            self._at[b] = cost_at(self.table, b) if self.table.batch else self.table
        return self._at[b]

    def add_round(self, k: int, *, draft_s: float, decision_s: float, target_s: float, decision_per_step: float,
                  batch_size: int = 1) -> None:
        """One round's seconds: ``k`` drafted tokens (0: a target-only step; a batch round: its draft
        forwards, the longest row's K), the draft forwards and picks, the policy's decisions and the target
        forward; ``decision_per_step`` is the table's decision cost for the policy in use per row (0 for
        rules that read nothing); ``batch_size``: the rows the round decoded."""
        self.rounds += 1
        t = self.priced_at(batch_size)
        decision_per_step *= batch_size
        if k == 0:
            self._add("single", target_s, t.target_cost(0))
            return
        self._add("verify", target_s, t.target_cost(k))
        self._add("draft", draft_s / k, t.draft_step)
        if decision_per_step > 0:
            self._add("decision", decision_s / k, decision_per_step)

    def _add(self, name: str, measured: float, predicted: float) -> None:
        if predicted > 0 and measured > 0:
            self.ratios[name].append(measured / predicted)

    def scales(self) -> dict:
        """The current ratios (1.0 where nothing was measured; the target-only step follows the
        verifications until it is measured itself)."""
        med = {n: float(np.median(v)) for n, v in self.ratios.items() if v}
        verify = med.get("verify", 1.0)
        return {"draft": med.get("draft", 1.0), "decision": med.get("decision", 1.0), "verify": verify,
                "single": med.get("single", verify)}

    def model(self, batch_size: int = 1) -> CostModel:
        """The table (at ``batch_size`` rows) scaled by the current ratios: what the decoder pays now."""
        return scaled(self.priced_at(batch_size), **self.scales())


class LivePricer:
    """Re-picks ``policy``'s parameters from its price-free statistics as the live costs move.

    Args:
        policy: a :class:`~specstop.export.runtime.StoppingPolicy` carrying ``stats`` (an export).
        table: the cost table the statistics are priced with (the export's, or another).
        margin: switch only when the best candidate beats the one in use by this fraction.
        every: re-price every this many rounds (after :data:`MIN_ROUNDS`).
    """

    def __init__(self, policy, table: CostModel, *, margin: float = MARGIN, every: int = EVERY) -> None:
        self.policy = policy
        self.costs = LiveCosts(table)
        self.margin = float(margin)
        self.every = int(every)
        self.switches: list[Switch] = []
        # The batched decoder's rows: candidates are then priced as batch rounds of this many rows.
        self.batch_size = 1

    @classmethod
    def for_policy(cls, policy, table: CostModel | dict | None = None, **kwargs) -> LivePricer | None:
        """A pricer for ``policy`` when it carries statistics and a table is known (``table`` or the
        export's ``cost_model``); None otherwise (rules built from strings, exports made before
        statistics were kept)."""
        if getattr(policy, "stats", None) is None:
            return None
        table = table if table is not None else (getattr(policy, "config", None) or {}).get("cost_model")
        if table is None:
            return None
        table = table if isinstance(table, CostModel) else CostModel.from_dict(dict(table))
        return cls(policy, table, **kwargs)

    def max_cap(self) -> int:
        """The largest per-round cap any candidate may switch to (caches are sized for it)."""
        spec = self.policy.spec
        return max([spec.cap] + [with_params(spec, c["params"]).cap for c in (self.policy.stats or {}).get("candidates", [])])

    def decision_cost(self) -> float:
        return self.costs.table.for_policy(self.policy.spec).predictor_per_step

    def observe(self, k: int, *, draft_s: float, decision_s: float, target_s: float,
                batch_size: int = 1) -> Switch | None:
        """Record one round (of ``batch_size`` rows) and re-price when due; returns the switch made, if any."""
        self.costs.add_round(k, draft_s=draft_s, decision_s=decision_s, target_s=target_s,
                             decision_per_step=self.decision_cost(), batch_size=batch_size)
        r = self.costs.rounds
        if r < MIN_ROUNDS or r % self.every:
            return None
        return self.reprice()

    def observe_phases(self, k: int, before: dict[str, float], after: dict[str, float],
                       batch_size: int = 1) -> Switch | None:
        """:meth:`observe` from a decoder's per-phase second totals before and after a round (its
        ``draft``, ``predictor`` and ``target`` phases)."""
        spent = {p: after[p] - before[p] for p in ("draft", "predictor", "target")}
        return self.observe(k, draft_s=spent["draft"], decision_s=spent["predictor"], target_s=spent["target"],
                            batch_size=batch_size)

    def _latencies(self, stats: dict, spec, model: CostModel | None = None) -> np.ndarray:
        """Every candidate's seconds per token at the live costs (batch rounds in the batched decoder)."""
        model = model or self.costs.model(self.batch_size)
        if self.batch_size > 1:
            return batch_latencies(stats, spec, model, self.batch_size)
        return latencies(stats, spec, model)

    @staticmethod
    def _index(stats: dict, spec) -> int | None:
        for i, c in enumerate(stats["candidates"]):
            if with_params(spec, c["params"]) == spec:
                return i
        return None

    def reprice(self) -> Switch | None:
        """Switch to the fastest candidate under the live costs if it beats the one in use by the margin."""
        stats = check_stats(self.policy.stats, f"policy {self.policy.label} stats")
        spec = self.policy.spec
        lat = self._latencies(stats, spec)
        best = int(np.argmin(lat))
        now = self._index(stats, spec)
        current = float(lat[now]) if now is not None else float("inf")
        if best == now or lat[best] >= current * (1.0 - self.margin):
            return None
        new = with_params(spec, stats["candidates"][best]["params"])
        switch = Switch(self.costs.rounds, spec.label, new.label, self.costs.scales(),
                        current if np.isfinite(current) else float(lat[best]), float(lat[best]))
        self.policy.set_spec(new)
        self.switches.append(switch)
        log.info("%s", switch.line())
        return switch

    def record(self) -> dict:
        """What a result records: the live ratios, the policy in use and every switch."""
        return {"scales": self.costs.scales(), "rounds": self.costs.rounds, "policy": self.policy.spec.label,
                "switches": [{"round": s.round, "from": s.before, "to": s.after, "scales": s.scales,
                              "predicted_ms_per_token": [1e3 * s.predicted_before, 1e3 * s.predicted_after]}
                             for s in self.switches]}
