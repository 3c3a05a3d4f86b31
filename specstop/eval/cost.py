"""Latency cost models for speculative decoding (SpecDec++ Eq. 5.1 and a verify-size-aware form).

Round cost (one draft-then-verify round drafting K tokens):

    cost(K) = K * (draft_step + predictor_per_step) + t_target + verify_per_token * (K + 1)

where ``draft_step = draft_per_token`` (defaults to ``t_draft``). A target-only step (K = 0: plain
decoding, and the last token of a response) costs ``t_target_single``, which defaults to the line's
value ``t_target + verify_per_token``. Latency per token = sum of round costs / N.

Why a separate single-step cost: on a CPU one token runs through matrix-vector kernels
(memory-bound) and two or more through matrix-matrix kernels (compute-bound), so t_target(K) jumps
between K = 0 and K = 1. Measured on the 2-core dev machine with the reference pair: 0.57 s at
K = 0, 1.05 s at K = 1, 1.51 s at K = 2, 2.13 s at K = 4, 3.01 s at K = 16. A line through K = 0
would price plain decoding at the line's intercept and double every predicted speedup.

With ``verify_per_token = 0`` and ``predictor_per_step = 0`` this is SpecDec++ Eq. 5.1:

    latency / token = t_draft + t_draft * N_discarded / N + (t_target - t_draft) * N_target / N

(because N_draft = N - N_target + N_discarded when every round emits its accepted tokens plus one
target token). SpecDec++ assumes a verification pass costs the same for any number of tokens;
on compute-bound hardware (CPU, big batches) it does not, hence ``verify_per_token`` (the slope b
of t_target(K) = a + b * (K + 1), fitted by ``specstop calibrate-cost``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Seconds per model call.

    Attributes:
        t_draft: one draft forward step (one token), seconds.
        t_target: fixed cost of one target verification pass (the intercept a), seconds.
        verify_per_token: extra target cost per token in the verified block (the slope b).
        draft_per_token: draft cost per drafted token in the round formula; None = ``t_draft``.
        predictor_per_step: the stopping predictor's own cost per draft step.
        t_target_single: one single-token target step (plain decoding, K = 0 rounds); None = the
            line at K = 0 (``t_target + verify_per_token``).
        name: preset or file name, for reports.
        fit: calibration details when measured (R^2, raw fits, device); informational.
    """

    t_draft: float
    t_target: float
    verify_per_token: float = 0.0
    draft_per_token: float | None = None
    predictor_per_step: float = 0.0
    t_target_single: float | None = None
    name: str = "custom"
    fit: dict | None = None

    def __post_init__(self) -> None:
        for f in ("t_draft", "t_target", "verify_per_token", "predictor_per_step", "t_target_single"):
            if (getattr(self, f) or 0) < 0:
                raise ValueError(f"cost model {f} must be >= 0 seconds, got {getattr(self, f)}")

    @property
    def draft_step(self) -> float:
        return self.t_draft if self.draft_per_token is None else self.draft_per_token

    @property
    def per_round(self) -> float:
        """Fixed cost of a verification round (the line at K = 0; drafted tokens add ``per_drafted``)."""
        return self.t_target + self.verify_per_token

    @property
    def single_step(self) -> float:
        """Cost of a target-only step (K = 0)."""
        return self.per_round if self.t_target_single is None else self.t_target_single

    @property
    def per_drafted(self) -> float:
        """Marginal cost of one more drafted token in a round."""
        return self.draft_step + self.predictor_per_step + self.verify_per_token

    def total(self, rounds, drafted, target_only):
        """Total seconds for ``rounds`` target passes, ``target_only`` of which drafted nothing
        (priced at ``single_step``), and ``drafted`` draft tokens (arrays ok)."""
        rounds = np.asarray(rounds, dtype=np.float64)
        single = np.asarray(target_only, dtype=np.float64)
        return (
            (rounds - single) * self.per_round
            + single * self.single_step
            + np.asarray(drafted, dtype=np.float64) * self.per_drafted
        )

    def latency_per_token(self, rounds, drafted, n_tokens, target_only):
        """Seconds per emitted token (arrays broadcast)."""
        return self.total(rounds, drafted, target_only) / np.maximum(np.asarray(n_tokens, dtype=np.float64), 1.0)

    def round_cost(self, k: int) -> float:
        return self.single_step if k == 0 else self.per_round + k * self.per_drafted

    def eq51(self, n: float, n_target: float, n_discarded: float) -> float:
        """SpecDec++ Eq. 5.1 (exact for this model when verify_per_token = predictor_per_step = 0)."""
        return self.t_draft + self.t_draft * n_discarded / n + (self.t_target - self.t_draft) * n_target / n

    @property
    def target_only_per_token(self) -> float:
        """Latency per token of plain target decoding (every token a target-only step)."""
        return self.single_step

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown cost model keys {sorted(extra)}; valid keys: {sorted(known)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


# Presets. llama2-7b-70b: SpecDec++ section 5.2's measured llama-2-chat 7B / 70B step times (A100s);
# verification cost independent of block size, as in the paper.
# reference-cpu: the reference pair on the 2-core dev machine as first measured: 0.14 s per draft
# step and 0.39 s per single-token target step, with an ESTIMATED verification slope of 0.04 s per
# token. A later `specstop calibrate-cost` on the same machine measured 0.21 s per draft step, 0.57 s
# per single token and a verification pass far steeper than the estimate (1.05 s for 2 tokens,
# 3.0 s for 17): with those costs speculative decoding predicts (and measures) below 1x there. The
# preset is kept so quickstart reports stay comparable; for predictions that match measured
# decoding, calibrate on the machine that decodes (`cost_model: calibrate` in a pipeline).
PRESETS: dict[str, CostModel] = {
    "llama2-7b-70b": CostModel(t_draft=0.0234, t_target=0.112, name="llama2-7b-70b"),
    "reference-cpu": CostModel(t_draft=0.14, t_target=0.39, verify_per_token=0.04, name="reference-cpu"),
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
        d = json.loads(p.read_text())
        d.setdefault("name", p.name)
        return CostModel.from_dict(d)
    raise ValueError(
        f"unknown cost model {s!r}: give a preset ({', '.join(PRESETS)}) or a cost.json written by "
        "`specstop calibrate-cost`"
    )
