"""Whether a batch size speculates at all, decided from the engine's own steps as they run now.

A per-batch cap written at export says "speculate at B" where drafting paid for itself when the engine's
steps were timed. Those steps move: on a 2-core AMD EPYC (Zen 5) one calibration priced vLLM's K = 1 at
1.07x at batch size 8, and in later engine starts K = 1 ran 0.82-0.86x there (docs/results/vllm_serving.md).
A decoder that can skip the draft at a step (specstop's stop in vLLM's
runner, :mod:`specstop.decode.vllm_worker`) can time both choices where it serves: the gate keeps, per
batch size, the seconds per generated token of each choice, measured from one engine step to the next
with the same requests (the draft round, if any, and the target step after it, over the tokens each
request advanced). A choice's price is the seconds of its last :data:`WINDOW` rounds over the tokens they
advanced (a ratio of sums: one round's ratio swings with how many drafts it kept). Drafting, which the
export's caps chose, is kept unless skipping is measured at least :data:`MARGIN` cheaper; the choice not in
use is tried again every :data:`EXPLORE` rounds at that batch size, so a cost that moves is seen. Only
whether drafting happens changes, never what the target verifies: output stays lossless whatever the gate
decides.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

#: Rounds at one batch size between two tries of the choice that is not in use.
EXPLORE = 16
#: Rounds kept per batch size and choice (their seconds over their tokens price it).
WINDOW = 16
#: How much cheaper skipping must be measured before the gate leaves drafting (noise is not a reason).
MARGIN = 0.05


class SpeculationGate:
    """Per batch size: draft this step, or skip the draft.

    Args:
        explore: rounds at a batch size between two tries of the choice not in use.
        window: rounds per batch size and choice kept; their seconds over their tokens are the choice's price.
        margin: how much cheaper skipping must be measured before drafting stops.
        log: where each change of a batch size's choice is said (one line), or None.
    """

    def __init__(self, explore: int = EXPLORE, window: int = WINDOW, margin: float = MARGIN,
                 log: Callable[[str], None] | None = None):
        self.explore, self.window, self.margin, self.log = int(explore), int(window), float(margin), log
        self._seen: dict[int, dict[bool, deque]] = {}
        self._since: dict[int, int] = {}
        self._best: dict[int, bool] = {}
        self.rounds: dict[int, dict[bool, int]] = {}

    def _at(self, batch_size: int) -> dict[bool, deque]:
        return self._seen.setdefault(int(batch_size), {True: deque(maxlen=self.window),
                                                       False: deque(maxlen=self.window)})

    def price(self, batch_size: int, speculate: bool) -> float | None:
        """Seconds per generated token of a choice at ``batch_size`` over its last rounds (None: not measured)."""
        seen = self._at(batch_size)[bool(speculate)]
        return sum(s for s, _ in seen) / sum(t for _, t in seen) if seen else None

    def choose(self, batch_size: int) -> bool:
        """True: draft at this step; False: skip the draft. A choice not yet measured at this batch size is
        tried first (drafting before skipping); then drafting unless skipping is ``margin`` cheaper, the other
        choice every ``explore`` rounds."""
        b = int(batch_size)
        spec, skip = self.price(b, True), self.price(b, False)
        if spec is None or skip is None:
            choice = spec is None
        else:
            best = spec * (1.0 - self.margin) < skip
            if self._best.get(b) != best and self.log is not None:
                self.log(f"specstop: at batch size {b} drafting costs {1e3 * spec:.1f} ms per token against "
                         f"{1e3 * skip:.1f} without: {'drafting' if best else 'the draft is skipped'} at this batch "
                         f"size (the other is tried again every {self.explore} rounds)")
            self._best[b] = best
            self._since[b] = self._since.get(b, 0) + 1
            choice = best
            if self._since[b] >= self.explore:
                self._since[b], choice = 0, not best
        counts = self.rounds.setdefault(b, {True: 0, False: 0})
        counts[choice] += 1
        return choice

    def observe(self, batch_size: int, speculated: bool, seconds: float, tokens: float) -> None:
        """One round: ``seconds`` from one engine step to the next, over which a request advanced ``tokens``
        (the mean over the batch's requests)."""
        if seconds > 0 and tokens > 0 and np.isfinite(seconds):
            self._at(batch_size)[bool(speculated)].append((float(seconds), float(tokens)))

    def record(self) -> dict:
        """Per batch size: each choice's price (ms per token), rounds run with it and the choice in use."""
        out = {}
        for b in sorted(self._seen):
            spec, skip = self.price(b, True), self.price(b, False)
            rounds = self.rounds.get(b, {True: 0, False: 0})
            out[str(b)] = {"draft_ms_per_token": None if spec is None else round(1e3 * spec, 2),
                           "skip_ms_per_token": None if skip is None else round(1e3 * skip, 2),
                           "rounds_drafting": rounds[True], "rounds_skipping": rounds[False],
                           "drafting": self._best.get(b)}
        return out
