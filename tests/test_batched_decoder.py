"""BatchedSpeculativeDecoder: every row equals the target's greedy output alone, B = 1 equals the chain
decoder, rows end independently, masked/compacted caches stay exact, sampling follows the target."""

from __future__ import annotations

import pytest
import test_decoder as chain_tests
import test_decoder_sampling as sampling_tests
from _export_fixtures import single_thread, tiny_prompts  # noqa: F401

from specstop.decode import BatchedSpeculativeDecoder
from specstop.decode import batched as batched_mod
from specstop.decode.chain import SpeculativeDecoder
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy
from specstop.testing import pooled_chi_square, two_token_distribution

# ``references`` (the target's own greedy output per prompt) resolves ``prompts`` below: these four.
references, MAX_NEW = chain_tests.references, chain_tests.MAX_NEW  # `pair`: tests/conftest.py
small_pair, DECODING, PROMPT, VOCAB = (
    sampling_tests.small_pair, sampling_tests.DECODING, sampling_tests.PROMPT, sampling_tests.VOCAB
)
TEXTS = ("hello world", "def f(x):", "zz", "a prompt a good deal longer than the other three")


@pytest.fixture(scope="module")
def prompts(pair):
    return tiny_prompts(pair, TEXTS)


@pytest.mark.parametrize("policy", ["static:1", "static:3", "confidence:0.4", "confidence:0.02", "heuristic"])
def test_every_row_equals_the_target_alone(policy, pair, prompts, references):
    res = BatchedSpeculativeDecoder(pair, policy).generate(prompts, MAX_NEW)
    assert len({len(p) for p in prompts}) > 2, "prompts of different lengths share the batch"
    assert res.token_ids == references
    for b, ids in enumerate(prompts):
        chain = SpeculativeDecoder(pair, StoppingPolicy.from_string(policy)).generate(ids, MAX_NEW)
        # Rounds per row are the chain decoder's: the batch changes only what runs together.
        assert res.round_lengths[b] == chain.round_lengths and res.accepted_per_round[b] == chain.accepted_per_round
        for key in ("N", "N_target", "N_draft", "N_discarded", "rounds", "stop_reason"):
            assert res.counters[b][key] == chain.counters[key], (policy, b, key)
    # One draft forward per step of the longest row, one target forward per round.
    assert res.batch["draft_forwards"] == sum(res.batch["round_k"])
    assert res.batch["target_forwards"] == res.batch["rounds"] == len(res.timings["round_seconds"])
    for r, k in enumerate(res.batch["round_k"]):
        assert k == max(res.round_lengths[b][r] for b in range(len(prompts)) if r < len(res.round_lengths[b]))


def test_confidence_rows_stop_on_their_own(pair, prompts):
    res = BatchedSpeculativeDecoder(pair, "confidence:0.1").generate(prompts, MAX_NEW)
    # In some batch round the rows drafted different lengths: each stopped on its own draft probability.
    rounds = min(len(k) for k in res.round_lengths)
    assert any(len({res.round_lengths[b][r] for b in range(len(prompts))}) > 1 for r in range(rounds))


def test_batch_of_one_is_the_chain_decoder(pair, prompts):
    for policy in ("static:4", "confidence:0.3"):
        res = BatchedSpeculativeDecoder(pair, policy).generate(prompts[:1], MAX_NEW)
        chain = SpeculativeDecoder(pair, StoppingPolicy.from_string(policy)).generate(prompts[0], MAX_NEW)
        row = res.row(0)
        assert row.token_ids == chain.token_ids
        assert row.round_lengths == chain.round_lengths and row.accepted_per_round == chain.accepted_per_round
        assert res.batch["draft_forwards"] == chain.counters["N_draft"]


def test_rows_end_on_their_own_eos(pair, prompts, references):
    dec = BatchedSpeculativeDecoder(pair, "static:3")
    stop = references[0][5]
    dec.eos = {stop}
    res = dec.generate(prompts, MAX_NEW)
    for b, ref in enumerate(references):
        want = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert res.token_ids[b] == want
        assert res.counters[b]["stop_reason"] == ("eos" if stop in ref else "length")
    assert res.batch["round_rows"][0] == len(prompts) and min(res.batch["round_rows"]) < len(prompts)


def test_max_new_tokens_and_target_only_rounds(pair, prompts, references):
    res = BatchedSpeculativeDecoder(pair, "static:20").generate(prompts, 7)
    assert res.token_ids == [r[:7] for r in references]
    for b in range(len(prompts)):
        s = 0
        for k, n in zip(res.round_lengths[b], res.accepted_per_round[b]):
            assert k <= 7 - s - 1
            s += n + 1 if k else 1
    base = BatchedSpeculativeDecoder(pair, "static:4").generate(prompts, 6, max_draft=0)
    assert base.token_ids == [r[:6] for r in references]
    assert set(sum(base.round_lengths, [])) == {0} and base.batch["draft_forwards"] == 0


def test_compacted_caches_stay_exact(pair, prompts, references, monkeypatch):
    # Compact after every round: each row's valid columns gathered right, as prompts are padded.
    monkeypatch.setattr(batched_mod, "COMPACT_MIN", 0)
    monkeypatch.setattr(batched_mod, "COMPACT_SHARE", 0.0)
    res = BatchedSpeculativeDecoder(pair, "static:5").generate(prompts, MAX_NEW)
    assert res.token_ids == references


def test_bad_input_is_a_user_error(pair):
    dec = BatchedSpeculativeDecoder(pair, "static:2")
    with pytest.raises(UserError, match="at least one token"):
        dec.generate([[1, 2], []], 4)
    with pytest.raises(UserError, match="max_new_tokens"):
        dec.generate([[1, 2]], 0)


@pytest.mark.parametrize("policy", ["static:3", "confidence:0.5"])
def test_sampled_rows_follow_the_target(policy, small_pair):
    """Each row's first two tokens follow the target's distribution for its own prompt."""
    other = [4, 0]
    batch = [PROMPT, other, PROMPT]
    exact = {tuple(ids): two_token_distribution(small_pair.target, ids, DECODING, VOCAB) for ids in (PROMPT, other)}
    runs = 400
    counts = {tuple(ids): {} for ids in (PROMPT, other)}
    dec = BatchedSpeculativeDecoder(small_pair, policy, DECODING)
    rejections = 0
    for seed in range(runs):
        res = dec.generate(batch, 4, seed=seed)
        for b in (0, 1):  # row 2 repeats row 0's prompt: its draws are not independent of row 0's count
            cell = tuple(res.token_ids[b][:2])
            counts[tuple(batch[b])][cell] = counts[tuple(batch[b])].get(cell, 0) + 1
        rejections += sum(n < k for row in range(3) for k, n in zip(res.round_lengths[row], res.accepted_per_round[row]))
    assert rejections > runs * 0.2, "the draft must be rejected often for the test to mean anything"
    for ids, cells in exact.items():
        pvalue = pooled_chi_square(counts[ids], cells, runs)[2]
        assert pvalue > 1e-3, f"{policy}, prompt {ids}: chi-square p={pvalue:.2g}: not the target's distribution"
