"""The speculation gate (specstop.decode.speculation_gate): per batch size, drafting unless skipping the draft is
measured cheaper by its margin, the other choice tried again every ``explore`` rounds, each change said once."""

from __future__ import annotations

import pytest

from specstop.decode.speculation_gate import SpeculationGate


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
    gate = SpeculationGate(explore=4, window=3, log=lines.append)
    # batch size 8: drafting costs 30 ms per token, skipping 20: measured once each, then skipping, with one
    # drafting round every 4th decision
    got = _run(gate, 8, 10, lambda d: 0.030 if d else 0.020)
    assert got[:2] == [True, False] and got[2:] == [False, False, False, True, False, False, False, True]
    assert gate.price(8, True) == 0.030 and gate.price(8, False) == 0.020
    # batch size 1 is priced apart: drafting is cheaper there
    assert _run(gate, 1, 5, lambda d: 0.05 if d else 0.09)[2:] == [True, True, True]
    assert len(lines) == 2 and "batch size 8" in lines[0] and "skipped" in lines[0] and "drafting at" in lines[1]
    rec = gate.record()
    assert rec["8"]["drafting"] is False and rec["8"]["rounds_drafting"] == 3 and rec["8"]["rounds_skipping"] == 7
    assert rec["1"] == {"draft_ms_per_token": 50.0, "skip_ms_per_token": 90.0, "rounds_drafting": 4,
                        "rounds_skipping": 1, "drafting": True}


def test_a_cost_that_moves_turns_the_choice_around():
    """Drafting gets cheaper while the gate skips: the retry sees it, and the median of the last ``window``
    drafting rounds follows it within a few retries."""
    gate = SpeculationGate(explore=2, window=3)
    cost = {True: 0.030, False: 0.020}
    assert _run(gate, 4, 5, lambda d: cost[d]) == [True, False, False, True, False]
    cost[True] = 0.010
    after = _run(gate, 4, 12, lambda d: cost[d])
    assert gate.record()["4"]["drafting"] is True and after[-4:] == [False, True, False, True]  # skip retried
    gate.observe(4, True, float("nan"), 1.0)  # a step that priced nothing moves nothing
    assert gate.price(4, True) == 0.010


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
