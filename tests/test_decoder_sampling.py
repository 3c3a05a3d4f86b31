"""Speculative sampling is lossless: output distribution (chi-square) and rejection count (Theorem 1)."""

from __future__ import annotations

import math

import pytest
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode.chain import SpeculativeDecoder
from specstop.export.runtime import StoppingPolicy
from specstop.probs import DecodingConfig, tv_distance
from specstop.testing import next_token_probs, pooled_chi_square, small_vocab_pair, two_token_distribution

VOCAB = 5
PROMPT = [1, 3, 2]
DECODING = DecodingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def small_pair():
    """A 5-token pair whose draft differs noticeably from the target (TV around 0.2-0.4)."""
    return small_vocab_pair(vocab=VOCAB).pair


def _probs(model, ids):
    return next_token_probs(model, ids, DECODING, VOCAB)


def test_first_two_tokens_follow_the_target(small_pair):
    exact = two_token_distribution(small_pair.target, PROMPT, DECODING, VOCAB)
    runs = 1000
    counts = dict.fromkeys(exact, 0)
    dec = SpeculativeDecoder(small_pair, StoppingPolicy.from_string("static:4"), DECODING)
    rejections = 0
    for seed in range(runs):
        res = dec.generate(PROMPT, 4, seed=seed)
        counts[tuple(res.token_ids[:2])] += 1
        rejections += sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))
    assert rejections > runs * 0.2, "the draft must be rejected often for the test to mean anything"
    # Pool cells with small expectations so the chi-square approximation holds.
    stat, df, pvalue = pooled_chi_square(counts, exact, runs)
    assert pvalue > 1e-3, f"chi-square {stat:.1f} on {df} df (p={pvalue:.2g}): output is not the target's distribution"


@torch.no_grad()
def test_rejections_match_theorem_1(small_pair):
    """Unbounded draft length: E[#rejections] = sum over drafted positions of E[TV(p, q)] (Yin et al. Thm 1)."""
    max_new, runs = 6, 300
    dec = SpeculativeDecoder(small_pair, StoppingPolicy.from_string("static:64"), DECODING)
    diffs = []
    for seed in range(runs):
        res = dec.generate(PROMPT, max_new, seed=seed)
        rej = sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))
        seq = PROMPT + res.token_ids
        p = _probs(small_pair.target, seq)
        q = _probs(small_pair.draft, seq)
        # Positions 0..max_new-2 each receive exactly one draft proposal (K_cap = remaining - 1);
        # the last position is a bonus / target-only token.
        rows = range(len(PROMPT) - 1, len(PROMPT) - 1 + max_new - 1)
        tv = float(tv_distance(p[list(rows)], q[list(rows)]).sum())
        diffs.append(rej - tv)
    mean = sum(diffs) / runs
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (runs - 1))
    assert abs(mean) < 4 * sd / math.sqrt(runs), f"mean rejections - sum TV = {mean:.3f} (sd {sd:.3f})"


def test_topk_topp_sampling_stays_in_support(small_pair):
    dec = SpeculativeDecoder(small_pair, StoppingPolicy.from_string("static:3"), DecodingConfig(temperature=0.7, top_k=2))
    for seed in range(20):
        res = dec.generate(PROMPT, 3, seed=seed)
        seq = PROMPT + res.token_ids
        for i, tok in enumerate(res.token_ids):
            logits = small_pair.target(torch.tensor([seq[: len(PROMPT) + i]])).logits[0, -1, :VOCAB]
            assert tok in torch.topk(logits, 2).indices.tolist()
