"""The ``pearl`` / ``pearl:GAMMA`` policy text and the CPU core split between the two PEARL workers."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specstop.errors import UserError

if TYPE_CHECKING:
    from specstop.policy import PolicySpec

__all__ = ["PearlSpec", "available_cores", "parse_pearl_policy", "split_cores"]

_FORMS = "pearl (window from the cost model or a quick measurement) or pearl:GAMMA (e.g. pearl:4)"
MAX_GAMMA = 64  # one target pass verifies gamma + 1 tokens; beyond this it is no longer "one step"


@dataclass(frozen=True)
class PearlSpec:
    """A PEARL run: window ``gamma`` (None: derive it from timings), the two strategies and an optional
    stopping policy that ends windows early.

    Attributes:
        gamma: drafted tokens per window; None means round(t_target / t_draft), PEARL's Theorem 1.
        pre_verify: the target checks the first draft token while the draft drafts the rest.
        post_verify: the draft drafts the next window while the target verifies the current one.
        stop: a stopping policy asked after every drafted token of a window (None: every window drafts
            its whole budget): a policy string (``confidence:0.6``, ``static:3``), an export folder, or
            a :class:`~specstop.policy.PolicySpec` of a rule policy (e.g. a tuned ``confidence_opt``).
            It only shortens windows, never changes acceptance, so decoding stays lossless. It is
            loaded in the draft's worker (text and specs cross the process boundary, not modules).
    """

    gamma: int | None = None
    pre_verify: bool = True
    post_verify: bool = True
    stop: str | PolicySpec | None = None

    def with_gamma(self, gamma: int) -> PearlSpec:
        return replace(self, gamma=int(gamma))

    def with_stop(self, stop) -> PearlSpec:
        return replace(self, stop=stop)

    @property
    def stop_label(self) -> str | None:
        """The stopping policy's short name (a spec's label, else the text as given)."""
        if self.stop is None:
            return None
        return getattr(self.stop, "label", None) or str(self.stop)

    @property
    def label(self) -> str:
        text = "pearl" if self.gamma is None else f"pearl:{self.gamma}"
        if self.stop is not None:
            text += f"+{self.stop_label}"
        if not self.pre_verify:
            text += " no-pre-verify"
        if not self.post_verify:
            text += " no-post-verify"
        return text


def parse_pearl_policy(text: str) -> PearlSpec | None:
    """Parse ``pearl`` / ``pearl:GAMMA``; None for any other policy text.

    Raises:
        UserError: a malformed spec, in one line naming the fix.
    """
    name, sep, arg = str(text).strip().partition(":")
    if name != "pearl":
        return None
    if not sep:
        return PearlSpec()
    try:
        gamma = int(arg.strip())
    except ValueError:
        raise UserError(f"policy {text!r}: GAMMA must be a whole number, got {arg!r}; use {_FORMS}") from None
    if not 1 <= gamma <= MAX_GAMMA:
        raise UserError(f"policy {text!r}: GAMMA must be between 1 and {MAX_GAMMA}, got {gamma}; use {_FORMS}")
    return PearlSpec(gamma)


def available_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity mask), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return list(range(os.cpu_count() or 1))


def split_cores(text: str | None, cores: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Disjoint core lists ``(draft, target)`` for the two workers.

    Args:
        text: ``"D,T"`` (D cores for the draft, T for the target) or None for the default: a quarter
            of the cores (at least one) for the draft, the rest for the target - the target does
            most of the work per token.
        cores: the cores to split (default: this process's affinity mask).

    Raises:
        UserError: fewer than two cores, or a split that is malformed or asks for too many cores.
    """
    cores = list(cores) if cores is not None else available_cores()
    if len(cores) < 2:
        raise UserError(
            f"PEARL runs the draft and the target side by side and needs 2+ CPU cores, this process may use "
            f"{len(cores)}; give it more cores (taskset) or use a chain policy such as static:4"
        )
    if text is None:
        d = max(1, len(cores) // 4)
        return cores[:d], cores[d:]
    parts = str(text).split(",")
    try:
        d, t = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"--pearl-cores {text!r}: expected D,T (draft cores, target cores), e.g. 1,1") from None
    if d < 1 or t < 1:
        raise UserError(f"--pearl-cores {text!r}: each model needs at least one core")
    if d + t > len(cores):
        raise UserError(
            f"--pearl-cores {text!r} asks for {d + t} cores but this process may use {len(cores)}; lower D or T"
        )
    return cores[:d], cores[d : d + t]
