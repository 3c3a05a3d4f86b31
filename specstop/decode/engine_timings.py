"""What drafting and verifying cost inside a serving engine, as a proposer times them: :class:`EngineTimings`.

Both of specstop's proposers in vLLM (the side path, :mod:`specstop.decode.vllm_proposer`, and the stop in
vLLM's own draft runner, :mod:`specstop.decode.vllm_worker`) are called once per engine step, after the
target verified the drafts of the call before. So one call's seconds are what drafting cost, and the wall
time from one call's return to the next call is the target's step over the block each row verified
(its forward, sampling, rejection and the engine's scheduling). ``calibrate-cost --engine vllm`` turns
these into a cost model (:func:`specstop.measure.engine_cost.cost_model_from_engine`), and live re-pricing
reads the same pair of figures round by round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Call", "EngineTimings"]


class Call(NamedTuple):
    """One proposer call as timed.

    Attributes:
        rows: requests in the engine step.
        block: the tokens each row hands the target to verify next (its draft plus one), where every row
            drafted alike and decodes; else None.
        t_out: when the call returned (``specstop.clock`` seconds).
        seconds: the call's own seconds.
        longest: the longest draft of the call.
    """

    rows: int
    block: int | None
    t_out: float
    seconds: float
    longest: int


class EngineTimings:
    """Seconds per proposer call and per target step between calls, keyed by the rows and the block.

    Keys are ``"BxN"``: B rows, each with a draft of N tokens (``draft_call``) or each verifying a block of N
    tokens (``target_step``). A step counts only where every row decodes and every row drafted alike, so
    prefill chunks and mixed lengths price nothing.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []  # (rows, drafted tokens, seconds) of every call
        self.target: dict[str, list[float]] = {}
        self.call: dict[str, list[float]] = {}
        #: the last call (None before the first)
        self.last: Call | None = None

    def record(self, t_in: float, t_out: float, lengths: Sequence[int], decoding: bool,
               one_off: bool = False) -> float | None:
        """Record one call.

        Args:
            t_in: when the call began; ``t_out``: when it returned.
            lengths: ``[B]`` each row's draft length in this call.
            decoding: every row decodes in this step (none is in its prefill).
            one_off: the call also fed the draft what earlier calls left out (a catch-up): its seconds price no
                round of its length, while the target step after it still prices its block.

        Returns:
            The seconds of the target step before this call where it verified the last call's drafts in as
            many rows (the step a live re-pricer reads beside the last call's seconds), else None.
        """
        rows = len(lengths)
        target_s = None
        if self.last is not None and rows == self.last.rows and decoding:
            target_s = t_in - self.last.t_out
            if self.last.block is not None:
                self.target.setdefault(f"{rows}x{self.last.block}", []).append(target_s)
        blocks = {int(n) + 1 for n in lengths}
        block = blocks.pop() if len(blocks) == 1 and decoding else None
        seconds = t_out - t_in
        self.last = Call(rows, block, t_out, seconds, max((int(n) for n in lengths), default=0))
        self.calls.append((rows, int(sum(lengths)), seconds))
        if block is not None and not one_off:
            self.call.setdefault(f"{rows}x{block - 1}", []).append(seconds)
        return target_s

    def forget_last(self) -> None:
        """The next target step prices nothing (the engine changed under the proposer between two calls)."""
        self.last = None

    def costs(self) -> dict:
        """What drafting and verifying cost so far (medians, seconds).

        Returns:
            ``{"draft_per_token": {B: s}, "target_step": {"BxL": s}, "draft_call": {"BxK": s}, "halves": {...},
            "samples": {...}}``: seconds per drafted token at B rows; the wall time from one call to the next
            where all B rows verified L tokens; one call's seconds where each of B decoding rows drafted K
            tokens; each key's first and second half of samples apart (does a shape reproduce?); how many
            samples each figure has.
        """
        per_b: dict[int, list[float]] = {}
        for rows, drafted, seconds in self.calls:
            if drafted:
                per_b.setdefault(rows, []).append(seconds / drafted)
        return {"draft_per_token": {b: float(np.median(v)) for b, v in sorted(per_b.items())},
                "target_step": {k: float(np.median(v)) for k, v in sorted(self.target.items())},
                "draft_call": {k: float(np.median(v)) for k, v in sorted(self.call.items())},
                "halves": {part: {k: [float(np.median(v[: max(1, len(v) // 2)])), float(np.median(v[len(v) // 2:]))]
                                  for k, v in sorted(src.items())}
                           for part, src in (("target_step", self.target), ("draft_call", self.call))},
                "samples": {"draft": {b: len(v) for b, v in per_b.items()},
                            "target": {k: len(v) for k, v in self.target.items()},
                            "call": {k: len(v) for k, v in self.call.items()}}}

