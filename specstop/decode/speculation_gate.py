"""Whether a batch size speculates at all, decided from the engine's own steps as they run now.

A per-batch cap written at export says "speculate at B" where drafting paid for itself when the engine's
steps were timed. Those steps move: on a 2-core AMD EPYC (Zen 5) one calibration priced vLLM's K = 1 at
1.07x at batch size 8, and in later engine starts K = 1 ran 0.82-0.86x there (docs/results/vllm_serving.md).
A decoder that can skip the draft at a step (specstop's stop in vLLM's
runner, :mod:`specstop.decode.vllm_worker`) can time both choices where it serves: the gate keeps, per
batch size, the seconds per generated token of each choice, measured from one engine step to the next
with the same requests (the draft round, if any, and the target step after it, over the tokens each
request advanced). A choice's price is the seconds of its last :data:`WINDOW` rounds over the tokens they
advanced (a ratio of sums: one round's ratio swings with how many drafts it kept), for the request they
advanced slowest. Requests that draft finish apart, and a batch ends with its last one: on a 2-core Intel Xeon
(AMX) at batch size 8, full-batch drafting steps cost 142 ms per token for the mean request against 171 ms
without drafting, yet the decode phase ran 0.96x of no drafting, its slowest requests finishing in a tail of
few-row steps (docs/results/vllm_serving.md). Skipping advances every request alike: there both prices agree.
Drafting, which the
export's caps chose, is kept until :data:`MIN_ROUNDS` rounds price it (one round that drafted 16 tokens and
kept one costs 130 ms per token where drafting averages 45), and then unless skipping is measured at least
:data:`MARGIN` cheaper; the choice not in use is tried again after :data:`EXPLORE` rounds at that batch size,
so a cost that moves is seen, and after twice as many each time a try left the choice as it was (up to
:data:`BACKOFF` doublings): a try costs what the dearer choice costs more, about 3% of the rounds at batch
size 1 were it every 16 rounds there. Only
whether drafting happens changes, never what the target verifies: output stays lossless whatever the gate
decides.

Drafting also has a one-off cost that a round's price leaves out: before a request's first draft, the draft
reads its prompt (its prefill), and after skipped steps it reads the tokens they left out (the catch-up).
On the same CPU that cost is what drafting lost at batch size 8 end to end (0.91x of no speculation, decode
phase 1.02x): eight prompts through the draft, paid back over 48 tokens by a round 2% cheaper. So the gate
also prices a token fed to the draft (:meth:`SpeculationGate.observe_first_pass`: the slope of the draft's
first-pass seconds over the tokens it fed), and a step that would first feed the draft ``one_off`` tokens
drafts only where the round's saving over the tokens its requests have left pays for them
(:meth:`SpeculationGate.choose`). That rule reads drafting's price at the batch size once :data:`MIN_ROUNDS`
rounds made it (a batch's last requests, alone near their end, price drafting dear over a round or two); before,
the saving share the other batch sizes' prices trace to it along the logarithm of the batch size (between the
nearest priced below and above; past them, on the line through the two nearest). And it reads drafting's last
price, which only drafting renews: so a try of drafting goes ahead wherever its feed costs at most
:data:`TRY_FEED_SHARE` of the rounds since the last try, and prices drafting afresh (its old rounds dropped),
so one dear price cannot hold drafting off for good.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

#: Rounds at one batch size between two tries of the choice that is not in use (before any back-off).
EXPLORE = 16
#: How many times the rounds between two tries may double while the tries leave the choice as it was.
BACKOFF = 3
#: Rounds kept per batch size and choice (their seconds over their tokens price it).
WINDOW = 16
#: How much cheaper skipping must be measured before the gate leaves drafting (noise is not a reason).
MARGIN = 0.05
#: Rounds that must price drafting before the gate may leave it (a round or two is noise).
MIN_ROUNDS = 4
#: The most a try of drafting may spend feeding the draft, as a share of the rounds since the last try (at the
#: price of skipping): a try of drafting renews its price, which the one-off rule reads. A quarter lets a
#: 200-token prompt through at batch size 1 (16 rounds of 55-80 ms) and holds 8 prompts at batch size 8.
TRY_FEED_SHARE = 0.25
#: First passes kept to price a token fed to the draft: decode-sized ones, and ones that fed a prefill or a
#: catch-up (kept apart, so that the few large ones stay in the price among many small ones).
PASSES = 64
LARGE_PASSES = 16


@dataclass
class Step:
    """One engine step as a runner that can skip its draft sees it, at its draft round."""

    began: float  # when its draft round began (seconds, one clock for every step)
    req_ids: list[str]
    first: np.ndarray  # [B] each row's first position the target ran this step
    cap: int  # the longest draft the step allows
    drafted: bool = False
    fed_once: bool = False  # its draft's first pass also fed prompts, or tokens that skipped steps left out
    room: np.ndarray | None = None  # [B] the most tokens each row may still advance (its max_tokens less its own)


class SpeculationGate:
    """Per batch size: draft this step, or skip the draft.

    Args:
        explore: rounds at a batch size between two tries of the choice not in use.
        window: rounds per batch size and choice kept; their seconds over their tokens are the choice's price.
        margin: how much cheaper skipping must be measured before drafting stops.
        min_rounds: rounds that must price drafting at a batch size before the gate may leave it there.
        backoff: how many times the rounds between two tries may double while tries leave the choice as it was.
        log: where each change of a batch size's choice is said (one line), or None.
    """

    def __init__(self, explore: int = EXPLORE, window: int = WINDOW, margin: float = MARGIN,
                 min_rounds: int = MIN_ROUNDS, backoff: int = BACKOFF, log: Callable[[str], None] | None = None):
        self.explore, self.window, self.margin, self.log = int(explore), int(window), float(margin), log
        self.min_rounds = max(1, min(int(min_rounds), self.window))
        self.backoff = max(0, int(backoff))
        self._tries: dict[int, int] = {}  # per batch size: tries since the choice last changed
        self._seen: dict[int, dict[bool, deque]] = {}
        self._since: dict[int, int] = {}
        self._best: dict[int, bool] = {}
        self._held: dict[int, bool] = {}
        #: per batch size: rounds drafting (True), skipping (False), and of those skipping, held by the one-off cost ("held")
        self.rounds: dict[int, dict[bool | str, int]] = {}
        self._passes: dict[bool, deque] = {False: deque(maxlen=PASSES), True: deque(maxlen=LARGE_PASSES)}
        self._steps: list[Step] = []  # the last two engine steps

    def _at(self, batch_size: int) -> dict[bool, deque]:
        return self._seen.setdefault(int(batch_size), {True: deque(maxlen=self.window),
                                                       False: deque(maxlen=self.window)})

    def price(self, batch_size: int, speculate: bool, slowest: bool = True) -> float | None:
        """Seconds per generated token of a choice at ``batch_size`` over its last rounds (None: not measured).

        Args:
            slowest: the price of the request the rounds advanced slowest (its rounds' seconds over the tokens it
                advanced in them; only requests in ``min_rounds`` of the rounds, or in all of them while there are
                fewer): the one a batch's finish waits for. A round where a request's room ended its draft
                (:meth:`observe`'s ``ending``) does not price that request: it advanced less because it is
                finishing, not because it is slow. False: the mean request's (all rounds' seconds over the mean
                tokens a request advanced in them).
        """
        seen = self._at(batch_size)[bool(speculate)]
        if not seen:
            return None
        prices = []
        if slowest:
            seconds, tokens, rounds = defaultdict(float), defaultdict(float), defaultdict(int)
            for s, advanced, ending in seen:
                for rid, t in advanced.items():
                    if rid not in ending:
                        seconds[rid] += s
                        tokens[rid] += t
                        rounds[rid] += 1
            enough = min(self.min_rounds, len(seen))
            prices = [seconds[r] / tokens[r] for r in seconds if rounds[r] >= enough]
        if prices:
            return max(prices)
        return sum(s for s, _, _ in seen) / sum(sum(adv.values()) / len(adv) for _, adv, _ in seen)

    def choose(self, batch_size: int, one_off: int = 0, tokens_left: float = math.inf) -> bool:
        """True: draft at this step; False: skip the draft. A choice not yet measured at this batch size is
        tried first (drafting before skipping); then drafting until ``min_rounds`` rounds price it, and unless
        skipping is ``margin`` cheaper, the other choice after ``explore`` rounds (doubled after each try that
        left the choice as it was, ``backoff`` times at most). Drafting that would first feed the draft
        ``one_off`` tokens (prompts, skipped tokens) is chosen only where skipping's extra seconds over
        ``tokens_left`` exceed theirs, at this batch size's prices once ``min_rounds`` rounds priced drafting
        here, else at the saving the batch sizes that have them trace to this one (no hold where none has). A try
        of drafting also goes ahead where the feed costs at most :data:`TRY_FEED_SHARE` of the rounds since the
        last try (a held try is tried again at the next step), and it prices drafting afresh: its last rounds are
        dropped, so ``min_rounds`` new rounds price it again.

        Args:
            batch_size: requests in the step.
            one_off: tokens the draft would read before it drafts, beyond the step's own decode tokens.
            tokens_left: tokens the step's requests have left, the most any of them has (their ``max_tokens``:
                an end of sequence may come sooner): the batch finishes with that request.
        """
        b = int(batch_size)
        counts = self.rounds.setdefault(b, {True: 0, False: 0, "held": 0})
        spec, skip = self.price(b, True), self.price(b, False)
        if spec is None or skip is None:
            choice = spec is None
            if choice:
                choice = self._pays_back_near(b, one_off, tokens_left)
        else:
            mature = len(self._at(b)[True]) >= self.min_rounds
            best = spec * (1.0 - self.margin) < skip or not mature
            if self._best.get(b) != best and self.log is not None:
                self.log(f"specstop: at batch size {b} drafting costs {1e3 * spec:.1f} ms per token against "
                         f"{1e3 * skip:.1f} without: {'drafting' if best else 'the draft is skipped'} at this batch "
                         f"size (the other is tried again after {self.explore} rounds)")
            if self._best.get(b) != best:
                self._tries[b] = 0
            self._best[b] = best
            self._since[b] = self._since.get(b, 0) + 1
            wait = self.explore << min(self._tries.get(b, 0), self.backoff)
            trying = self._since[b] >= wait
            choice = best != trying
            if choice and not mature:
                choice = self._pays_back_near(b, one_off, tokens_left)
            elif choice:
                choice = self._pays_back(b, spec, skip, one_off, tokens_left,
                                         budget=TRY_FEED_SHARE * wait * skip if trying else 0.0)
            if trying and choice != best:  # a try ran (a held try of drafting waits for the next step)
                self._since[b] = 0
                self._tries[b] = self._tries.get(b, 0) + 1
                if choice:
                    self._at(b)[True].clear()
        counts[choice] += 1
        return choice

    def _pays_back_near(self, b: int, one_off: int, tokens_left: float) -> bool:
        """:meth:`_pays_back` at ``b`` on the other batch sizes' prices (True where none has them): drafting's
        saving as a share of skipping's price read off them at ``b`` (:meth:`_saving_share_at`), on ``b``'s own
        price of skipping where it has one, else the nearest priced batch size's."""
        priced = [n for n in self._seen if n != b and len(self._at(n)[True]) >= self.min_rounds
                  and self.price(n, False) is not None]
        if not priced:
            return True
        skip = self.price(b, False)
        if skip is None:
            skip = self.price(min(priced, key=lambda n: (abs(math.log(n / b)), -n)), False)
        return self._pays_back(b, skip * (1.0 - self._saving_share_at(b, priced)), skip, one_off, tokens_left)

    def _saving_share(self, b: int) -> float:
        """Drafting's saving at ``b`` as a share of skipping's price: 1 - drafting's price / skipping's."""
        return 1.0 - self.price(b, True) / self.price(b, False)

    def _saving_share_at(self, b: int, priced: list[int]) -> float:
        """Drafting's saving share at ``b``, read off the batch sizes ``priced`` along the logarithm of the batch
        size: between the nearest priced below and above ``b``; past them all, on the line through the two nearest
        (one alone: its share). Why a line: what drafting saves falls as a batch grows, and one neighbour's price
        carries to ``b`` in neither direction (on a 2-core Intel Xeon, batch size 4 borrowing batch size 8's held
        drafting off where it paid, and batch size 8 borrowing batch size 4's fed prompts it never paid back:
        docs/results/vllm_serving.md). A line never promises more than the most any batch size saved."""
        share_of = {n: self._saving_share(n) for n in priced}  # each price read once
        below = sorted(n for n in priced if n < b)
        above = sorted(n for n in priced if n > b)
        ends = [below[-1], above[0]] if below and above else below[-2:] if below else above[:2]
        if len(ends) == 1:
            return share_of[ends[0]]
        (x0, y0), (x1, y1) = ((math.log(n), share_of[n]) for n in ends)
        return min(y0 + (y1 - y0) * (math.log(b) - x0) / (x1 - x0), max(share_of.values()))

    def _pays_back(self, b: int, spec: float, skip: float, one_off: int, tokens_left: float,
                   budget: float = 0.0) -> bool:
        """Whether drafting at ``b`` saves, over ``tokens_left`` tokens, more than feeding the draft ``one_off``
        tokens first costs, or that cost is within ``budget`` seconds (a try of drafting); True where that cost
        is not priced yet; a change is said once."""
        per_token = self.feed_price()
        if one_off <= 0 or per_token is None:
            return True
        cost, saved = per_token * one_off, (skip - spec) * tokens_left
        held = saved <= cost and cost > budget
        if held:
            self.rounds[b]["held"] += 1
        if self._held.get(b) != held and self.log is not None and held:
            self.log(f"specstop: at batch size {b} drafting would first feed the draft {one_off} tokens "
                     f"({cost:.2f} s) and save {max(saved, 0.0):.2f} s over the {tokens_left:.0f} tokens its longest "
                     "request has left: the draft is skipped until that pays")
        self._held[b] = held
        return not held

    def open(self, step: Step) -> bool:
        """A new engine step, before its choice: prices the step two back, and says whether the step before
        fed the draft prompts or skipped tokens (then this one drafts: that was paid for drafting, and drafting
        gets a price of its own).

        A step's choice is priced once the target has verified its drafts, two steps on: the time from its draft
        round to the next one's covers its round and the target step that verified it, and the tokens that target
        step advanced each request show as the following step's first positions less the next one's (the next
        step's own advance verified the drafts of the step before). A step whose draft also read prompts or
        skipped tokens prices nothing: that one-off cost is priced per token fed (:meth:`feed_price`).
        """
        if len(self._steps) == 2 and all(s.req_ids == step.req_ids for s in self._steps):
            priced, after = self._steps
            advanced = step.first - after.first
            if (not priced.fed_once and len(advanced) and advanced.min() >= 1
                    and advanced.max() <= (priced.cap + 1 if priced.drafted else 1)):
                ending = () if priced.room is None or not priced.drafted else \
                    [rid for rid, room in zip(step.req_ids, priced.room.tolist()) if room < priced.cap + 1]
                self.observe(len(step.req_ids), priced.drafted, after.began - priced.began,
                             dict(zip(step.req_ids, advanced.tolist())), ending=ending)
        last = self._steps[-1] if self._steps else None
        self._steps = [*self._steps[-1:], step]
        return last is not None and last.req_ids == step.req_ids and last.fed_once

    def observe(self, batch_size: int, speculated: bool, seconds: float, tokens: float | dict[str, float],
                ending: Iterable[str] = ()) -> None:
        """One round: ``seconds`` from one engine step to the next, over which each request advanced ``tokens``
        (per request id; one number: every request advanced that many). ``ending``: the requests whose room (their
        ``max_tokens`` less the tokens they had) was less than the round's longest draft and its bonus token: their
        advance was cut by their end, so it does not price them as the slowest (:meth:`price`)."""
        advanced = tokens if isinstance(tokens, dict) else {"": tokens}
        if seconds > 0 and np.isfinite(seconds) and advanced and min(advanced.values()) > 0:
            self._at(batch_size)[bool(speculated)].append(
                (float(seconds), {rid: float(t) for rid, t in advanced.items()}, frozenset(ending)))

    def observe_first_pass(self, tokens: int, seconds: float, large: bool) -> None:
        """The draft's first pass of a step: ``tokens`` fed (a prefill or catch-up when ``large``) in
        ``seconds``."""
        if tokens > 0 and seconds > 0 and np.isfinite(seconds):
            self._passes[bool(large)].append((float(tokens), float(seconds)))

    def feed_price(self) -> float | None:
        """Seconds per token fed to the draft: the least-squares slope of first-pass seconds over tokens fed
        (None until a large pass and a decode-sized one are both seen, or where the slope is not positive)."""
        if not self._passes[True] or not self._passes[False]:
            return None
        n, t = np.array([*self._passes[False], *self._passes[True]]).T
        spread = float(((n - n.mean()) ** 2).sum())
        slope = float(((n - n.mean()) * (t - t.mean())).sum()) / spread if spread > 0 else 0.0
        return slope if slope > 0 else None

    def record(self) -> dict:
        """``by_batch``: per batch size, each choice's price (ms per token of the slowest request; drafting's for
        the mean request too), rounds run with it, rounds where
        drafting was held back by its one-off cost, and the choice in use; ``feed_ms_per_token``: the price of a
        token fed to the draft."""
        out = {}
        for b in sorted(self._seen):
            spec, skip = self.price(b, True), self.price(b, False)
            rounds = self.rounds.get(b, {True: 0, False: 0, "held": 0})
            row = self.price(b, True, slowest=False)
            out[str(b)] = {"draft_ms_per_token": None if spec is None else round(1e3 * spec, 2),
                           "draft_ms_per_token_mean_request": None if row is None else round(1e3 * row, 2),
                           "skip_ms_per_token": None if skip is None else round(1e3 * skip, 2),
                           "rounds_drafting": rounds[True], "rounds_skipping": rounds[False],
                           "rounds_held": rounds["held"], "drafting": self._best.get(b)}
        feed = self.feed_price()
        return {"by_batch": out, "feed_ms_per_token": None if feed is None else round(1e3 * feed, 3)}
