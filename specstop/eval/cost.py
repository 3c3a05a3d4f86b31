"""Latency cost models for speculative decoding: a measured verification table, or the papers' line.

A round that drafts K tokens costs

    cost(K) = K * (draft_step + predictor_per_step) + t_target(K)          (K >= 1)
    cost(0) = t_target(0)                                                  (a target-only step)

where t_target(K) is one target pass over K + 1 tokens (K drafted plus the token before them) and
t_target(0) a single-token step (plain decoding). Latency per token = sum of round costs / N, so
a replay only needs the histogram of K over its rounds (``Counts.k_hist``).

t_target(K) comes from, in order of preference:

* ``target_by_k``: a table measured by ``specstop calibrate-cost`` on the decoding machine, in the
  decoding dtype and at the decoding context length, interpolated linearly between measured K and
  extrapolated along the last two points. The shape differs in kind between machines: on a 2-core
  AVX2 EPYC in float32 it was concave, 0.57 / 1.05 / 1.51 / 2.13 / 2.54 / 3.01 s at K = 0 / 1 / 2
  / 4 / 8 / 16; on a 2-core AMX Xeon in bf16 nearly flat, 0.19 s at K = 0 and 0.22 s at K = 16.
  No line fits both.
* the line ``t_target + verify_per_token * (K + 1)`` with ``t_target_single`` at K = 0 (presets).

With ``verify_per_token = 0``, ``predictor_per_step = 0`` and no table this is SpecDec++ Eq. 5.1:

    latency / token = t_draft + t_draft * N_discarded / N + (t_target - t_draft) * N_target / N

(because N_draft = N - N_target + N_discarded when every round emits its accepted tokens plus one
target token).

A preset is not this machine: ``CostModel.provenance`` says "preset" and every report priced with
one says so in its first line (:func:`provenance_line`).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Seconds per model call.

    Attributes:
        t_draft: one draft forward step (one token), seconds.
        t_target: fixed cost of one target verification pass on the line (intercept), seconds.
        verify_per_token: extra target cost per token in the verified block on the line (slope).
        draft_per_token: draft cost per drafted token in the round formula; None = ``t_draft``.
        predictor_per_step: a stopping predictor's own cost per draft step (when ``policy_per_step``
            has no entry for it).
        policy_per_step: measured decision cost per draft step by policy, ``{"confidence": s,
            family or checkpoint name: s}`` (features included: softmax, top-k). Static, heuristic
            and oracle decide for free; see :meth:`for_policy`.
        t_target_single: one single-token target step (plain decoding, K = 0 rounds); None = the
            table's K = 0 entry, else the line at K = 0.
        target_by_k: measured t_target(K), ``{K: seconds}`` (K drafted tokens, K + 1 verified;
            K = 0 a single-token step); None = the line.
        provenance: ``measured`` (calibrated on the machine named in ``machine``) or ``preset``.
        machine: where and how it was measured (CPU model, device, dtype and why, context length).
        name: preset or file name, for reports.
        fit: calibration details when measured (raw medians, spreads, R^2); informational.
        pearl_split: PEARL's costs with the machine split between the two models, measured by
            calibrate-cost: ``{"draft_step": s, "target_scale": x, "measured": {...}}`` - the draft's
            step on its share while the target runs, and the factor by which a target pass on its
            share (beside the draft) is slower than the same pass on the whole machine. None: PEARL
            is priced with perfect overlap on the whole machine (an idealisation, said so).
        tree: token-tree costs measured by calibrate-cost (:func:`specstop.measure.calibrate.time_tree`):
            ``{"n_grid": [N, ...], "t_target_tree": {N: s}, "w_grid": [W, ...], "t_draft_width": {W: s}}``
            - one target forward over the pending token plus N tree nodes under the tree mask, and one
            draft forward over a frontier of W nodes; read with :meth:`tree_target_cost` /
            :meth:`tree_draft_cost`. None: tree rounds are priced from ``target_by_k`` and ``t_draft``.
        batch: batch-aware costs measured by ``calibrate-cost --batch-grid``
            (:func:`specstop.measure.batch_cost.time_batch`): ``{"batch_sizes", "k_grid", "t_draft": {B: s},
            "t_target": {B: {K: s}}, "iqr", ...}`` (string keys once read from JSON); priced by
            :mod:`specstop.eval.batch_schedule`. None: batch size 1 only.
    """

    t_draft: float
    t_target: float
    verify_per_token: float = 0.0
    draft_per_token: float | None = None
    predictor_per_step: float = 0.0
    t_target_single: float | None = None
    target_by_k: dict | None = None
    policy_per_step: dict | None = None
    provenance: str = "preset"
    machine: dict | None = None
    name: str = "custom"
    fit: dict | None = None
    pearl_split: dict | None = None
    tree: dict | None = None
    batch: dict | None = None

    def __post_init__(self) -> None:
        for f in ("t_draft", "t_target", "verify_per_token", "predictor_per_step", "t_target_single"):
            v = getattr(self, f)
            if v is not None and not (np.isfinite(v) and v >= 0):
                raise ValueError(f"cost model {f} must be a finite number >= 0 seconds, got {v}")
        if self.target_by_k is not None:
            # JSON turns int keys into strings; store ints, sorted.
            table = {int(k): float(v) for k, v in dict(self.target_by_k).items()}
            if not table or min(table) < 0 or any(not (np.isfinite(v) and v > 0) for v in table.values()):
                raise ValueError(f"cost model target_by_k needs K >= 0 and seconds > 0, got {self.target_by_k}")
            object.__setattr__(self, "target_by_k", dict(sorted(table.items())))
        if self.provenance not in ("measured", "preset"):
            raise ValueError(f"cost model provenance must be 'measured' or 'preset', got {self.provenance!r}")

    # ------------------------------------------------------------------ per-round costs
    @property
    def draft_step(self) -> float:
        return self.t_draft if self.draft_per_token is None else self.draft_per_token

    @property
    def per_drafted(self) -> float:
        """Draft-side cost of one more drafted token (the target side is in ``target_cost``)."""
        return self.draft_step + self.predictor_per_step

    def target_cost(self, k: int) -> float:
        """t_target(K): one target pass over K + 1 tokens; K = 0 is a single-token step."""
        return float(self.target_costs(int(k))[int(k)])

    def target_costs(self, k_max: int) -> np.ndarray:
        """[k_max + 1] t_target(K) for K = 0..k_max (see module docstring for the sources)."""
        ks = np.arange(int(k_max) + 1, dtype=np.float64)
        if self.target_by_k:
            xs = np.array(list(self.target_by_k), dtype=np.float64)
            ys = np.array(list(self.target_by_k.values()), dtype=np.float64)
            out = np.interp(ks, xs, ys)
            if len(xs) >= 2:
                slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
                beyond = ks > xs[-1]
                out[beyond] = ys[-1] + slope * (ks[beyond] - xs[-1])
            if self.t_target_single is not None:
                out[0] = self.t_target_single
            return out
        out = self.t_target + self.verify_per_token * (ks + 1.0)
        if self.t_target_single is not None:
            out[0] = self.t_target_single
        return out

    def round_costs(self, k_max: int) -> np.ndarray:
        """[k_max + 1] cost(K) of a round drafting K tokens, K = 0..k_max."""
        ks = np.arange(int(k_max) + 1, dtype=np.float64)
        return self.target_costs(k_max) + ks * self.per_drafted

    def round_cost(self, k: int) -> float:
        return float(self.round_costs(int(k))[int(k)])

    def tree_target_cost(self, n: float) -> float:
        """One target forward verifying a token tree of ``n`` nodes: the measured ``tree`` table
        interpolated in N (extrapolated along its last two points), else t_target(n)."""
        table = (self.tree or {}).get("t_target_tree")
        if not table or n <= 0:
            return self.target_cost(int(round(n)))
        return _interp_table(table, n)

    def tree_draft_cost(self, w: float) -> float:
        """One draft forward over a frontier of ``w`` nodes: the measured ``tree`` table interpolated
        in W, else t_draft (the chain's one-token step)."""
        table = (self.tree or {}).get("t_draft_width")
        if not table:
            return self.t_draft
        return _interp_table(table, max(float(w), 1.0))

    @property
    def single_step(self) -> float:
        """Cost of a target-only step (K = 0)."""
        return self.target_cost(0)

    @property
    def target_only_per_token(self) -> float:
        """Latency per token of plain target decoding (every token a target-only step)."""
        return self.single_step

    def for_policy(self, spec) -> CostModel:
        """This model with the decision cost of ``spec`` (a PolicySpec): none for static, heuristic,
        oracle and PEARL (they read nothing), the measured confidence cost for ``confidence``, the
        predictor's own (by checkpoint name, then family) for learned policies."""
        from dataclasses import replace

        per = self.policy_per_step or {}
        kind = getattr(spec, "kind", spec)
        if kind == "confidence":
            step = per.get("confidence", 0.0)
        elif kind == "predictor":
            extra = getattr(spec, "extra", None) or {}
            keys = (extra.get("checkpoint"), extra.get("scores"), getattr(spec, "family", None))
            step = next((per[k] for k in keys if k and k in per), self.predictor_per_step)
        else:
            step = 0.0
        return self if step == self.predictor_per_step else replace(self, predictor_per_step=float(step))

    # ------------------------------------------------------------------ totals from K histograms
    def total_hist(self, k_hist) -> np.ndarray:
        """Seconds for rounds given as a K histogram ``[..., K_max + 1]`` (leading dims broadcast)."""
        h = np.asarray(k_hist, dtype=np.float64)
        return h @ self.round_costs(h.shape[-1] - 1)

    def latency_from_hist(self, k_hist, n_tokens) -> np.ndarray:
        """Seconds per emitted token for K histograms ``[..., K_max + 1]`` and token counts ``[...]``."""
        return self.total_hist(k_hist) / np.maximum(np.asarray(n_tokens, dtype=np.float64), 1.0)

    def eq51(self, n: float, n_target: float, n_discarded: float) -> float:
        """SpecDec++ Eq. 5.1 (exact for this model when verify_per_token = predictor_per_step = 0, no table)."""
        return self.t_draft + self.t_draft * n_discarded / n + (self.t_target - self.t_draft) * n_target / n

    # ------------------------------------------------------------------ descriptions and I/O
    @property
    def is_preset(self) -> bool:
        return self.provenance != "measured"

    def provenance_line(self) -> str:
        """One line for the top of every report priced with this model."""
        if self.is_preset:
            return (
                f"Priced with the preset cost model `{self.name}`: NOT measured on this machine. Run "
                "`specstop calibrate-cost` (or `cost_model: calibrate` in a pipeline) for this machine's numbers."
            )
        m = self.machine or {}
        where = ", ".join(
            str(v)
            for v in (
                m.get("cpu") if m.get("device", "cpu") == "cpu" else m.get("device"),
                m.get("dtype"),
                f"context {m['context_tokens']} tokens" if m.get("context_tokens") else None,
                m.get("measured_at"),
            )
            if v
        )
        return f"Priced with cost model `{self.name}`, measured on this machine's kind ({where})."

    def describe(self) -> str:
        """The per-K costs in one line (reports, logs)."""
        t = self.target_costs(16)
        ks = [k for k in (0, 1, 2, 4, 8, 16)]
        table = " / ".join(f"{t[k]:.3f}" for k in ks)
        return (
            f"t_draft {self.draft_step:.4f} s/step, predictor {self.predictor_per_step:.2e} s/step, "
            f"t_target(K) at K = {'/'.join(map(str, ks))}: {table} s"
            + ("" if self.target_by_k else " (line)")
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.target_by_k is not None:
            d["target_by_k"] = {str(k): v for k, v in self.target_by_k.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown cost model keys {sorted(extra)}; valid keys: {sorted(known)}")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if required - set(d):
            raise ValueError(f"a cost model needs {sorted(required)} (missing {sorted(required - set(d))}); "
                             "write one with `specstop calibrate-cost` or name a preset")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        from specstop.jsonio import atomic_write_json

        atomic_write_json(Path(path), self.to_dict())


def _interp_table(table: dict, x: float) -> float:
    """Linear interpolation in a ``{size: seconds}`` table (JSON string keys allowed); beyond its last
    point along the last two points' slope (never decreasing), below its first point flat."""
    pts = sorted((float(k), float(v)) for k, v in table.items())
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if x > xs[-1] and len(xs) >= 2:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


# Presets (provenance "preset": reports priced with them say so in their first line).
# llama2-7b-70b: SpecDec++ section 5.2's measured llama-2-chat 7B / 70B step times (A100s);
# verification cost independent of block size, as in the paper; its Table 2 gives the target's
# single-token step as 0.108 s (vs 0.112 s for a verification pass).
# reference-cpu: the reference pair on a 2-core AVX2 EPYC in float32 as calibrated there
# (0.215 s per draft step; t_target(K) 0.57 / 1.05 / 1.51 / 2.13 / 2.54 / 3.01 s at K = 0 / 1 / 2 / 4
# / 8 / 16). Another machine differs in kind: calibrate on the machine that decodes.
PRESETS: dict[str, CostModel] = {
    "llama2-7b-70b": CostModel(t_draft=0.0234, t_target=0.112, t_target_single=0.108, name="llama2-7b-70b"),
    "reference-cpu": CostModel(
        t_draft=0.215,
        t_target=1.197,
        verify_per_token=0.118,
        t_target_single=0.573,
        target_by_k={0: 0.573, 1: 1.05, 2: 1.51, 4: 2.13, 8: 2.54, 16: 3.01},
        machine={"cpu": "AMD EPYC (AVX2, 2 cores)", "device": "cpu", "dtype": "float32"},
        name="reference-cpu",
    ),
}


def load_cost_model(spec: str | Path | dict | CostModel) -> CostModel:
    """A preset name, a cost.json path, a dict or a CostModel -> CostModel."""
    if isinstance(spec, CostModel):
        return spec
    if isinstance(spec, dict):
        return CostModel.from_dict(spec)
    s = str(spec)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if p.is_file():
        try:
            d = json.loads(p.read_text())
        except ValueError as err:
            raise ValueError(f"{p} is not a cost model JSON ({err}); rewrite it with `specstop calibrate-cost`") from err
        d.setdefault("name", p.name)
        d.setdefault("provenance", "measured" if d.get("fit") else "preset")
        return CostModel.from_dict(d)
    raise ValueError(
        f"unknown cost model {s!r}: give a preset ({', '.join(PRESETS)}) or a cost.json written by "
        "`specstop calibrate-cost`"
    )


def runner_speedup(runner: dict | None, k: int, tokens_per_round: float | None, batch_size: int = 1) -> float | None:
    """Predicted speedup of vLLM's draft-model runner at a fixed ``k`` over vLLM without speculation, at
    ``batch_size`` rows: ``tokens_per_round x step(0) / step(k)``, the steps as ``fit["vllm_runner"]``
    measured them at that batch size (interpolated linearly between measured K, never extrapolated);
    None where a side was not measured."""
    at_b = ((runner or {}).get("step_s") or {}).get(str(batch_size)) or {}
    steps = {int(kk): float(v["step_s"]) for kk, v in at_b.items()}
    if 0 not in steps or not tokens_per_round or k < 1:
        return None
    ks = sorted(kk for kk in steps if kk >= 1)
    if not ks or k < ks[0] or k > ks[-1]:
        return None
    step = float(np.interp(k, ks, [steps[kk] for kk in ks]))
    return tokens_per_round * steps[0] / step
