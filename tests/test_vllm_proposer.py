"""specstop's vLLM proposer (specstop.decode.vllm_proposer) without vLLM: vLLM's calls simulated.

A loop plays vLLM's part as ``gpu_model_runner`` does for a ``custom_class`` proposer: after every
target step it calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` with the rows
of the running requests (in another order every step, and a request joining late), verifies the
drafts greedily with the target and appends the accepted tokens plus one. Every draft is then
checked against a cache-free recomputation: the tokens are the draft's argmax and the draft stops
exactly where the policy (run afresh on full-context features) says. The vLLM engine itself runs
the proposer in tests/test_vllm_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _export_fixtures import per_setting_copy, random_exports, single_thread  # noqa: F401 - tiny models run faster on one thread

from specstop.decode.vllm_proposer import SpecstopProposer, dynamic_k_lookup
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy

MAX_LEN = 160


def _config(draft, policy, k_max=6, schedule=None, max_seqs=4):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k_max, num_speculative_tokens_per_batch_size=schedule),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, dtype=torch.float32),
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
        additional_config={"specstop": {"draft": str(draft), "policy": policy}},
    )


@pytest.fixture(scope="module")
def loaded(tiny_pair_dir):
    from specstop.pair.loader import load_pair

    return load_pair(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def exports(tmp_path_factory, loaded):
    return random_exports(tmp_path_factory.mktemp("vllm_exports"), loaded)


def _greedy(model, ids, vocab):
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1, :vocab].argmax())


def _simulate(proposer, pair, prompts, max_new, join_late=1):
    """vLLM's decode loop around ``proposer``; returns the outputs and every round (context, drafts, rows)."""
    vocab = pair.vocab_size
    seqs, sampled, active = {}, {}, []
    for r, p in enumerate(prompts):
        seqs[r] = list(p) + [_greedy(pair.target, p, vocab)]  # prefill emits the first token
        sampled[r] = [seqs[r][-1]]
    rounds, step = [], 0
    pending = list(range(len(prompts)))
    active, pending = pending[:len(prompts) - join_late], pending[len(prompts) - join_late:]
    while active or pending:
        step += 1
        if step == 3:  # a request joins while others run
            active, pending = active + pending, []
        rows = active[::-1] if step % 2 else list(active)  # vLLM reorders rows as requests come and go
        table = np.zeros((8, MAX_LEN), dtype=np.int32)
        lengths = np.zeros(8, dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, :len(seqs[r])] = seqs[r]
            lengths[i] = len(seqs[r])
        drafts = proposer.propose([sampled[r] for r in rows], lengths, table)
        assert len(drafts) == len(rows)
        for r, d in zip(rows, drafts):
            rounds.append((list(seqs[r]), list(d), len(rows), len(prompts[r])))
            new = []
            for y in d:  # greedy verification: leading matches, then the target's own token
                t = _greedy(pair.target, seqs[r] + new, vocab)
                if t != y:
                    break
                new.append(y)
            new.append(_greedy(pair.target, seqs[r] + new, vocab))
            seqs[r] += new
            sampled[r] = new
        active = [r for r in active if len(seqs[r]) - len(prompts[r]) < max_new]
    return [seqs[r][len(prompts[r]):][:max_new] for r in range(len(prompts))], rounds


def _check_rounds(rounds, pair, policy_arg, k_max, k_by_batch=None):
    """Each draft: the draft's greedy tokens, stopped where a fresh policy stops on cache-free features."""
    vocab = pair.vocab_size
    if isinstance(policy_arg, dict):
        from specstop.policy import PolicySpec

        ref = StoppingPolicy.from_spec(PolicySpec.from_dict(policy_arg))
    else:
        ref = StoppingPolicy.load(policy_arg)
    ref.configure(None, vocab)
    eos = {pair.tokenizer.eos_token_id}
    lengths = []
    for context, drafts, batch, prompt_len in rounds:
        cap = min(k_max, ref.spec.cap, MAX_LEN - len(context) - 1)
        if k_by_batch is not None:
            cap = min(cap, k_by_batch[batch])
        assert 1 <= len(drafts) <= cap
        with torch.no_grad():
            out = pair.draft(torch.tensor([context + drafts]), output_hidden_states=True)
        ref.reset()
        n = len(context)
        for j, y in enumerate(drafts, start=1):
            q = out.logits[0, n - 2 + j]
            assert y == int(q[:vocab].argmax())
            h = out.hidden_states[-1][0, n - 2 + j] if ref.needs_hidden else None
            stop = ref.should_stop(q, h, position=n - prompt_len + j - 1, draft_token=y)
            last = j == len(drafts)
            assert (stop or j == cap or y in eos) == last, (context, drafts, j)
        lengths.append(len(drafts))
    return lengths


@pytest.mark.parametrize("policy", [
    {"kind": "confidence", "threshold": 0.1, "sl_max": 5},  # about half the tiny draft's top-1 are below 0.1
    {"kind": "static", "k": 3},
    "disco",   # learned: DISCO on the draft distribution (export folder)
    "sdpp",    # learned: SpecDec++ on the draft's hidden states
])
def test_drafts_stop_where_the_policy_says_and_output_is_the_targets(policy, tiny_pair_dir, loaded, exports):
    arg = str(exports[policy]) if isinstance(policy, str) else policy
    proposer = SpecstopProposer(_config(tiny_pair_dir / "draft", arg))
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 9, 9, 9, 9], [3, 70]]
    outs, rounds = _simulate(proposer, loaded, prompts, max_new=20)
    for p, o in zip(prompts, outs):  # vLLM's verification keeps the target's greedy output
        ref, seq = [], list(p)
        for _ in range(20):
            ref.append(_greedy(loaded.target, seq, loaded.vocab_size))
            seq.append(ref[-1])
        assert o == ref
    lengths = _check_rounds(rounds, loaded, arg, 6)
    if policy != {"kind": "static", "k": 3}:
        assert len(set(lengths)) > 1, lengths  # the policy stops drafts at different lengths
    assert proposer.stats["rounds"] == len(rounds)


def test_heuristic_learns_per_request(tiny_pair_dir, loaded):
    """The heuristic schedule (+2 after a fully accepted round, -1 otherwise) is kept per request."""
    proposer = SpecstopProposer(_config(tiny_pair_dir / "draft", {"kind": "heuristic", "start": 2, "sl_max": 6}))
    outs, rounds = _simulate(proposer, loaded, [[5, 6, 7, 8], [40, 41, 42]], max_new=24, join_late=0)
    by_prompt: dict[int, list] = {}
    for context, drafts, _, prompt_len in rounds:
        by_prompt.setdefault(prompt_len, []).append((context, drafts))
    for seq in by_prompt.values():
        k = 2
        for (context, drafts), nxt in zip(seq, seq[1:] + [None]):
            want = min(k, 6, MAX_LEN - len(context) - 1)
            assert len(drafts) == want or (len(drafts) < want and drafts[-1] == loaded.tokenizer.eos_token_id)
            if nxt is None:
                break
            accepted = len(nxt[0]) - len(context) - 1
            k = k + 2 if accepted == len(drafts) else max(1, k - 1)


def test_batch_schedule_caps_drafts(tiny_pair_dir, loaded):
    schedule = [[1, 1, 5], [2, 4, 2]]
    proposer = SpecstopProposer(_config(tiny_pair_dir / "draft", {"kind": "static", "k": 5}, schedule=schedule))
    _, rounds = _simulate(proposer, loaded, [[5, 6, 7, 8], [40, 41, 42]], max_new=16, join_late=1)
    lookup = dynamic_k_lookup(schedule, 4, 6)
    lengths = _check_rounds(rounds, loaded, {"kind": "static", "k": 5}, 6, k_by_batch=lookup)
    assert {b for _, _, b, _ in rounds} == {1, 2} and set(lengths) == {2, 5}


def test_dynamic_k_lookup_follows_vllms_rule():
    # gaps keep the previous K, batch sizes past the last range keep its K, every K clamped to the maximum
    assert dynamic_k_lookup([[1, 2, 4], [5, 6, 9], [8, 8, 0]], 10, 6) == [0, 4, 4, 4, 4, 6, 6, 6, 0, 0, 0]
    with pytest.raises(UserError, match="starting at 1"):
        dynamic_k_lookup([[2, 4, 3]], 4, 6)
    for schedule in ([[1, "many", 3]], [[1, 4]], [3]):  # not [lo, hi, K] triples of integers
        with pytest.raises(UserError, match=r"list of \[lo, hi, K\]"):
            dynamic_k_lookup(schedule, 4, 6)


def test_settings_are_required(tiny_pair_dir):
    cfg = _config(tiny_pair_dir / "draft", {"kind": "confidence"})
    cfg.additional_config = {}
    with pytest.raises(UserError, match="additional_config"):
        SpecstopProposer(cfg)
    with pytest.raises(UserError, match="export folder"):
        SpecstopProposer(_config(tiny_pair_dir / "draft", {"kind": "predictor", "family": "disco_ffn"}))


@pytest.mark.parametrize("key, value", [
    ("cost_sweep", ["a", 2]),  # was a ValueError from int()
    ("cost_sweep", ["1", "2"]),  # was taken as [1, 2]
    ("allow_draft_mismatch", "false"),  # was taken as true
    ("live_pricing", "no"),  # was taken as on
    ("draft", 3),
])
def test_settings_of_the_wrong_type_are_one_line_naming_them(tiny_pair_dir, key, value):
    cfg = _config(tiny_pair_dir / "draft", {"kind": "confidence", "threshold": 0.5, "sl_max": 4})
    cfg.additional_config["specstop"][key] = value
    with pytest.raises(UserError, match=f"SpecstopProposer: config key 'specstop.{key}' must be") as err:
        SpecstopProposer(cfg)
    assert "\n" not in str(err.value)


def test_a_quantized_draft_proposes_its_own_argmax_and_stays_lossless(tiny_pair_dir, loaded, exports, tmp_path):
    """``draft_quant``: the proposer drafts with the int4 copy of the draft (every linear replaced), its drafts
    are that copy's argmax stopped where the policy says, and the output is still the target's."""
    from specstop.pair.quantize import PREFILL_ROWS

    policy = {"kind": "confidence", "threshold": 0.1, "sl_max": 5}
    cfg = _config(tiny_pair_dir / "draft", policy)
    cfg.additional_config["specstop"]["draft_quant"] = "int4"
    proposer = SpecstopProposer(cfg)
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    outs, rounds = _simulate(proposer, loaded, prompts, max_new=16, join_late=0)
    assert proposer.stats["draft_quant"]["scheme"] == "int4" and proposer.stats["draft_quant"]["layers"] > 0
    assert not any(type(m) is torch.nn.Linear for m in proposer.model.modules())
    for p, o in zip(prompts, outs):
        seq = list(p)
        for t in o:
            assert t == _greedy(loaded.target, seq, loaded.vocab_size)
            seq.append(t)
    # Every block the proposer fed here was under PREFILL_ROWS rows (packed kernels); the brute-force check
    # feeds whole sequences, so it runs the packed kernels at any length too.
    for m in proposer.model.modules():
        if hasattr(m, "prefill_rows"):
            assert m.prefill_rows == PREFILL_ROWS["int4"]
            m.prefill_rows = None
    quantized = SimpleNamespace(draft=proposer.model, vocab_size=loaded.vocab_size, tokenizer=loaded.tokenizer)
    _check_rounds(rounds, quantized, policy, 6)
    costs = proposer.engine_costs()  # rows of one request each step here: B = 1 and 2
    assert set(costs["draft_per_token"]) <= {1, 2} and all(v > 0 for v in costs["draft_per_token"].values())
    assert all(k.split("x")[0] in ("1", "2") for k in costs["target_step"])
    # a learned export read the float draft's features: refused on the quantized copy unless allowed
    cfg = _config(tiny_pair_dir / "draft", str(exports["disco"]))
    cfg.additional_config["specstop"]["draft_quant"] = "int4"
    with pytest.raises(UserError, match="allow_draft_mismatch"):
        SpecstopProposer(cfg)
    cfg.additional_config["specstop"]["allow_draft_mismatch"] = True
    assert SpecstopProposer(cfg).draft_quant == "int4"
    # an export trained on the int4 draft's data (generate --draft-quant int4) runs on it, and not on the float one
    import json
    import shutil

    int4_export = tmp_path / "disco_int4"
    shutil.copytree(exports["disco"], int4_export)
    config = json.loads((int4_export / "config.json").read_text())
    config["pair"]["draft"]["quant"] = "int4"
    (int4_export / "config.json").write_text(json.dumps(config))
    cfg = _config(tiny_pair_dir / "draft", str(int4_export))
    cfg.additional_config["specstop"]["draft_quant"] = "int4"
    assert SpecstopProposer(cfg).draft_quant == "int4"
    with pytest.raises(UserError, match="features of the int4 draft, and this proposer runs the float draft"):
        SpecstopProposer(_config(tiny_pair_dir / "draft", str(int4_export)))


def test_cost_sweep_drafts_exactly_each_k_and_times_it(tiny_pair_dir, loaded):
    """``cost_sweep`` (calibrate-cost --engine vllm): every row drafts exactly K tokens, K cycling over the
    grid per step whatever the policy says; the timings are keyed by the rows and K, and turn into a cost model."""
    from specstop.measure.engine_cost import cost_model_from_engine

    cfg = _config(tiny_pair_dir / "draft", {"kind": "confidence", "threshold": 0.99, "sl_max": 6})  # would stop at 1
    cfg.additional_config["specstop"]["cost_sweep"] = [0, 1, 3, 5]
    proposer = SpecstopProposer(cfg)
    _, rounds = _simulate(proposer, loaded, [[5, 6, 7, 8]], max_new=40, join_late=0)
    # K = sweep[step % 5], from step 1: each 0 is followed by a settling step at the largest K, which feeds the
    # draft what the skipped step left out, so that K = 1 is timed without that catch-up
    assert proposer.cost_sweep == [0, 5, 1, 3, 5]
    assert [len(d) for _, d, _, _ in rounds][:10] == [5, 1, 3, 5, 0, 5, 1, 3, 5, 0]
    calls = [n for rows, n, _ in proposer.timings.calls if rows == 1]
    assert sum(n == 5 for n in calls) > len(proposer.timings.call["1x5"])  # the settling calls price no round
    assert len(proposer.timings.call["1x1"]) == sum(n == 1 for n in calls)  # and every K = 1 call prices one
    costs = proposer.engine_costs()
    assert {"1x0", "1x1", "1x3", "1x5"} <= set(costs["draft_call"]) and {"1x1", "1x2", "1x4", "1x6"} <= set(costs["target_step"])
    cost = cost_model_from_engine(costs, engine="vllm test", name="sweep", machine={"cpu": "test"})
    assert cost.provenance == "measured" and cost.machine["engine"] == "vllm test" and cost.t_draft >= 0
    assert set(cost.target_by_k) == {0, 1, 3, 5}
    with pytest.raises(UserError, match="cost_sweep must be"):
        cfg.additional_config["specstop"]["cost_sweep"] = [-1]
        SpecstopProposer(cfg)


@pytest.fixture
def per_setting_export(tmp_path, exports):
    """The static export, tuned per setting: K 3 for greedy requests, K 1 at T = 1."""
    return per_setting_copy(exports["static"], tmp_path / "per_setting",
                            {(0.0, 1.0): {"kind": "static", "k": 3}, (1.0, 1.0): {"kind": "static", "k": 1}})


def test_a_policy_per_setting_runs_the_entry_the_settings_name_and_says_which_without_one(
        tiny_pair_dir, per_setting_export, caplog):
    import logging

    cfg = _config(tiny_pair_dir / "draft", str(per_setting_export))
    with caplog.at_level(logging.WARNING, logger="specstop"):
        proposer = SpecstopProposer(cfg)  # was: the greedy entry, silently
    assert proposer.policy.spec.k == 3
    [line] = [r.getMessage() for r in caplog.records]
    assert "every request runs policy" in line and "(the greedy entry of by_decoding)" in line
    assert "set specstop.decoding to their setting" in line
    caplog.clear()

    cfg.additional_config["specstop"]["decoding"] = {"temperature": 1.0}
    with caplog.at_level(logging.WARNING, logger="specstop"):
        proposer = SpecstopProposer(cfg)
    assert proposer.policy.spec.k == 1 and proposer.policy.label.endswith("@ T=1") and not caplog.records
    assert proposer.decoding.temperature == 1.0  # the features' transform too


@pytest.mark.parametrize("value, says", [
    ({"temperature": "hot"}, r"specstop.decoding.temperature must be a number, got 'hot'"),
    ({"top_k": 2.5}, r"specstop.decoding.top_k must be an integer >= 0"),
    ("greedy", r"specstop.decoding must be a mapping of temperature, top_k and top_p"),
])
def test_a_decoding_setting_that_is_not_valid_is_one_line(tiny_pair_dir, per_setting_export, value, says):
    cfg = _config(tiny_pair_dir / "draft", str(per_setting_export))
    cfg.additional_config["specstop"]["decoding"] = value
    with pytest.raises(UserError, match="SpecstopProposer: " + says) as err:
        SpecstopProposer(cfg)
    assert "\n" not in str(err.value)
