"""Stopping policies as small per-round state machines (torch-free).

One implementation of every stopping rule, used by the exact replay (eval), the threshold tuner's
reference checks, the export runtime and the speculative decoder, so "what the tuner simulated"
and "what the decoder does" cannot differ. See docs/design.md for the round semantics.

A policy sees one :class:`StepFeatures` after each drafted token and answers "stop now?". The
caller enforces the hard caps (``sl_max``, the tokens remaining, EOS) via :meth:`RoundPolicy.cap`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specstop.errors import UserError

KINDS = ("static", "heuristic", "confidence", "predictor", "oracle", "pearl")
RULES = ("below", "cumprod")
READS = ("dist", "hidden")
THRESHOLD_SLACK = 1e-9
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
        # Specs come from flags, tuned-policy files and export config.json files users can edit:
        # check types and ranges here, once, for every consumer.
        if self.kind not in KINDS:
            raise UserError(f"unknown policy kind {self.kind!r}; choose from {KINDS}")
        if self.rule not in RULES:
            raise UserError(f"unknown predictor rule {self.rule!r}; choose from {RULES}")
        if self.reads not in READS:
            raise UserError(f"policy 'reads' must be one of {READS}, got {self.reads!r}")
        for name in ("k", "start", "sl_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(f"policy {name} must be an integer, got {value!r}")
        if self.kind == "static" and self.k < 1:
            raise UserError(f"static speculation length must be >= 1, got {self.k}")
        if self.kind == "heuristic" and self.start < 1:
            raise UserError(f"heuristic start length must be >= 1, got {self.start}")
        if self.sl_max < 1:
            raise UserError(f"sl_max must be >= 1, got {self.sl_max}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise UserError(f"policy threshold must be a finite number, got {t!r}")
        # SLACK: the tuner picks thresholds just outside the last breakpoint (np.nextafter), which
        # may sit a rounding step beyond 0 or 1 when a score is exactly 0 or 1.
        if not -THRESHOLD_SLACK <= t <= 1.0 + THRESHOLD_SLACK:
            sym = {"confidence": "tau (stop when top-1 < tau)", "predictor": "tau (stop when score < tau)"}.get(self.kind, "")
            sym = "h (stop when 1 - prod(scores) > h)" if self.kind == "predictor" and self.rule == "cumprod" else sym
            raise UserError(f"policy threshold {sym} must be in [0, 1], got {t!r}")
        if self.gamma is not None and (isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1):
            raise UserError(f"PEARL window gamma must be an integer >= 1, got {self.gamma!r}")
        if self.family is not None and not isinstance(self.family, str):
            raise UserError(f"policy family must be a string, got {self.family!r}")
        if not isinstance(self.extra, dict):
            raise UserError(f"policy extra must be a mapping, got {self.extra!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicySpec:
        if not isinstance(d, dict):
            raise UserError(f"a policy spec must be a mapping of keys to values, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"unknown policy keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**d)

    @property
    def label(self) -> str:
        """A short human name, e.g. ``static:4`` or ``disco_ffn(tau=0.31,max=12)``."""
        if self.kind == "static":
            return f"static:{self.k}"
        if self.kind == "heuristic":
            return f"heuristic(start={self.start})"
        if self.kind == "confidence":
            if self.rule == "cumprod":
                return f"confidence-cumprod(h={self.threshold:.4g},max={self.sl_max})"
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


#: Every form a chain stopping policy is given in, as the messages name them.
CHAIN_POLICY_FORMS = ("static:K, heuristic[:START], confidence[:TAU], an export folder or a hub id OWNER/NAME "
                      "(an export pushed to the Hub)")
#: Policy texts that name another decoder, not a stopping policy.
OTHER_DECODER_FORMS = {"mcsd": "token-tree policy", "tree": "token-tree policy", "pearl": "parallel (PEARL) policy"}


def parse_policy_string(text: str) -> PolicySpec:
    """Parse the CLI forms ``static:4``, ``heuristic``, ``heuristic:3``, ``confidence:0.4``.

    Raises:
        UserError: an unknown form, a non-numeric argument or one out of range
            (``static:K`` K >= 1, ``heuristic:S`` S >= 1, ``confidence:T`` 0 < T <= 1).
    """
    name, _, arg = str(text).partition(":")
    forms = {"static": ("K", int, 5), "heuristic": ("START", int, 5), "confidence": ("TAU", float, 0.4)}
    if name in OTHER_DECODER_FORMS:
        raise UserError(f"{text!r} is a {OTHER_DECODER_FORMS[name]}, which runs its own decoder (specstop decode "
                        f"--policy {text}); a stopping policy is needed here: {CHAIN_POLICY_FORMS}")
    if name not in forms:
        raise UserError(f"unknown policy {text!r}: use {CHAIN_POLICY_FORMS}")
    what, typ, default = forms[name]
    try:
        value = typ(arg) if arg.strip() else default
    except ValueError:
        raise UserError(f"policy {text!r}: {what} must be {'an integer' if typ is int else 'a number'}, got {arg!r}") from None
    if name == "confidence" and not (math.isfinite(value) and 0.0 < value <= 1.0):
        # 0 would never stop (a static policy in disguise); above 1 would always stop.
        raise UserError(f"policy {text!r}: confidence:TAU needs 0 < TAU <= 1 (the draft's top-1 probability), got {arg}")
    try:
        if name == "static":
            return PolicySpec(kind="static", k=value)
        if name == "heuristic":
            return PolicySpec(kind="heuristic", start=value)
        return PolicySpec(kind="confidence", threshold=value)
    except UserError as err:
        raise UserError(f"policy {text!r}: {err}") from None


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
        """Whether the round ends after this step's token: the cap reached, or the rule fired."""
        return step.j >= self.cap() or self.rule_fires(step)

    def rule_fires(self, step: StepFeatures) -> bool:
        """Whether the rule itself (not the cap) stops at this step's token (cumulative rules fold the step in)."""
        s = self.spec
        if s.kind in ("static", "heuristic"):
            return False
        if s.kind == "confidence":
            if s.rule == "cumprod":  # cumulative confidence: stop when 1 - prod(top1) > h
                self._cum *= step.top1
                return 1.0 - self._cum > s.threshold
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

