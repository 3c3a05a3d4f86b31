"""data_gen label correctness on the tiny pair: brute-force math, teacher forcing vs step-by-step
generation, greedy speculative decoding, token mixing and rollouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _data_gen_helpers import full_logits, greedy_generate, make_render, records, ref_probs

from specstop.data_gen.batching import sample_from_uniform, uniforms
from specstop.data_gen.config import DataGenConfig, GenerationConfig
from specstop.data_gen.forward import forward_positions
from specstop.data_gen.labels import teacher_labels
from specstop.data_gen.mixing import mixed_rows, mixing_keep_mask
from specstop.data_gen.responses import PreparedPrompt, eos_ids, generate_responses
from specstop.data_gen.rollouts import greedy_rollouts, rollout_cap
from specstop.probs import DecodingConfig
from specstop.testing import tiny_pair


@pytest.fixture(scope="module")
def batch(pair):
    """4 prompts of different lengths with their batched greedy responses (max 24 tokens)."""
    render = make_render(pair.tokenizer)
    recs = records(4)
    prepared = [PreparedPrompt(r, render(r.text)) for r in recs]
    assert len({len(p.ids) for p in prepared}) > 1  # left padding is exercised
    resp = generate_responses(pair, prepared, GenerationConfig(max_new_tokens=24), seed=0)
    return prepared, resp


def _teacher(pair, prepared, resp, dec=DecodingConfig(), hidden=False, k=10, seed=0):
    return teacher_labels(
        pair, [p.record.prompt_id for p in prepared], [p.record.source_index for p in prepared],
        [p.ids for p in prepared], [r.ids for r in resp], decoding=dec, k=k, seed=seed, hidden=hidden, chunk_rows=7,
    )


def test_batched_responses_equal_single_sequence_generate(pair, batch):
    prepared, resp = batch
    eos = pair.tokenizer.eos_token_id
    for p, r in zip(prepared, resp):
        toks, _ = greedy_generate(pair.target, p.ids, 24, pair.vocab_size, eos)
        assert r.ids == toks
        assert r.stop_reason == ("eos" if toks[-1] == eos else "length")
        assert all(t != eos for t in r.ids[:-1])  # nothing after EOS


@pytest.mark.parametrize("dec", [DecodingConfig(), DecodingConfig(temperature=0.7, top_k=20, top_p=0.9)])
def test_label_math_matches_brute_force(pair, batch, dec):
    prepared, resp = batch
    t = _teacher(pair, prepared, resp, dec=dec, hidden=True)
    c = t.columns
    V = pair.vocab_size
    for b, (p, r) in enumerate(zip(prepared, resp)):
        seq = p.ids + r.ids
        tl = full_logits(pair.target, seq)
        dl = full_logits(pair.draft, seq)
        with torch.no_grad():
            h = pair.draft(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        u_s = uniforms(0, p.record.source_index, "draft-sample", len(r.ids)).numpy()
        u_v = uniforms(0, p.record.source_index, "verify", len(r.ids)).numpy()
        for i, x in enumerate(r.ids):
            row = t.offsets[b] + i
            pos = len(p.ids) + i - 1  # logits predicting response token i
            pp = ref_probs(tl[pos], V, dec.temperature, dec.top_k, dec.top_p)
            qq = ref_probs(dl[pos], V, dec.temperature, dec.top_k, dec.top_p)
            assert c["position"][row] == i and c["token"][row] == x
            np.testing.assert_allclose(c["topk"][row], np.sort(qq)[::-1][:10], rtol=1e-4, atol=1e-6)
            # Token trees: the ids carry the stored probabilities; target_rank points at X_i among them.
            ids, rank = c["topk_ids"][row], int(c["target_rank"][row])
            assert len(set(ids.tolist())) == 10
            np.testing.assert_allclose(qq[ids], c["topk"][row], rtol=1e-4, atol=1e-6)
            assert ids[rank] == x if rank >= 0 else x not in ids.tolist()
            ent = -sum(v * np.log(v) for v in qq if v > 0)
            assert c["entropy"][row] == pytest.approx(ent, rel=1e-4, abs=1e-5)
            tv = 0.5 * sum(abs(a - b_) for a, b_ in zip(pp, qq))
            assert c["tv"][row] == pytest.approx(tv, abs=1e-5)
            assert c["accept_expected"][row] == pytest.approx(1 - tv, abs=1e-5)
            assert c["draft_argmax"][row] == int(np.argmax(qq))
            assert c["target_top1"][row] == int(np.argmax(pp))
            assert c["greedy_match"][row] == (int(np.argmax(qq)) == x)
            y = int(c["draft_token"][row])
            if dec.greedy:
                # Greedy decoding drafts the argmax and accepts it iff it is the target's token.
                assert y == int(np.argmax(qq))
                assert c["accept_prob"][row] == float(y == x) and c["verified"][row] == (y == x)
            else:
                # Y_i is the inverse-CDF sample of the seeded uniform: cdf(y-1) <= u < cdf(y).
                cdf = np.cumsum(qq)
                assert qq[y] > 0 and (cdf[y - 1] if y else 0.0) - 1e-5 <= u_s[i] * cdf[-1] <= cdf[y] + 1e-5
                assert c["accept_prob"][row] == pytest.approx(min(1.0, pp[y] / qq[y]), rel=1e-4, abs=1e-6)
                assert c["verified"][row] == (u_v[i] < c["accept_prob"][row])
            # Sampled replay's inputs: p_i(X_i), q_i(X_i) and the residual draw Y'_i.
            assert c["target_prob"][row] == pytest.approx(pp[x], rel=1e-4, abs=1e-7)
            assert c["draft_prob"][row] == pytest.approx(qq[x], rel=1e-4, abs=1e-7)
            rj = int(c["reject_token"][row])
            assert c["reject_draft_prob"][row] == pytest.approx(qq[rj], rel=1e-4, abs=1e-7)
            if dec.greedy:
                assert rj == int(np.argmax(qq))
            elif tv > 1e-6:
                assert qq[rj] > pp[rj]  # only the residual norm(max(q - p, 0)) is drawn from
            np.testing.assert_allclose(c["hidden"][row], h[len(p.ids) + i].numpy(), rtol=2e-3, atol=2e-3)


def test_labels_do_not_depend_on_batch_composition(pair, batch):
    prepared, resp = batch
    full = _teacher(pair, prepared, resp)
    alone = _teacher(pair, prepared[2:3], resp[2:3])
    s = slice(full.offsets[2], full.offsets[3])
    for col in ("draft_token", "verified", "greedy_match", "draft_argmax"):
        np.testing.assert_array_equal(full.columns[col][s], alone.columns[col])
    np.testing.assert_allclose(full.columns["accept_prob"][s], alone.columns["accept_prob"], atol=1e-5)


def test_sampling_is_unbiased():
    q = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    y = sample_from_uniform(q, uniforms(1, 2, "x", 20000))
    freq = torch.bincount(y, minlength=4).double() / 20000
    assert freq[1] == 0
    assert torch.allclose(freq, q[0].double(), atol=0.015)


def test_teacher_forcing_equals_step_by_step_generation(pair, batch):
    """Batched, left-padded teacher forcing reproduces each model's own KV-cached generation."""
    prepared, _ = batch
    eos = pair.tokenizer.eos_token_id
    V = pair.vocab_size
    for model in (pair.target, pair.draft):
        gens = [greedy_generate(model, p.ids, 16, V, eos) for p in prepared]
        out = forward_positions(model, [p.ids for p in prepared], [g[0] for g in gens], pair.tokenizer.pad_token_id)
        for b, (toks, step_logits) in enumerate(gens):
            for i, lg in enumerate(step_logits[: len(toks)]):
                tf = torch.softmax(out.logits[out.offsets[b] + i, :V].float(), -1)
                st = torch.softmax(lg[:V], -1)
                torch.testing.assert_close(tf, st, atol=2e-5, rtol=1e-4)


def _spec_decode_rounds(pair, prompt: list[int], K: int, max_new: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Plain greedy speculative decoding without KV cache. Returns (emitted tokens, [(start, n)])."""
    V = pair.vocab_size
    eos = set(eos_ids(pair))
    out: list[int] = []
    rounds = []
    while len(out) < max_new and not (out and out[-1] in eos):
        s = len(out)
        k_cap = min(K, max_new - s - 1)
        drafted: list[int] = []
        while len(drafted) < k_cap:
            y = int(full_logits(pair.draft, prompt + out + drafted)[-1, :V].argmax())
            drafted.append(y)
            if y in eos:
                break
        tl = full_logits(pair.target, prompt + out + drafted)[:, :V]
        base = len(prompt) + s - 1
        n = 0
        while n < len(drafted) and int(tl[base + n].argmax()) == drafted[n]:
            n += 1
        emitted = drafted[:n]
        if not (emitted and emitted[-1] in eos):
            emitted = emitted + [int(tl[base + n].argmax())]
        out.extend(emitted)
        rounds.append((s, n))
    return out, rounds


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_match_agrees_with_speculative_decoding(pair, batch, K):
    prepared, resp = batch
    max_new = 24
    t = _teacher(pair, prepared, resp)
    eos = set(eos_ids(pair))
    for b in range(2):  # two prompts keep the test fast
        p, r = prepared[b], resp[b]
        emitted, rounds = _spec_decode_rounds(pair, p.ids, K, max_new)
        assert emitted == r.ids  # greedy speculative decoding is lossless
        gm = t.columns["greedy_match"][t.offsets[b] : t.offsets[b + 1]]
        for s, n in rounds:
            k_cap = min(K, max_new - s - 1)
            pred = 0
            while pred < k_cap and s + pred < len(r.ids) and gm[s + pred]:
                pred += 1
                if r.ids[s + pred - 1] in eos:
                    break
            assert pred == n, f"K={K} round at {s}: labels say {pred} accepted, decoding accepted {n}"


def test_token_mixing_rows(pair, batch):
    prepared, resp = batch
    t = _teacher(pair, prepared, resp, hidden=True)
    rate, draws = 0.3, 2
    row_prompt, m = mixed_rows(
        pair, [p.record.prompt_id for p in prepared], [p.record.source_index for p in prepared],
        [p.ids for p in prepared], t, decoding=DecodingConfig(), k=10, seed=0, rate=rate, draws=draws,
        batch_size=3, chunk_rows=5,
    )
    V = pair.vocab_size
    r = 0
    for b, p in enumerate(prepared):
        x = t.columns["token"][t.offsets[b] : t.offsets[b + 1]]
        y = t.columns["draft_token"][t.offsets[b] : t.offsets[b + 1]]
        for d in range(draws):
            keep = mixing_keep_mask(0, p.record.source_index, d, len(x), rate)
            z = np.where(keep, x, y).tolist()
            seq = p.ids + z
            with torch.no_grad():
                o = pair.draft(input_ids=torch.tensor([seq]), output_hidden_states=True)
            for i in np.nonzero(~keep)[0]:
                assert row_prompt[r] == b and m["draw"][r] == d and m["position"][r] == i
                assert m["draft_token"][r] == y[i]
                assert m["accept_prob"][r] == t.columns["accept_prob"][t.offsets[b] + i]
                assert m["accept_expected"][r] == t.columns["accept_expected"][t.offsets[b] + i]
                qq = ref_probs(o.logits[0, len(p.ids) + i - 1].float(), V)
                np.testing.assert_allclose(m["topk"][r], np.sort(qq)[::-1][:10], rtol=1e-4, atol=1e-6)
                assert m["entropy"][r] == pytest.approx(-(qq[qq > 0] * np.log(qq[qq > 0])).sum(), rel=1e-4)
                h = o.hidden_states[-1][0, len(p.ids) + i].numpy()
                np.testing.assert_allclose(m["hidden"][r], h, rtol=2e-3, atol=2e-3)
                r += 1
    assert r == len(m["position"]) == len(row_prompt)
    assert 0 < r < len(t.columns["token"]) * draws


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["prefill", "shared-kv"])
def test_rollouts_equal_direct_greedy_generation(pair, batch, shared_prefix):
    # With shared_prefix the rollouts continue from the teacher-forced draft pass's KV cache.
    prepared, resp = batch
    t = teacher_labels(
        pair, [p.record.prompt_id for p in prepared], [p.record.source_index for p in prepared],
        [p.ids for p in prepared], [r.ids for r in resp], decoding=DecodingConfig(), k=10, seed=0,
        keep_draft_cache=shared_prefix,
    )
    c = t.columns
    mism = np.nonzero(c["draft_argmax"] != c["token"])[0]
    assert len(mism) >= 3
    prefixes, caps, starts = [], [], []
    for row in mism:
        b = int(np.searchsorted(t.offsets, row, side="right") - 1)
        m = int(c["position"][row])
        prefixes.append(prepared[b].ids + resp[b].ids[:m] + [int(c["draft_argmax"][row])])
        caps.append(rollout_cap(m, 8, 24))
        starts.append((b, m))
    caps[0] = 0  # a mismatch too late to roll out still gets a (length 0) row
    eos = eos_ids(pair)
    rolls = greedy_rollouts(
        pair.draft, prefixes, caps, vocab_size=pair.vocab_size, decoding=DecodingConfig(), k=10,
        eos_ids=eos, pad_id=pair.tokenizer.pad_token_id, hidden=True, batch_size=4,
        prefix=t.draft_prefix, starts=starts,
    )
    V = pair.vocab_size
    for pre, cap, ro in zip(prefixes, caps, rolls):
        if cap == 0:
            assert len(ro.tokens) == 0 and ro.hidden.shape[0] == 0
        else:
            toks, logits = greedy_generate(pair.draft, pre, cap, V, eos[0])
            assert ro.tokens.tolist() == toks
            for j, lg in enumerate(logits[: len(toks)]):
                qq = ref_probs(lg, V)
                np.testing.assert_allclose(ro.topk[j], np.sort(qq)[::-1][:10], rtol=1e-4, atol=1e-6)
                assert ro.entropy[j] == pytest.approx(-(qq[qq > 0] * np.log(qq[qq > 0])).sum(), rel=1e-4)
        with torch.no_grad():
            h = pair.draft(input_ids=torch.tensor([pre + ro.tokens.tolist()]), output_hidden_states=True).hidden_states[-1][0]
        np.testing.assert_allclose(ro.mismatch_hidden, h[len(pre) - 1].numpy(), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(ro.hidden, h[len(pre):].numpy(), rtol=2e-3, atol=2e-3)


def test_nan_logits_name_the_prompt(batch):
    bad = tiny_pair()
    with torch.no_grad():
        bad.draft.lm_head.weight[7] = float("nan")
    prepared, resp = batch
    with pytest.raises(FloatingPointError, match="prompt 'p0'"):
        _teacher(bad, prepared, resp)


def test_rollout_cap():
    assert rollout_cap(0, 20, 128) == 20
    assert rollout_cap(120, 20, 128) == 6
    assert rollout_cap(127, 20, 128) == 0
    assert DataGenConfig().labels.rollouts.splits == ["validation", "test"]


def test_captured_generate_logits_equal_teacher_forced_pass(pair, batch):
    # Labels from the logits generate computed equal those of a teacher-forced target pass.
    prepared, resp = batch
    cap = generate_responses(pair, prepared, GenerationConfig(max_new_tokens=24), seed=0, capture_logits=True)
    assert [r.ids for r in cap] == [r.ids for r in resp]
    tf = forward_positions(pair.target, [p.ids for p in prepared], [r.ids for r in resp], 0).logits
    torch.testing.assert_close(torch.cat([r.logits for r in cap]), tf[:], atol=2e-5, rtol=1e-4)
    a = _teacher(pair, prepared, resp)
    b = teacher_labels(
        pair, [p.record.prompt_id for p in prepared], [p.record.source_index for p in prepared],
        [p.ids for p in prepared], [r.ids for r in cap], decoding=DecodingConfig(), k=10, seed=0,
        chunk_rows=7, target_logits=[r.logits for r in cap],
    )
    for col in ("target_top1", "greedy_match", "draft_argmax", "draft_token", "verified"):
        np.testing.assert_array_equal(a.columns[col], b.columns[col])
    for col in ("tv", "accept_prob", "entropy"):
        np.testing.assert_allclose(a.columns[col], b.columns[col], atol=1e-5)


def test_row_logits_reads_rows_without_one_big_copy():
    from specstop.data_gen.forward import RowLogits

    block = torch.arange(3 * 5 * 4, dtype=torch.float32).reshape(3, 5, 4)
    lengths = [2, 0, 4]
    rows = RowLogits([block[b, 1 : 1 + n] for b, n in enumerate(lengths)])
    flat = torch.cat([block[b, 1 : 1 + n] for b, n in enumerate(lengths)])
    assert rows.shape == (6, 4) and len(rows) == 6
    torch.testing.assert_close(rows[:], flat)
    torch.testing.assert_close(rows[1:5], flat[1:5])
    idx = torch.tensor([5, 0, 3, 4])
    torch.testing.assert_close(rows[idx], flat[idx])
    torch.testing.assert_close(rows[2], flat[2])
    torch.testing.assert_close(rows[1:4, :2], flat[1:4, :2])
    torch.testing.assert_close(rows[idx, 3], flat[idx, 3])
    assert rows[np.array([], dtype=np.int64)].shape == (0, 4)
