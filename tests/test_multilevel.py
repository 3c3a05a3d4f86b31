"""Multi-level speculative decoding (specstop.decode.multilevel) is lossless against the top-level target:
greedy output equals the target's own greedy decoding, token for token, and sampled output follows the
target's exact two-token distribution (chi-square), whatever the levels below propose and wherever their
policies stop. The self draft (the target quantized as its own draft) is checked as a chain draft and as
the middle level."""

from __future__ import annotations

import pytest
import torch

from specstop.decode.chain import SpeculativeDecoder
from specstop.decode.multilevel import MultiLevelDecoder
from specstop.errors import UserError
from specstop.probs import DecodingConfig
from specstop.testing import pooled_chi_square, small_vocab_pair, tiny_pair, two_token_distribution

SHAPE = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}  # int4 groups divide 64
PROMPTS = ([5, 9, 13, 2, 40], [7, 7, 31], [3])


def _noisy_copy(model, noise: float, seed: int):
    """A copy of ``model`` with Gaussian noise of relative size ``noise`` on every weight."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.numel() > 1:
                p.add_(noise * float(p.float().std()) * torch.randn(p.shape, generator=gen))
    return out


def _target_greedy(pair, prompt, n):
    padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
    with torch.no_grad():
        return pair.target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                    suppress_tokens=padded or None)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=5, **SHAPE)


@pytest.mark.parametrize("policies", [("static:3", "static:2"), ("confidence:0.3", "confidence:0.5"),
                                      ("heuristic", "static:4"), ("static:1", "static:6")])
def test_greedy_output_is_the_targets(pair, policies):
    middle = _noisy_copy(pair.target, 0.05, seed=1)
    dec = MultiLevelDecoder(pair, [middle], policies)
    for prompt in PROMPTS:
        res = dec.generate(prompt, 24)
        assert res.token_ids == _target_greedy(pair, prompt, 24), (policies, prompt)
        bottom, mid, top = res.counters["levels"]
        # The counters add up: the target's rounds are the result's, each level was drafted for.
        assert top["rounds"] == len(res.round_lengths) == res.counters["rounds"]
        assert top["drafted"] == sum(res.round_lengths) and top["accepted"] == sum(res.accepted_per_round)
        assert mid["drafted"] > 0 and mid["accepted"] > 0 and top["accepted"] > 0
        assert bottom["forwards"] >= mid["drafted"]  # one bottom forward per token it drafts
        assert res.counters["N"] == len(res.token_ids)
        assert res.timings["target"] > 0 and res.timings["level1"] > 0 and res.timings["draft"] > 0


def test_max_draft_zero_is_the_target_alone(pair):
    dec = MultiLevelDecoder(pair, [_noisy_copy(pair.target, 0.05, seed=1)], ("static:3", "static:3"))
    res = dec.generate([5, 9, 13], 10, max_draft=0)
    assert res.round_lengths == [0] * 10 and res.token_ids == _target_greedy(pair, [5, 9, 13], 10)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_self_draft_is_lossless_as_a_chain_draft_and_as_a_middle_level(pair, scheme):
    from specstop.pair.loader import self_draft

    own = self_draft(pair, scheme)
    assert own.target is pair.target and own.draft is not pair.target
    assert own.draft_identity.quant == scheme and own.draft_identity.weights_sha256 == pair.target_identity.weights_sha256
    assert own.draft.specstop_draft_quant["scheme"] == scheme
    for prompt in PROMPTS[:2]:
        ref = _target_greedy(pair, prompt, 20)
        chain = SpeculativeDecoder(own, "static:3").generate(prompt, 20)
        assert chain.token_ids == ref
        assert sum(chain.accepted_per_round) > 0  # (a random tiny model's flat logits: int4 flips many)
        stacked = MultiLevelDecoder(pair, [own.draft], ("static:2", "confidence:0.2")).generate(prompt, 20)
        assert stacked.token_ids == ref


def test_bad_stacks_are_refused_in_one_line(pair):
    with pytest.raises(UserError, match="needs 2 stopping policies"):
        MultiLevelDecoder(pair, [pair.target], ["static:3"])
    with pytest.raises(UserError, match="policy must be"):
        MultiLevelDecoder(pair, [pair.target], ["static:3", 4])


def _small_stack():
    """The 12-token pair of the sampling tests plus a middle model between its draft and its target."""
    base = small_vocab_pair(vocab=12, noise=0.15).pair
    middle = _noisy_copy(base.target, 0.1, seed=3)
    middle.generation_config.eos_token_id = None
    return base, middle


SAMPLED = [
    ("T1", DecodingConfig(temperature=1.0), ("static:2", "static:2")),
    ("top_p", DecodingConfig(temperature=0.7, top_p=0.9), ("confidence:0.5", "static:3")),
    ("top_k", DecodingConfig(temperature=0.7, top_k=4), ("static:1", "confidence:0.6")),
]


@pytest.mark.parametrize("name, decoding, policies", SAMPLED, ids=[c[0] for c in SAMPLED])
def test_sampled_output_follows_the_target(name, decoding, policies):
    pair, middle = _small_stack()
    prompt, runs = [4, 0], 500
    exact = two_token_distribution(pair.target, prompt, decoding, 12)
    dec = MultiLevelDecoder(pair, [middle], policies, decoding)
    counts: dict[tuple, int] = {}
    rejected = [0, 0]
    for seed in range(runs):
        res = dec.generate(prompt, 4, seed=seed)
        cell = tuple(res.token_ids[:2])
        counts[cell] = counts.get(cell, 0) + 1
        for i, lv in enumerate(res.counters["levels"][1:]):
            rejected[i] += lv["drafted"] - lv["accepted"]
    # The check bites: both verifications reject often (the bottom's drafts and the middle's).
    assert min(rejected) > 0.1 * runs, rejected
    assert not [c for c in counts if exact[c] == 0], "tokens the target's transform excludes"
    stat, df, pvalue = pooled_chi_square(counts, exact, runs)
    assert pvalue > 1e-3, f"{name}: chi-square {stat:.1f} on {df} df (p={pvalue:.2g})"


def test_a_middle_level_refuses_a_learned_policy(pair):
    """Only the bottom level's policy may be learned: an export names the pair's draft, not a middle model."""
    from specstop.export.runtime import StoppingPolicy

    learned = StoppingPolicy.from_string("confidence:0.4")
    learned.predictor = torch.nn.Identity()  # what the check reads; scoring is never reached
    with pytest.raises(UserError, match="only the bottom level"):
        MultiLevelDecoder(pair, [pair.target], ["static:3", learned])
