"""Speculative sampling is lossless: output distribution (chi-square) and rejection count (Theorem 1)."""

from __future__ import annotations

import math

import pytest
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode.chain import SpeculativeDecoder
from specstop.export.runtime import StoppingPolicy
from specstop.pair.loader import ModelPair
from specstop.probs import DecodingConfig, logits_to_probs, tv_distance
from specstop.testing import tiny_causal_lm

VOCAB = 5
PROMPT = [1, 3, 2]
DECODING = DecodingConfig(temperature=1.0)


class _StubTokenizer:
    eos_token_id = None  # no EOS: every run has the same length

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def small_pair():
    """A 5-token pair whose draft differs noticeably from the target (TV around 0.2-0.4)."""
    target = tiny_causal_lm(VOCAB, seed=5, hidden_size=16, num_layers=1, padded_vocab=3, init_range=0.6)
    draft = tiny_causal_lm(VOCAB, seed=6, hidden_size=16, num_layers=1, padded_vocab=3, init_range=0.6)
    sd = {k: v + 0.5 * v.std() * torch.randn_like(v) if v.numel() > 1 else v for k, v in target.state_dict().items()}
    draft.load_state_dict(sd)
    for m in (draft, target):
        m.generation_config.eos_token_id = None
        m.requires_grad_(False)
    return ModelPair(draft, target, _StubTokenizer(), None, None, "stub", VOCAB, name="small")


@torch.no_grad()
def _probs(model, ids):
    return logits_to_probs(model(torch.tensor([ids])).logits[0], DECODING, VOCAB)


def test_first_two_tokens_follow_the_target(small_pair):
    from scipy.stats import chi2

    p1 = _probs(small_pair.target, PROMPT)[-1]
    exact = {}
    for a in range(VOCAB):
        p2 = _probs(small_pair.target, PROMPT + [a])[-1]
        for b in range(VOCAB):
            exact[(a, b)] = float(p1[a] * p2[b])
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
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell in sorted(exact, key=exact.get):
        pool_obs += counts[cell]
        pool_exp += exact[cell] * runs
        if pool_exp >= 5:
            stat += (pool_obs - pool_exp) ** 2 / pool_exp
            df += 1
            pool_obs, pool_exp = 0, 0.0
    pvalue = chi2.sf(stat, df)
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
