"""Latency cost models for speculative decoding (SpecDec++ Eq. 5.1 and a verify-size-aware form).

Round cost (one draft-then-verify round drafting K tokens):

    cost(K) = K * (draft_step + predictor_per_step) + t_target + verify_per_token * (K + 1)

where ``draft_step = draft_per_token`` (defaults to ``t_draft``). A target-only round (K = 0)
costs ``t_target + verify_per_token``. Latency per token = sum of round costs / N.

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
        name: preset or file name, for reports.
        fit: calibration details when measured (R^2, raw fits, device); informational.
    """

    t_draft: float
    t_target: float
    verify_per_token: float = 0.0
    draft_per_token: float | None = None
    predictor_per_step: float = 0.0
    name: str = "custom"
    fit: dict | None = None

    def __post_init__(self) -> None:
        for f in ("t_draft", "t_target", "verify_per_token", "predictor_per_step"):
            if getattr(self, f) < 0:
                raise ValueError(f"cost model {f} must be >= 0 seconds, got {getattr(self, f)}")

    @property
    def draft_step(self) -> float:
        return self.t_draft if self.draft_per_token is None else self.draft_per_token

    @property
    def per_round(self) -> float:
        """Cost of a round that drafts nothing (a target-only step)."""
        return self.t_target + self.verify_per_token

    @property
    def per_drafted(self) -> float:
        """Marginal cost of one more drafted token in a round."""
        return self.draft_step + self.predictor_per_step + self.verify_per_token

    def total(self, rounds, drafted):
        """Total seconds for ``rounds`` verification passes and ``drafted`` draft tokens (arrays ok)."""
        return (
            np.asarray(rounds, dtype=np.float64) * self.per_round
            + np.asarray(drafted, dtype=np.float64) * self.per_drafted
        )

    def latency_per_token(self, rounds, drafted, n_tokens):
        """Seconds per emitted token (arrays broadcast)."""
        return self.total(rounds, drafted) / np.maximum(np.asarray(n_tokens, dtype=np.float64), 1.0)

    def round_cost(self, k: int) -> float:
        return self.per_round + k * self.per_drafted

    def eq51(self, n: float, n_target: float, n_discarded: float) -> float:
        """SpecDec++ Eq. 5.1 (exact for this model when verify_per_token = predictor_per_step = 0)."""
        return self.t_draft + self.t_draft * n_discarded / n + (self.t_target - self.t_draft) * n_target / n

    @property
    def target_only_per_token(self) -> float:
        """Latency per token of plain target decoding (every token a target-only step)."""
        return self.per_round

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
# reference-cpu: the reference pair on the 2-core dev machine: 0.14 s per draft step and 0.39 s per
# single-token target step (measured). The per-token verification slope 0.04 s is an ESTIMATE
# (about 10% of a one-token pass per extra verified token, typical of compute-bound CPU matmuls:
# it explains why HF assisted generation ran at 0.99x / 0.77x of the target alone there). Run
# `specstop calibrate-cost` to replace it with a fitted value.
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
