"""Stopping policies as small per-round state machines (torch-free).

One implementation of every stopping rule, used by the exact replay (eval), the threshold tuner's
reference checks, the export runtime and the speculative decoder, so "what the tuner simulated"
and "what the decoder does" cannot differ. See docs/design.md for the round semantics.

A policy sees one :class:`StepFeatures` after each drafted token and answers "stop now?". The
caller enforces the hard caps (``sl_max``, the tokens remaining, EOS) via :meth:`RoundPolicy.cap`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

KINDS = ("static", "heuristic", "confidence", "predictor", "oracle", "pearl")
RULES = ("below", "cumprod")
DEFAULT_SL_MAX = 20


@dataclass(frozen=True)
class StepFeatures:
    """What a policy may read after drafting token ``j`` of a round.

    Attributes:
        j: 1-based index of the drafted token within the round.
        position: 0-based response position of that token.
        top1: largest probability of the distribution the token was drawn from.
        score: the predictor's acceptance probability for this step, when the policy has one:
            for ``dist`` predictors the score of token j's own features; for ``hidden``
            predictors the score of token j-1's hidden state (None at j = 1).
    """

    j: int
    position: int
    top1: float = 1.0
    score: float | None = None


@dataclass(frozen=True)
class PolicySpec:
    """A stopping policy, serialisable to JSON (tuned-policy files and exports hold these).

    Attributes:
        kind: one of ``KINDS``.
        k: static speculation length.
        start: initial length of the heuristic schedule.
        threshold: tau (confidence, DISCO), beta (MCSD) or h (SpecDec++).
        sl_max: hard cap on drafted tokens per round.
        rule: for predictors, ``below`` (stop when score < threshold) or ``cumprod`` (stop when
            1 - prod(scores) > threshold, SpecDec++).
        family: predictor family name (registry) for ``predictor`` policies.
        reads: ``dist`` (features of token j) or ``hidden`` (hidden state of token j-1).
        gamma: PEARL window.
    """

    kind: str
    k: int = 5
    start: int = 5
    threshold: float = 0.5
    sl_max: int = DEFAULT_SL_MAX
    rule: str = "below"
    family: str | None = None
    reads: str = "dist"
    gamma: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}; choose from {KINDS}")
        if self.rule not in RULES:
            raise ValueError(f"unknown predictor rule {self.rule!r}; choose from {RULES}")
        if self.kind == "static" and self.k < 1:
            raise ValueError(f"static speculation length must be >= 1, got {self.k}")
        if self.sl_max < 1:
            raise ValueError(f"sl_max must be >= 1, got {self.sl_max}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicySpec:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown policy keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**d)

    @property
    def label(self) -> str:
        """A short human name, e.g. ``static:4`` or ``disco_ffn(tau=0.31,max=12)``."""
        if self.kind == "static":
            return f"static:{self.k}"
        if self.kind == "heuristic":
            return f"heuristic(start={self.start})"
        if self.kind == "confidence":
            return f"confidence:{self.threshold:g}"
        if self.kind == "predictor":
            sym = "h" if self.rule == "cumprod" else "tau"
            return f"{self.family}({sym}={self.threshold:.4g},max={self.sl_max})"
        return self.kind

    @property
    def cap(self) -> int:
        """Largest number of tokens a round of this policy may draft (before the remaining-tokens cap)."""
        if self.kind == "static":
            return self.k
        return self.sl_max


def parse_policy_string(text: str) -> PolicySpec:
    """Parse the CLI forms ``static:4``, ``heuristic``, ``heuristic:3``, ``confidence:0.4``."""
    name, _, arg = text.partition(":")
    if name == "static":
        return PolicySpec(kind="static", k=int(arg or 5))
    if name == "heuristic":
        return PolicySpec(kind="heuristic", start=int(arg or 5))
    if name == "confidence":
        return PolicySpec(kind="confidence", threshold=float(arg or 0.4))
    raise ValueError(
        f"unknown policy {text!r}: use static:K, heuristic[:START], confidence[:TAU] or an export folder"
    )


class RoundPolicy:
    """Per-round state machine. Call :meth:`reset` at the start of each round, :meth:`should_stop`
    after each drafted token, :meth:`end_round` after verification."""

    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
        self.schedule = spec.start  # heuristic's current length
        self._cum = 1.0

    def cap(self) -> int:
        """The policy's own cap for the coming round."""
        if self.spec.kind == "heuristic":
            return max(1, min(self.schedule, self.spec.sl_max))
        return self.spec.cap

    def reset(self) -> None:
        self._cum = 1.0

    @property
    def cumulative_acceptance(self) -> float:
        """SpecDec++'s running prod of predicted acceptances in this round."""
        return self._cum

    def should_stop(self, step: StepFeatures) -> bool:
        s = self.spec
        if step.j >= self.cap():
            return True
        if s.kind in ("static", "heuristic"):
            return False
        if s.kind == "confidence":
            return step.top1 < s.threshold
        if s.kind == "predictor":
            if step.score is None:  # hidden-state predictors have no score for token 1
                return False
            if s.rule == "cumprod":
                self._cum *= step.score
                return 1.0 - self._cum > s.threshold
            return step.score < s.threshold
        raise ValueError(f"policy kind {s.kind!r} cannot run step by step (replay-only baseline)")

    def end_round(self, num_drafted: int, num_accepted: int) -> None:
        if self.spec.kind == "heuristic":
            if num_drafted > 0 and num_accepted == num_drafted:
                self.schedule += 2
            else:
                self.schedule = max(1, self.schedule - 1)


def make_round_policy(spec: PolicySpec) -> RoundPolicy:
    return RoundPolicy(spec)

