"""Token-tree decoding: tree attention vs brute force, KV compaction, greedy equality, sampling chi-square."""

from __future__ import annotations

import json
import random

import pytest
import test_decoder as chain_tests
import test_decoder_sampling as sampling_tests
import torch
from _export_fixtures import single_thread  # noqa: F401

from specstop.decode import TreeDecoder, parse_tree_policy
from specstop.decode.chain import SpeculativeDecoder
from specstop.decode.drafting import grow_tree
from specstop.decode.token_tree import TokenTree, tree_attention_mask
from specstop.decode.tree_cache import TreeLM
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy
from specstop.pair.compat import cache_kwarg
from specstop.probs import DecodingConfig
from specstop.testing import pooled_chi_square, tiny_causal_lm, two_token_distribution
from specstop.tree_policy import DynamicTreeShape, StaticTreeShape

# The chain decoder's fixtures and constants: the same tiny pairs, prompts and target references.
prompts, references, MAX_NEW = chain_tests.prompts, chain_tests.references, chain_tests.MAX_NEW  # `pair`: tests/conftest.py
small_pair, DECODING, PROMPT, VOCAB = (
    sampling_tests.small_pair, sampling_tests.DECODING, sampling_tests.PROMPT, sampling_tests.VOCAB
)
TREE_SHAPES = ["mcsd:4,2,2,1", "mcsd:2,2", "mcsd:1,1,1,1", "tree:16", "tree:6,2,3", "tree:1"]


def _forests() -> dict[str, list[int]]:
    """Parent lists (region-relative, -1 = hangs off the prefix) of assorted shapes."""
    rng = random.Random(0)
    kconfig = TokenTree.rooted_at(0)
    level = [0]
    for k in (3, 2, 1):
        level = [kconfig.add(v, 0, 1.0) for v in level for _ in range(k)]
    return {
        "chain": [-1, 0, 1, 2, 3],
        "star": [-1, 0, 0, 0, 0],
        "kconfig_3_2_1": kconfig.parents,
        "two_roots": [-1, -1, 0, 1, 0, 2],
        "random": [-1] + [rng.randrange(i) for i in range(1, 12)],
    }


# ---------------------------------------------------------------- specs
@pytest.mark.parametrize(
    "text, expected",
    [
        ("mcsd:4,2,2,1", StaticTreeShape((4, 2, 2, 1))),
        ("mcsd:3", StaticTreeShape((3,))),
        ("tree:16", DynamicTreeShape(16, 4, 16)),
        ("tree:10,5,3", DynamicTreeShape(10, 5, 3)),
        ("static:4", None),
        ("runs/export", None),
    ],
)
def test_parse_tree_policy(text, expected):
    assert parse_tree_policy(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("mcsd", "needs its numbers"),
        ("tree:", "needs its numbers"),
        ("mcsd:4,x", "whole numbers"),
        ("mcsd:4,0", ">= 1"),
        ("tree:-2", ">= 1"),
        ("tree:4,8", "exceeds the node budget"),
        ("tree:4,2,2,2", "at most N, WIDTH and DEPTH"),
        ("mcsd:16,16,16", "at most 1024"),
    ],
)
def test_malformed_tree_policy_is_one_line(text, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        parse_tree_policy(text)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- tree attention
@pytest.mark.parametrize("name", list(_forests()))
def test_mask_and_positions_match_brute_force(name):
    parents, prefix = _forests()[name], 3
    mask, pos = tree_attention_mask(parents, prefix)
    n = len(parents)
    assert mask.shape == (1, 1, n, prefix + n) and pos.shape == (1, n)
    for i in range(n):
        chain, v = set(), i
        while v >= 0:
            chain.add(v)
            v = parents[v]
        assert int(pos[0, i]) == prefix + len(chain) - 1
        for j in range(prefix + n):
            visible = j < prefix or (j - prefix) in chain
            assert (mask[0, 0, i, j] == 0) == visible, (name, i, j)
    # Feeding the last rows later (cache holds the earlier ones) gives the same rows.
    tail_mask, tail_pos = tree_attention_mask(parents, prefix, num_new=2)
    assert torch.equal(tail_mask[0, 0], mask[0, 0, -2:]) and torch.equal(tail_pos[0], pos[0, -2:])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_tree_logits_equal_each_path_alone(attn):
    model = tiny_causal_lm(50, seed=3)
    model.set_attn_implementation(attn)
    prefix = [5, 7, 11, 13]
    rng = random.Random(1)
    for parents in _forests().values():
        tokens = [rng.randrange(50) for _ in parents]
        lm = TreeLM(model)
        lm.feed(prefix, keep_logits=1)
        lm.start_region()
        split = len(parents) // 2  # two forwards, as drafting feeds a tree level by level
        logits = torch.cat([lm.feed_nodes(tokens[:split], parents[:split]), lm.feed_nodes(tokens[split:], parents[split:])])
        for i in range(len(parents)):
            path, v = [], i
            while v >= 0:
                path.append(tokens[v])
                v = parents[v]
            alone = model(torch.tensor([prefix + path[::-1]])).logits[0, -1]
            torch.testing.assert_close(logits[i], alone, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_kv_compaction_equals_fresh_forward():
    from transformers import DynamicCache

    model = tiny_causal_lm(50, seed=4)
    prefix, tokens, parents = [3, 1, 4], [9, 2, 6, 5, 3, 5], [-1, 0, 0, 1, 2, 2]
    lm = TreeLM(model)
    lm.feed(prefix, keep_logits=1)
    lm.start_region()
    lm.feed_nodes(tokens, parents)
    lm.keep_path([0, 2, 5])  # tokens 9, 6, 5
    fresh = DynamicCache(config=model.config)
    model(torch.tensor([prefix + [9, 6, 5]]), **cache_kwarg(model, fresh), use_cache=True)
    assert lm.length == lm.cache.get_seq_length() == 6
    for kept, ref in zip(lm.cache.layers, fresh.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_caches_after_decoding_equal_fresh_forward(pair, prompts):
    dec = TreeDecoder(pair, parse_tree_policy("mcsd:4,2,2,1"))
    res = dec.generate(prompts[0], 12)
    assert res.counters["N_discarded"] > 0 and res.counters["stop_reason"] == "length"
    st = dec.last_state
    seq, draft, target = st["seq"], st["draft"], st["target"]
    # The target holds the accepted sequence but its last token; the draft the part it was fed.
    assert target.length == len(seq) - 1 == target.cache.get_seq_length()
    assert draft.length == draft.cache.get_seq_length() <= len(seq) - 1
    for lm, model in ((target, pair.target), (draft, pair.draft)):
        cont, _ = lm.feed(seq[lm.length :], keep_logits=1)
        fresh = model(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(cont[-1], fresh, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- greedy decoding
@pytest.mark.parametrize("spec", TREE_SHAPES)
def test_greedy_tree_equals_target(spec, pair, prompts, references):
    dec = TreeDecoder(pair, parse_tree_policy(spec))
    for ids, ref in zip(prompts, references):
        res = dec.generate(ids, MAX_NEW)
        assert res.token_ids == ref, f"{spec}: tree output differs from the target's greedy output"
        c = res.counters
        assert c["N"] == len(ref) and c["N_draft"] == sum(res.round_lengths)
        assert c["N_discarded"] == c["N_draft"] - sum(res.accepted_per_round)
        assert set(res.timings) >= {"prefill", "draft", "target", "accept", "rollback", "total", "round_seconds"}


def test_width_one_tree_is_the_chain(pair, prompts):
    """mcsd:1,1,1 drafts exactly what static:3 drafts: same rounds, same acceptances."""
    tree = TreeDecoder(pair, parse_tree_policy("mcsd:1,1,1")).generate(prompts[0], MAX_NEW)
    chain = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:3")).generate(prompts[0], MAX_NEW)
    assert tree.token_ids == chain.token_ids
    assert tree.round_lengths == chain.round_lengths and tree.accepted_per_round == chain.accepted_per_round


def test_trees_accept_more_per_round_than_their_widest_path(pair, prompts):
    """The second and later candidates get accepted (otherwise the equality tests say little)."""
    tree = TreeDecoder(pair, parse_tree_policy("mcsd:4,2,2,1")).generate(prompts[0], MAX_NEW)
    chain = TreeDecoder(pair, parse_tree_policy("mcsd:1,1,1,1")).generate(prompts[0], MAX_NEW)
    assert tree.counters["N_target"] < chain.counters["N_target"]


def test_length_and_eos_rules(pair, prompts):
    res = TreeDecoder(pair, parse_tree_policy("tree:12,3")).generate(prompts[0], 7)
    assert res.counters["N"] <= 7
    s = 0
    for n in res.accepted_per_round:
        assert n + 1 <= 7 - s
        s += n + 1
    base = TreeDecoder(pair, parse_tree_policy("mcsd:2,2")).generate(prompts[0], 7, max_draft=0)
    assert set(base.round_lengths) == {0}
    with pytest.raises(ValueError, match="empty"):
        TreeDecoder(pair, parse_tree_policy("mcsd:2")).generate([], 5)


def test_grown_trees_respect_shape_and_order(pair):
    """Static trees have the k-config's node count; dynamic ones the budget, siblings best-first."""
    q = torch.softmax(torch.randn(pair.vocab_size, generator=torch.Generator().manual_seed(0)), -1)

    def expand(tree, nodes):
        return q.expand(len(nodes), -1)

    tree, forwards = grow_tree(StaticTreeShape((4, 2, 2, 1)), 0, q, expand, depth_cap=4, eos=set(), greedy=True)
    assert tree.num_drafted == 44 and forwards == 3
    tree, _ = grow_tree(StaticTreeShape((4, 2, 2, 1)), 0, q, expand, depth_cap=2, eos=set(), greedy=True)
    assert tree.num_drafted == 12
    tree, forwards = grow_tree(DynamicTreeShape(16, 4, 16), 0, q, expand, depth_cap=16, eos=set(), greedy=True)
    assert tree.num_drafted == 16 and forwards == 3
    for kids in tree.children:
        scores = [tree.scores[c] for c in kids]
        assert scores == sorted(scores, reverse=True)
    for v in range(1, len(tree.tokens)):
        assert tree.scores[v] <= tree.scores[tree.parents[v]]


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("spec", ["mcsd:3,2", "tree:6,3"])
def test_sampled_tree_follows_the_target(spec, small_pair):
    exact = two_token_distribution(small_pair.target, PROMPT, DECODING, VOCAB)
    runs = 1000
    counts = dict.fromkeys(exact, 0)
    dec = TreeDecoder(small_pair, parse_tree_policy(spec), DECODING)
    later_child = 0
    for seed in range(runs):
        res = dec.generate(PROMPT, 3, seed=seed)
        counts[tuple(res.token_ids[:2])] += 1
        later_child += res.counters["N_discarded"] > 0 and res.accepted_per_round[0] > 0
    assert later_child > runs * 0.1, "rejected candidates must be common for the test to mean anything"
    stat, df, pvalue = pooled_chi_square(counts, exact, runs)
    assert pvalue > 1e-3, f"{spec}: chi-square {stat:.1f} on {df} df (p={pvalue:.2g}): not the target's distribution"


def test_sampled_children_stay_in_support(small_pair):
    """top-k 2 leaves two tokens: a node asked for 3 candidates gets 2, and every output is in the target's top 2."""
    dec = TreeDecoder(small_pair, parse_tree_policy("mcsd:3,3"), DecodingConfig(temperature=0.7, top_k=2))
    for seed in range(20):
        res = dec.generate(PROMPT, 3, seed=seed)
        assert max(res.round_lengths) <= 2 + 4
        seq = PROMPT + res.token_ids
        for i, tok in enumerate(res.token_ids):
            logits = small_pair.target(torch.tensor([seq[: len(PROMPT) + i]])).logits[0, -1, :VOCAB]
            assert tok in torch.topk(logits, 2).indices.tolist()


# ---------------------------------------------------------------- CLI
def test_decode_cli_tree_policies(tiny_pair_dir, capsys):
    from specstop.cli import main

    base = ["decode", "--pair", str(tiny_pair_dir), "--prompt", "hi", "--max-new-tokens", "8", "--dtype", "float32", "--device", "cpu"]
    for spec in ("mcsd:4,2,2,1", "tree:8"):
        assert main(base + ["--policy", spec, "--json"]) == 0
        obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert obj["counters"]["N"] == len(obj["token_ids"]) <= 8 and obj["counters"]["policy"].startswith(spec[:4])
    assert main(base + ["--policy", "mcsd:4,two"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mcsd:4,two" in err[0] and "whole numbers" in err[0]
    assert main(base + ["--policy", "tree:8", "--static-cache"]) == 2
    assert "drop --static-cache" in capsys.readouterr().err


def test_tree_rounds_priced_by_the_cost_model(pair, prompts):
    from specstop.eval.cost import CostModel
    from specstop.measure import online

    cost = CostModel(t_draft=0.01, t_target=0.1, target_by_k={0: 0.1, 4: 0.12, 16: 0.2}, provenance="measured")
    # Two tree rounds (8 and 3 nodes) and one target-only step; 5 tree expansions besides the 2 catch-up feeds.
    expected = cost.target_cost(8) + cost.target_cost(3) + cost.target_cost(0) + (2 + 5) * 0.01
    assert online.tree_round_seconds(cost, [8, 3, 0], 5) == pytest.approx(expected)
    tree = online.tree_method("ours mcsd:2,2", TreeDecoder(pair, parse_tree_policy("mcsd:2,2"), DecodingConfig()),
                              cost=cost)
    base = online.decoder_method("target", SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1")),
                                 max_draft=0, kind="baseline")
    meas = online.measure(prompts[:2], [base, tree], max_new_tokens=8, repeats=1)
    run = meas.runs["ours mcsd:2,2"][0][0]
    assert run.priced > 0 and run.k_hist is None
    row = online.summarize(meas, [base, tree], baseline="target", cost=cost)["rows"]["ours mcsd:2,2"]
    assert row["predicted_decode_speedup"] > 0 and row["predicted_round_seconds"] > 0 and row["greedy_diffs"] == 0
