"""Costs that hold: a fake clock with two cost levels drives the calibration, its check and live re-pricing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from specstop import clock
from specstop.eval.cost import CostModel
from specstop.eval.cost_check import table_problems
from specstop.export.runtime import StoppingPolicy
from specstop.policy import PolicySpec
from specstop.testing import FakeClock, charge_forwards, tiny_pair

DRAFT_S = 0.03


def target_s(tokens: int) -> float:
    return 0.10 + 0.004 * tokens


def two_levels(fake: FakeClock, period: float = 3.0, high: float = 1.3):
    """Every forward costs its base price, times ``high`` in every other ``period`` seconds of the clock."""
    def cost(role: str, tokens: int, kwargs: dict) -> float:
        level = high if int(fake.t // period) % 2 else 1.0
        return level * (DRAFT_S if role == "draft" else target_s(tokens))

    return cost


def _calibrate(pair, fake, budget=40.0):
    from specstop.measure.calibrate import build_context, calibrate

    ctx = build_context(pair.tokenizer, ["def add(a, b):\n    return a + b\n"], 40)
    with clock.using(fake):
        cost, raw = calibrate(pair, context=ctx, context_tokens=40, budget_s=budget, k_grid=(0, 1, 2, 4, 8),
                              progress=False)
    return cost, raw


def test_calibration_reports_two_levels_and_checks_like_with_like():
    pair, fake = tiny_pair(), FakeClock()
    remove = charge_forwards(pair, fake, two_levels(fake))
    try:
        cost, raw = _calibrate(pair, fake)
    finally:
        remove()
    levels = cost.fit["levels"]
    assert "target K=0" in levels and "draft step" in levels
    low, high = levels["target K=0"]
    assert low["seconds"] == pytest.approx(target_s(1)) and high["seconds"] == pytest.approx(1.3 * target_s(1))
    assert 0.2 < low["share"] < 0.8
    # Each decoder round priced by the forwards timed beside it: the same cost, whatever the level.
    check = cost.fit["decoder_check"]
    assert set(check) == {"target-only step", "static:4 round"}
    for rec in check.values():
        assert rec["rounds"] >= 5 and rec["ratio"] == pytest.approx(1.0, abs=0.02)
    assert cost.fit["check"]["problems"] == [] and table_problems(cost) == []
    # The decoder's rounds were spread over the whole run, beside the windows, not after them.
    windows = sorted({r["window"] for r in raw["decoder"]})
    assert windows[0] == 0 and windows[-1] >= len(raw["windows"]) - 2


def test_the_check_fails_when_the_decoder_really_pays_more():
    """A decoder whose every target forward costs 1.4x what the table's forwards cost (here: whenever
    it passes its own cache positions) is a table that does not describe it: refused."""
    pair, fake = tiny_pair(), FakeClock()

    def cost(role, tokens, kwargs):
        base = DRAFT_S if role == "draft" else target_s(tokens)
        return base * (1.4 if role == "target" and "cache_position" in kwargs else 1.0)

    remove = charge_forwards(pair, fake, cost)
    try:
        calibrated, _ = _calibrate(pair, fake, budget=15.0)
    finally:
        remove()
    problems = calibrated.fit["check"]["problems"]
    assert any(p.startswith("target-only step: the decoder measured") and "1.40x" in p for p in problems)


def _stats_policy(table: CostModel) -> StoppingPolicy:
    """A confidence policy carrying statistics of two candidates: long drafts (tuned: the draft is cheap)
    and short ones (faster once the draft step costs 8x)."""
    def cand(threshold, sl_max, k_hist):
        k_hist = list(k_hist)
        drafted = sum(k * h for k, h in enumerate(k_hist))
        return {"params": {"threshold": threshold, "sl_max": sl_max, "rule": "below"}, "rounds": sum(k_hist),
                "drafted": drafted, "accepted": drafted // 2, "target_only": k_hist[0], "unproposed": 0,
                "k_hist": k_hist}

    stats = {"format": 1, "n": 300, "prompts": 4, "chosen": 1,
             "candidates": [cand(0.9, 2, [0, 50, 50]), cand(0.1, 8, [0, 5, 5, 5, 5, 5, 5, 5, 15])]}
    spec = PolicySpec(kind="confidence", threshold=0.1, sl_max=8)
    return StoppingPolicy(spec, config={"stats": stats, "cost_model": table.to_dict()})


def test_live_repricing_switches_when_the_draft_gets_dear_and_stays_lossless(caplog):
    from specstop.decode.chain import SpeculativeDecoder

    pair, fake = tiny_pair(), FakeClock()
    table = CostModel(t_draft=DRAFT_S, t_target=0.1, target_by_k={k: target_s(k + 1) for k in (0, 1, 2, 4, 8)},
                      provenance="measured", name="cost.json")
    dear = {"on": False}

    def cost(role, tokens, kwargs):
        return (DRAFT_S * (8 if dear["on"] else 1)) if role == "draft" else target_s(tokens)

    prompt = pair.tokenizer("def fib(n):").input_ids
    ref = SpeculativeDecoder(pair, "static:1", live_pricing=False).generate(prompt, 40, max_draft=0).token_ids
    remove = charge_forwards(pair, fake, cost)
    try:
        with clock.using(fake), caplog.at_level(logging.INFO, logger="specstop"):
            live = SpeculativeDecoder(pair, _stats_policy(table))
            pinned = SpeculativeDecoder(pair, _stats_policy(table), live_pricing=False)
            first = live.generate(prompt, 40)
            assert first.live["switches"] == [] and live.policy.spec.threshold == 0.1  # the table holds
            dear["on"] = True
            out = live.generate(prompt, 40)
            still = pinned.generate(prompt, 40)
    finally:
        remove()
    assert out.token_ids == ref and still.token_ids == ref and first.token_ids == ref  # lossless either way
    assert live.policy.spec.threshold == 0.9 and live.policy.spec.sl_max == 2
    switch = out.live["switches"][0]
    assert switch["from"] == "confidence:0.1 (SL_max 8)" or "0.1" in switch["from"]
    assert switch["scales"]["draft"] == pytest.approx(8.0) and switch["scales"]["verify"] == pytest.approx(1.0)
    assert "live pricing:" in caplog.text and "draft step 8.00x" in caplog.text
    assert pinned.live is None and pinned.policy.spec.threshold == 0.1 and still.live is None


def test_live_costs_are_robust_to_one_slow_round():
    from specstop.decode.live_pricing import LiveCosts, scaled

    table = CostModel(t_draft=0.05, t_target=0.2, target_by_k={0: 0.2, 1: 0.21, 4: 0.25}, provenance="measured")
    live = LiveCosts(table)
    for i in range(9):
        live.add_round(2, draft_s=0.1 * (20 if i == 4 else 1), decision_s=0.0, target_s=0.22 * 1.1,
                       decision_per_step=0.0)
    s = live.scales()
    assert s["draft"] == pytest.approx(1.0) and s["verify"] == pytest.approx(1.1 * 0.22 / table.target_cost(2))
    assert s["single"] == s["verify"]  # no target-only step seen yet: it follows the verifications
    m = scaled(table, draft=2.0, verify=1.5, single=0.5)
    assert m.t_draft == 0.1 and m.target_cost(4) == pytest.approx(0.375) and m.target_cost(0) == pytest.approx(0.1)
    assert np.isclose(m.round_cost(4), 0.375 + 4 * 0.1)


def test_the_batched_decoder_reprices_as_batch_rounds_and_stays_lossless(caplog):
    """Four rows at once: a dear draft makes the short-draft candidate the faster batch round too; every
    row still decodes the target's own greedy output."""
    from specstop.decode.batched import BatchedSpeculativeDecoder
    from specstop.decode.chain import SpeculativeDecoder

    pair, fake = tiny_pair(), FakeClock()
    table = CostModel(t_draft=DRAFT_S, t_target=0.1, target_by_k={k: target_s(k + 1) for k in (0, 1, 2, 4, 8)},
                      provenance="measured", name="cost.json")
    prompts = [pair.tokenizer(t).input_ids for t in ("def fib(n):", "hello", "import os", "x = [1, 2")]
    refs = [SpeculativeDecoder(pair, "static:1", live_pricing=False).generate(p, 30, max_draft=0).token_ids
            for p in prompts]
    remove = charge_forwards(pair, fake, lambda role, tokens, kw: (8 * DRAFT_S) if role == "draft" else target_s(tokens))
    try:
        with clock.using(fake), caplog.at_level(logging.INFO, logger="specstop"):
            dec = BatchedSpeculativeDecoder(pair, _stats_policy(table))
            out = dec.generate(prompts, 30)
    finally:
        remove()
    assert out.token_ids == refs
    assert dec.live.batch_size == 4 and out.batch["live"]["switches"]
    assert dec.policy.spec.threshold == 0.9 and "live pricing:" in caplog.text


def test_the_vllm_proposer_reprices_from_the_engine_steps_it_times(tiny_pair_dir, tmp_path, caplog):
    """vLLM's calls simulated (tests/test_vllm_proposer.py's loop): the proposer times its own calls and the
    target step between them; with a draft 8x dearer than the table it switches every request's policy."""
    from types import SimpleNamespace

    import torch
    from test_vllm_proposer import MAX_LEN, _simulate

    from specstop.decode.vllm_proposer import SpecstopProposer
    from specstop.export.export import export_policy
    from specstop.pair.loader import load_pair

    table = CostModel(t_draft=DRAFT_S, t_target=0.1, target_by_k={k: target_s(k + 1) for k in (0, 1, 2, 4, 8)},
                      provenance="measured", name="cost.json")
    rule = _stats_policy(table)
    export_policy(tmp_path / "export", spec=rule.spec, stats=rule.stats, cost_model=table.to_dict(),
                  allow_missing_pair=True)
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=8, num_speculative_tokens_per_batch_size=None),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, dtype=torch.float32),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={"specstop": {"draft": str(tiny_pair_dir / "draft"), "policy": str(tmp_path / "export")}})
    proposer = SpecstopProposer(config)
    proposer.load_model()
    pair = load_pair(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), dtype="float32", device="cpu")
    fake = FakeClock()
    proposer.model.register_forward_pre_hook(lambda *a: fake.advance(8 * DRAFT_S))
    propose = proposer.propose

    def engine_step(sampled, lengths, table_ids):  # the target's step happens between two calls
        fake.advance(target_s(1 + max(len(s) for s in sampled)))
        return propose(sampled, lengths, table_ids)

    proposer.propose = engine_step
    prompts = [pair.tokenizer(t).input_ids for t in ("def fib(n):", "hello there")]
    with clock.using(fake), caplog.at_level(logging.INFO, logger="specstop"):
        outs, _ = _simulate(proposer, pair, prompts, 40, join_late=0)
    refs = [_target_greedy(pair, p, 40) for p in prompts]
    assert outs == refs  # vLLM verifies: the target's output whatever the drafts
    assert proposer.live.switches and proposer.policy.spec.threshold == 0.9
    assert all(slot.policy.spec.threshold == 0.9 for slot in proposer._slots)
    assert "live pricing:" in caplog.text


def _target_greedy(pair, prompt, n):
    """The target's own greedy output (our decoder with no draft)."""
    from specstop.decode.chain import SpeculativeDecoder

    return SpeculativeDecoder(pair, "static:1", live_pricing=False).generate(prompt, n, max_draft=0).token_ids
