"""The speculation gate (specstop.decode.speculation_gate): per batch size, drafting unless skipping the draft is
measured cheaper by its margin, the other choice tried again after ``explore`` rounds (backing off while tries
leave the choice as it was), each change said once."""

from __future__ import annotations

import numpy as np
import pytest

from specstop.decode.speculation_gate import SpeculationGate, Step


def _run(gate: SpeculationGate, batch_size: int, rounds: int, price) -> list[bool]:
    """``rounds`` decisions at ``batch_size``, each followed by its observed price ``price(drafted)``."""
    out = []
    for _ in range(rounds):
        choice = gate.choose(batch_size)
        gate.observe(batch_size, choice, price(choice), 1.0)
        out.append(choice)
    return out


def test_each_batch_size_runs_the_cheaper_choice_and_retries_the_other():
    lines = []
    gate = SpeculationGate(explore=4, window=3, min_rounds=1, backoff=0, log=lines.append)
    # batch size 8: drafting costs 30 ms per token, skipping 20: measured once each, then skipping, with one
    # drafting round every 4th decision
    got = _run(gate, 8, 10, lambda d: 0.030 if d else 0.020)
    assert got[:2] == [True, False] and got[2:] == [False, False, False, True, False, False, False, True]
    assert gate.price(8, True) == 0.030 and gate.price(8, False) == 0.020
    # batch size 1 is priced apart: drafting is cheaper there
    assert _run(gate, 1, 5, lambda d: 0.05 if d else 0.09)[2:] == [True, True, True]
    assert len(lines) == 2 and "batch size 8" in lines[0] and "skipped" in lines[0] and "drafting at" in lines[1]
    rec = gate.record()["by_batch"]
    assert rec["8"]["drafting"] is False and rec["8"]["rounds_drafting"] == 3 and rec["8"]["rounds_skipping"] == 7
    assert rec["1"] == {"draft_ms_per_token": 50.0, "draft_ms_per_token_mean_request": 50.0,
                        "skip_ms_per_token": 90.0, "rounds_drafting": 4,
                        "rounds_skipping": 1, "rounds_held": 0, "drafting": True}


def test_drafting_is_priced_for_the_request_a_batch_finishes_with():
    """Two requests draft: "a" keeps 3 drafts a round, "b" none, 0.2 s a round. The mean request advances 2.5
    tokens a round (0.08 s per token), but the batch ends when "b" does, 1 token a round (0.2 s per token):
    skipping at 0.1 s per token is the cheaper choice. A request in fewer than ``min_rounds`` of the rounds is
    not priced on its own (a round or two is noise)."""
    gate = SpeculationGate(min_rounds=4)
    for _ in range(4):
        gate.observe(2, True, 0.2, {"a": 4.0, "b": 1.0})
        gate.observe(2, False, 0.1, {"a": 1.0, "b": 1.0})
    assert gate.price(2, True, slowest=False) == pytest.approx(0.08) and gate.price(2, True) == pytest.approx(0.2)
    assert gate.choose(2) is False
    rec = gate.record()["by_batch"]["2"]
    assert rec["draft_ms_per_token"] == 200.0 and rec["draft_ms_per_token_mean_request"] == 80.0
    gate.observe(2, True, 0.2, {"a": 4.0, "c": 0.5})  # "c" joined for one round: not yet its own price
    assert gate.price(2, True) == pytest.approx(1.0 / 5)
    one = SpeculationGate(min_rounds=4)
    one.observe(2, True, 0.2, {"a": 4.0, "b": 1.0})  # fewer rounds than min_rounds: every request in all of them
    assert one.price(2, True) == pytest.approx(0.2)
    # the one-off rule reads the same price: the feed is paid back over the longest request's tokens
    gate.observe_first_pass(8, 0.01, large=False)
    gate.observe_first_pass(208, 0.21, large=True)
    assert gate.choose(2, one_off=200, tokens_left=48) is False


def test_a_request_whose_room_ends_its_draft_is_not_priced_as_the_slowest():
    """Near its ``max_tokens`` a request can keep fewer drafts than the round allows: it advances 1-2 tokens
    because it is ending, and a batch's fastest request gets there first. Two requests keep 3 drafts a round
    (0.2 s); "a" then has 2 tokens of room and advances 2: that round prices the mean request, not "a"'s own
    rate. Through ``open()`` a step's room comes from the worker (``Step.room``)."""
    gate = SpeculationGate(min_rounds=4)
    for _ in range(4):
        gate.observe(2, True, 0.2, {"a": 4.0, "b": 4.0})
    gate.observe(2, True, 0.2, {"a": 2.0, "b": 4.0}, ending=["a"])
    assert gate.price(2, True) == pytest.approx(0.05)  # both at 0.2 s over 4 tokens; "a"'s ending round left out
    assert gate.price(2, True, slowest=False) == pytest.approx(1.0 / 19)  # the mean request counts every round
    gate.observe(2, True, 0.2, {"a": 1.0, "b": 4.0})  # not said to be ending: "a" is priced by it
    assert gate.price(2, True) == pytest.approx(1.0 / 17)  # its 5 rounds: 1.0 s over 17 tokens

    ids = ["a", "b"]
    stepped = SpeculationGate()
    rooms = [(3, 40), (2, 39), (1, 34)]  # "a" may advance 3 tokens at step 0: fewer than the cap of 4 and a bonus
    for i, (began, first, drafted) in enumerate(((0.0, (10, 20), True), (0.2, (11, 21), False),
                                                 (0.3, (13, 26), True))):
        stepped.open(Step(began, ids, np.array(first), cap=4, drafted=drafted, room=np.array(rooms[i])))
    assert stepped.price(2, True) == pytest.approx(0.2 / 5)  # "a" advanced 2: its end, not its rate
    assert stepped.price(2, True, slowest=False) == pytest.approx(0.2 / 3.5)


def test_a_cost_that_moves_turns_the_choice_around():
    """Drafting gets cheaper while the gate skips: the retry sees it, and the median of the last ``window``
    drafting rounds follows it within a few retries."""
    gate = SpeculationGate(explore=2, window=3, min_rounds=1, backoff=0)
    cost = {True: 0.030, False: 0.020}
    assert _run(gate, 4, 5, lambda d: cost[d]) == [True, False, False, True, False]
    cost[True] = 0.010
    after = _run(gate, 4, 12, lambda d: cost[d])
    assert gate.record()["by_batch"]["4"]["drafting"] is True and after[-4:] == [False, True, False, True]  # skip retried
    gate.observe(4, True, float("nan"), 1.0)  # a step that priced nothing moves nothing
    assert gate.price(4, True) == 0.010


def test_tries_that_leave_the_choice_as_it_was_come_ever_rarer_until_one_turns_it():
    """Drafting at 45 ms per token, skipping at 83: the tries of skipping come after 4, 8, 16 and then every 16
    rounds (backoff 2); once skipping gets cheaper, a try sees it, the choice turns, and tries of drafting start
    again after 4 rounds."""
    gate = SpeculationGate(explore=4, window=1, min_rounds=1, backoff=2)
    cost = {True: 0.045, False: 0.083}
    got = _run(gate, 1, 2 + 4 + 8 + 16 + 16, lambda d: cost[d])
    assert [i for i, d in enumerate(got) if not d] == [1, 5, 13, 29, 45]
    cost[False] = 0.020
    after = _run(gate, 1, 30, lambda d: cost[d])
    assert after.index(False) == 15 and gate.record()["by_batch"]["1"]["drafting"] is False  # the try 16 on turned it
    assert [i for i, d in enumerate(after) if d and i > 15] == [19, 27]  # tries of drafting after 4, then 8 rounds


def test_a_price_is_seconds_over_tokens_and_noise_does_not_stop_drafting():
    """Rounds that kept 4 drafts and rounds that kept none price drafting together (their seconds over their
    tokens, not a median of per-round ratios), and skipping measured cheaper by less than the margin leaves
    drafting on."""
    gate = SpeculationGate(window=4, margin=0.05)
    for seconds, tokens in ((0.10, 5.0), (0.09, 1.0), (0.10, 5.0), (0.09, 1.0)):
        gate.observe(2, True, seconds, tokens)
    assert gate.price(2, True) == pytest.approx(0.38 / 12)  # the median of the ratios would say 0.055
    gate.observe(2, False, 0.031, 1.0)  # 2% cheaper: within the margin
    assert gate.choose(2) is True
    gate.observe(2, False, 0.025, 1.0)  # now 0.028 s per token over its two rounds, 11% cheaper
    assert gate.choose(2) is False


def test_a_token_fed_to_the_draft_is_priced_by_the_slope_of_its_first_passes():
    """Decode-sized first passes cost about their weights' read whatever few tokens they feed; a prefill adds
    the slope's seconds per token. The price waits for both kinds, and the few large passes stay in it among
    many small ones."""
    gate = SpeculationGate()
    for n in (1, 4, 8, 16):
        gate.observe_first_pass(n, 0.030 + 0.001 * n, large=False)
    assert gate.feed_price() is None  # no prefill seen: a one-off cost is not priced, and does not hold drafting
    gate.observe_first_pass(800, 0.030 + 0.001 * 800, large=True)
    for _ in range(200):
        gate.observe_first_pass(8, 0.038, large=False)
    assert gate.feed_price() == pytest.approx(0.001)
    assert gate.record()["feed_ms_per_token"] == pytest.approx(1.0)


def test_drafting_that_must_first_feed_the_draft_waits_until_its_saving_pays_for_that():
    """Drafting at 100 ms per token against 104 without saves 4 ms per token: over 48 tokens left, 0.19 s,
    less than the 0.8 s of eight 100-token prompts through the draft, so the draft is skipped (said once);
    with nothing to feed, the same prices draft; at 60 ms per token drafting pays for the prompts."""
    lines = []
    gate = SpeculationGate(min_rounds=1, log=lines.append)
    gate.observe_first_pass(8, 0.030, large=False)
    gate.observe_first_pass(808, 0.830, large=True)
    gate.observe(8, True, 0.100, 1.0)
    gate.observe(8, False, 0.104, 1.0)
    assert [gate.choose(8, one_off=800, tokens_left=48) for _ in range(3)] == [False] * 3
    assert len(lines) == 2 and "feed the draft 800 tokens (0.80 s)" in lines[1] and "48 tokens" in lines[1]
    assert gate.choose(8) is True  # caught up: nothing to feed
    assert gate.record()["by_batch"]["8"]["rounds_held"] == 3
    gate.observe(4, True, 0.060, 1.0)
    gate.observe(4, False, 0.110, 1.0)
    assert gate.choose(4, one_off=400, tokens_left=48) is True  # 2.4 s saved against 0.4 s fed
    assert gate.choose(4, one_off=400, tokens_left=5) is False  # the tail: 0.25 s saved
    # a request ends early: batch size 7 has no prices yet, and is held at batch size 8's
    assert gate.choose(7, one_off=700, tokens_left=20) is False and gate.record()["by_batch"]["7"]["rounds_held"] == 1
    assert gate.choose(7) is True  # nothing to feed: drafting is tried first, as before


def _priced(gate: SpeculationGate, batch_size: int, draft: float, skip: float) -> None:
    """``min_rounds`` drafting rounds at ``draft`` seconds per token and one skipping round at ``skip``."""
    for _ in range(gate.min_rounds):
        gate.observe(batch_size, True, draft, 1.0)
    gate.observe(batch_size, False, skip, 1.0)


def test_a_batch_size_not_yet_priced_reads_the_saving_its_neighbours_trace_to_it():
    """Drafting saves 40% at batch size 2 and 10% at 4: at 8, past them, the line through them says it costs
    20% more, so 300 tokens of prompts are not fed (batch size 4's own 10% would have paid 0.48 s for their
    0.3 s). With batch sizes 2 and 8 priced (40% and -10%), batch size 4 reads the 15% halfway between them
    in log batch size: a 0.6 s feed pays (0.72 s saved over 48 tokens at 100 ms), a 0.8 s one does not. A
    trend never promises more than the most any batch size saved."""
    def gate_with(*sizes):
        gate = SpeculationGate(min_rounds=2)
        gate.observe_first_pass(8, 0.008, large=False)
        gate.observe_first_pass(808, 0.808, large=True)  # 1 ms per token fed
        for size, draft in sizes:
            _priced(gate, size, draft, 0.100)
        return gate

    past = gate_with((2, 0.060), (4, 0.090))
    assert past._saving_share_at(8, [2, 4]) == pytest.approx(-0.2)
    assert past.choose(8, one_off=300, tokens_left=48) is False
    assert past.record()["by_batch"]["8"]["rounds_held"] == 1
    assert past.choose(8) is True  # nothing to feed: drafting is tried first
    between = gate_with((2, 0.060), (8, 0.110))
    assert between._saving_share_at(4, [2, 8]) == pytest.approx(0.15)
    assert between.choose(4, one_off=600, tokens_left=48) is True
    assert gate_with((2, 0.060), (8, 0.110)).choose(4, one_off=800, tokens_left=48) is False
    rising = gate_with((1, 0.080), (2, 0.070))  # 20% and 30%: the line would say 50% at 8
    assert rising._saving_share_at(8, [1, 2]) == pytest.approx(0.3)


def test_one_dear_round_does_not_stop_drafting_nor_hold_it_off_for_good():
    """A first drafting round that drafted long and kept one token prices drafting at 132 ms per token against
    83 without: drafting goes on until ``min_rounds`` rounds price it (then 45 ms: kept), and a price of fewer
    rounds does not hold the draft where a prompt must be fed. A gate that did leave drafting (min_rounds 1)
    holds it while each new request's prompt must be fed first, at the dear price; its try after ``explore``
    rounds goes ahead where the feed costs at most a quarter of those rounds, and prices drafting afresh; a
    feed dearer than that stays held."""
    prices = iter([0.132] + [0.045] * 40)
    gate = SpeculationGate(explore=16)
    assert _run(gate, 1, 6, lambda d: next(prices) if d else 0.083) == [True, False, True, True, True, True]
    assert gate.record()["by_batch"]["1"]["drafting"] is True

    gate = SpeculationGate(explore=16, min_rounds=1)
    gate.observe_first_pass(8, 0.030, large=False)
    gate.observe_first_pass(808, 0.830, large=True)  # 1 ms per token fed
    gate.observe(1, True, 0.132, 1.0)
    gate.observe(1, False, 0.083, 1.0)
    choices = [gate.choose(1, one_off=79, tokens_left=48) for _ in range(16)]
    assert choices == [False] * 15 + [True]  # the try: 79 ms of feed, within 0.25 x 16 x 83 ms
    assert gate.price(1, True) is None  # the try prices drafting afresh
    gate.observe(1, True, 0.045, 3.0)  # what the try's round cost: drafting is cheaper again
    assert gate.choose(1, one_off=0) is True
    # drafting priced at batch size 1 by two rounds only (a batch's tail, 10 tokens left): that price does not
    # hold the draft, batch size 2's (drafting 34 ms per token against 61) does not either
    tail = SpeculationGate()
    tail.observe_first_pass(8, 0.030, large=False)
    tail.observe_first_pass(808, 0.830, large=True)
    for _ in range(4):
        tail.observe(2, True, 0.034, 1.0)
    tail.observe(2, False, 0.061, 1.0)
    tail.observe(1, True, 0.100, 1.0)
    tail.observe(1, True, 0.101, 1.0)
    tail.observe(1, False, 0.055, 1.0)
    assert tail.choose(1, one_off=3, tokens_left=10) is True and tail.record()["by_batch"]["1"]["rounds_held"] == 0
    dear = SpeculationGate(explore=16, min_rounds=1)
    dear.observe_first_pass(8, 0.030, large=False)
    dear.observe_first_pass(808, 0.830, large=True)
    dear.observe(8, True, 0.110, 1.0)
    dear.observe(8, False, 0.100, 1.0)
    assert not any(dear.choose(8, one_off=737, tokens_left=46) for _ in range(32))  # 0.74 s: beyond 0.4 s


def test_a_steps_choice_is_priced_by_the_target_step_that_verified_its_drafts():
    """Two requests: step 0 drafts 4 tokens each (0.2 s to the next step), all kept; step 1 skips (0.1 s). The
    target verifies step 0's drafts in step 1's forward, so they show in step 2's first positions: drafting is
    priced 0.2 s over 5 tokens and skipping 0.1 s over 1 token (step 1's own advance of 1 came from before step 0).
    A step with other requests prices nothing, and the step after one that fed the draft a prefill or a
    catch-up is told to draft."""
    gate = SpeculationGate()
    ids = ["a", "b"]
    firsts = [(10, 20), (11, 21), (16, 26), (17, 27)]
    for i, (began, drafted) in enumerate(((0.0, True), (0.2, False), (0.3, True), (0.5, False))):
        step = Step(began, ids, np.array(firsts[i]), cap=4, drafted=drafted)
        assert gate.open(step) is False
    assert gate.price(2, True) == pytest.approx(0.2 / 5) and gate.price(2, False) == pytest.approx(0.1 / 1)
    # each request's own advance is kept: where "b" keeps 2 of 4 drafts, drafting is priced by "b"
    apart = SpeculationGate()
    for began, first, drafted in ((0.0, (10, 20), True), (0.2, (11, 21), False), (0.3, (16, 24), True)):
        apart.open(Step(began, ids, np.array(first), cap=4, drafted=drafted))
    assert apart.price(2, True) == pytest.approx(0.2 / 3) and apart.price(2, True, slowest=False) == 0.2 / 4
    step = Step(0.6, ["a", "c"], np.array([18, 0]), cap=4, drafted=True, fed_once=True)
    assert gate.open(step) is False  # other requests: the step two back is not priced
    assert gate.rounds == {} and gate.price(2, True) == pytest.approx(0.04)
    assert gate.open(Step(0.9, ["a", "c"], np.array([19, 1]), cap=4)) is True  # the step before fed the draft once
