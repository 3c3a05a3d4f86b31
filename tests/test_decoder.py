"""SpeculativeDecoder: greedy equality with the target, counters vs a cache-free recount, KV rollback."""

from __future__ import annotations

import pytest
import torch
from _export_fixtures import random_exports, single_thread, tiny_prompts  # noqa: F401

from specstop.decode.chain import SpeculativeDecoder, eos_token_ids
from specstop.export.runtime import StoppingPolicy

MAX_NEW = 24
POLICIES = ["static:1", "static:3", "static:5", "heuristic", "confidence:0.4", "confidence:0.02", "disco", "sdpp"]


@pytest.fixture(scope="module")
def prompts(pair):
    return tiny_prompts(pair, ("hello world", "def f(x):", "zz"))


@pytest.fixture(scope="module")
def references(pair, prompts):
    """The target's own greedy output, restricted to the shared vocabulary (design: padded rows dropped)."""
    padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
    out = []
    for ids in prompts:
        gen = pair.target.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, suppress_tokens=padded)
        out.append(gen[0, len(ids) :].tolist())
    return out


def make_policy(name, exports, pair):
    if name in exports:
        return StoppingPolicy.from_pretrained(exports[name], draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)
    return StoppingPolicy.from_string(name)


@torch.no_grad()
def brute_force(pair, policy, prompt, max_new):
    """The design.md round rules with no KV caches: every distribution from a fresh full forward."""
    V, eos = pair.vocab_size, eos_token_ids(pair)
    policy.configure(vocab_size=V)
    out, ks, ns = [], [], []
    counters = {"N_target": 0, "N_draft": 0, "N_discarded": 0}
    while len(out) < max_new:
        s = len(out)
        k_cap = min(policy.cap(), max_new - s - 1)
        if k_cap <= 0:
            t = int(pair.target(torch.tensor([prompt + out])).logits[0, -1, :V].argmax())
            out.append(t)
            counters["N_target"] += 1
            ks.append(0)
            ns.append(0)
            if t in eos:
                break
            continue
        policy.reset()
        drafted = []
        for j in range(1, k_cap + 1):
            o = pair.draft(torch.tensor([prompt + out + drafted]), output_hidden_states=True)
            logits, h = o.logits[0, -1], o.hidden_states[-1][0, -1]
            y = int(logits[:V].argmax())
            stop = policy.should_stop(logits, h if j > 1 else None, s + j - 1)
            drafted.append(y)
            if stop or j == k_cap or y in eos:
                break
        k = len(drafted)
        tl = pair.target(torch.tensor([prompt + out + drafted])).logits[0, -(k + 1) :, :V].argmax(-1).tolist()
        n = 0
        while n < k and drafted[n] == tl[n]:
            n += 1
        emitted = drafted[:n] + [tl[n]]
        for i, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: i + 1]
                break
        policy.end_round(k, n)
        counters["N_target"] += 1
        counters["N_draft"] += k
        counters["N_discarded"] += k - n
        ks.append(k)
        ns.append(n)
        out.extend(emitted)
        if out[-1] in eos:
            break
    counters["N"] = len(out)
    return out, counters, ks, ns


@pytest.mark.parametrize("name", POLICIES)
def test_greedy_equals_target_and_recount(name, pair, prompts, references, exports):
    for i, (ids, ref) in enumerate(zip(prompts, references)):
        policy = make_policy(name, exports, pair)
        res = SpeculativeDecoder(pair, policy).generate(ids, MAX_NEW)
        assert res.token_ids == ref, f"{name}: speculative output differs from the target's greedy output"
        assert set(res.timings) >= {"draft", "target", "predictor", "total"}
        if i > 0:
            continue  # the cache-free recount is slow; one prompt per policy is enough
        bf_out, bf_counters, ks, ns = brute_force(pair, make_policy(name, exports, pair), ids, MAX_NEW)
        assert bf_out == res.token_ids
        for key, val in bf_counters.items():
            assert res.counters[key] == val, (name, key)
        assert res.round_lengths == ks and res.accepted_per_round == ns


def test_policies_actually_vary_lengths(pair, prompts, exports):
    """The learned exports make both decisions on the tiny pair (otherwise the equality test is weak)."""
    for name in ("disco", "sdpp"):
        res = SpeculativeDecoder(pair, make_policy(name, exports, pair)).generate(prompts[0], MAX_NEW)
        assert len(set(res.round_lengths)) > 1, (name, res.round_lengths)


def test_static_cache_path_greedy_equal(pair, prompts, references):
    res = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:4"), static_cache=True, max_cache_len=256).generate(prompts[1], MAX_NEW)
    assert res.token_ids == references[1]


def test_compiled_static_cache_path_greedy_equal(pair, prompts, references):
    # The GPU configuration (StaticCache + torch.compile of both forwards) run on the CPU: lossless.
    # Compiling takes about a minute on 2 cores (one graph per fed length), hence one short prompt.
    dec = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:2"), compile=True, max_cache_len=128)
    res = dec.generate(prompts[1], 10)
    assert res.token_ids == references[1][:10]


def test_compiled_draft_is_lossless_and_compiles_once(pair, prompts, references):
    """compile_draft: the draft's one- and two-token feeds under torch.compile over a static cache, the target
    eager. Greedy output equals the target's; a second request at the same cache length reuses the graphs."""
    from torch._dynamo.utils import counters

    dec = SpeculativeDecoder(pair, StoppingPolicy.from_string("confidence:0.3"), compile_draft=True)
    first = dec.generate(prompts[1], 12)
    assert first.token_ids == references[1][:12]
    assert dec.last_state["draft"].static and not dec.last_state["target"].static
    graphs = counters["stats"]["unique_graphs"]
    again = dec.generate(prompts[0], 12)
    assert again.token_ids == references[0][:12]
    assert counters["stats"]["unique_graphs"] == graphs, "a second request at the same cache length recompiled"
    assert set(again.round_lengths) - {0}, "no round drafted: the compiled draft steps never ran"


@torch.no_grad()
def test_kv_rollback_matches_fresh_forward(pair, prompts):
    dec = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:5"))
    res = dec.generate(prompts[0], 20)
    assert res.counters["N_discarded"] > 0, "no rejection happened; the rollback test needs one"
    st = dec.last_state
    seq, draft, target = st["seq"], st["draft"], st["target"]
    # The target cache holds exactly the accepted prefix (all but the last emitted token).
    assert target.length == len(seq) - 1 == target.cache.get_seq_length()
    assert draft.length == draft.cache.get_seq_length() <= len(seq) - 1
    for lm, model in ((target, pair.target), (draft, pair.draft)):
        cont, _ = lm.feed(seq[lm.length :], keep_logits=1)
        fresh = model(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(cont[-1], fresh, atol=1e-4, rtol=1e-4)


def test_eos_and_length_rules(pair, prompts):
    res = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:20")).generate(prompts[0], 7)
    assert res.counters["N"] <= 7
    # Every round drafts at most remaining - 1 tokens.
    s = 0
    for k, n in zip(res.round_lengths, res.accepted_per_round):
        assert k <= 7 - s - 1
        s += n + 1
    with pytest.raises(ValueError, match="empty"):
        SpeculativeDecoder(pair, StoppingPolicy.from_string("static:2")).generate([], 5)


def test_decode_cli_json(tmp_path, capsys):
    import json

    from specstop.cli import main
    from specstop.testing import save_tiny_pair

    save_tiny_pair(tmp_path / "pair")
    args = ["decode", "--pair", str(tmp_path / "pair"), "--prompt", "hi", "--policy", "static:3", "--max-new-tokens", "8", "--json", "--dtype", "float32", "--device", "cpu"]
    assert main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    obj = json.loads(line)
    assert obj["counters"]["N"] == len(obj["token_ids"]) <= 8 and "text" in obj
