"""Sampled (T > 0) replay: realisations of the acceptance draws conditioned on the recorded target
samples must count what the real speculative-sampling decoder counts (static and heuristic policies
are exact in expectation), tuning must run on sampled data, and Theorem 1 must hold non-circularly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _data_gen_helpers import make_render, records, replay_data_config

from specstop.data_gen.runner import generate_dataset
from specstop.data_gen.storage import load_table
from specstop.decode.chain import SpeculativeDecoder
from specstop.eval.episodes import from_arrays, load_replay_data
from specstop.eval.sampled import (
    accept_given_output,
    attach_sampled_columns,
    replayable,
    theorem1_check,
    virtual_replay_data,
)
from specstop.eval.segments import fast_replay
from specstop.export.runtime import StoppingPolicy
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig
from specstop.testing import tiny_pair

MAX_NEW = 12
T = 1.0


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    torch.set_num_threads(1)
    pair = tiny_pair(seed=7, noise=0.35)  # a draft far enough from the target to be rejected often
    out = tmp_path_factory.mktemp("sampled") / "data"
    cfg = replay_data_config(max_new_tokens=MAX_NEW, temperature=T, batch_size=8, rollout_length=3,
                            prompts_per_shard=16)
    recs = records(48, splits=("test",))
    generate_dataset(pair, recs, cfg, out, render=make_render(pair.tokenizer), progress=False)
    seqs = load_table(out, "sequences", "test")
    prompt_ids = {r["prompt_id"]: list(r["prompt_ids"]) for r in seqs}
    return pair, out, prompt_ids


def _decoder_tokens_per_round(pair, prompts, spec, seeds) -> tuple[float, float]:
    """Pooled N / N_target of the real decoder at T over prompts x seeds, and its standard error
    (from per-prompt means: prompts are the independent units)."""
    per_prompt = []
    for ids in prompts:
        n = r = 0
        for seed in seeds:
            dec = SpeculativeDecoder(pair, StoppingPolicy.from_spec(spec), DecodingConfig(temperature=T))
            res = dec.generate(ids, MAX_NEW, seed=seed)
            n += res.counters["N"]
            r += res.counters["N_target"]
        per_prompt.append(n / r)
    v = np.asarray(per_prompt)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v)))


def _replay_tokens_per_round(data, spec) -> tuple[float, float]:
    per_prompt = []
    n_p = data.virtual_prompts
    for p in range(n_p):
        idx = np.arange(p, data.num_prompts, n_p)  # prompt p in every realisation
        c = fast_replay(data.subset(idx), spec)
        per_prompt.append(c.n / c.rounds)
    v = np.asarray(per_prompt)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v)))


@pytest.mark.parametrize("spec", [PolicySpec(kind="static", k=3), PolicySpec(kind="heuristic", start=2)],
                         ids=lambda s: s.label)
def test_sampled_replay_counts_what_the_decoder_counts(sampled, spec):
    pair, out, prompt_ids = sampled
    data = load_replay_data(out, "test")
    assert data.temperature == T
    v = replayable(data, out, "test", repeats=64, max_steps=8)
    assert v.virtual_repeats == 64 and v.num_prompts == 64 * data.num_prompts
    rep, rep_se = _replay_tokens_per_round(v, spec)
    prompts = [prompt_ids[str(p)] for p in data.prompt_ids]
    dec, dec_se = _decoder_tokens_per_round(pair, prompts, spec, seeds=range(4))
    # Different target samples on both sides: agreement within 4 combined standard errors.
    assert abs(rep - dec) < 4 * np.hypot(rep_se, dec_se) + 1e-9, (rep, dec, rep_se, dec_se)
    assert 1.2 < dec < 3.9  # rejections happen (not a vacuous comparison) but drafts are accepted too


def _rounds_per_token(pair, data, v, prompts, spec, predictor, seeds):
    """Per prompt, rounds per emitted token: the replay's over its realisations of the recorded sample,
    the decoder's pooled over ``seeds`` fresh samples. Rounds per token is what latency is linear in (a
    round's price over the tokens it emits); tokens per round, its reciprocal, is not: a replay that
    conditions on one sample per prompt reads higher in tokens per round than decoding that draws new
    ones, by Jensen's inequality, though both count the same rounds in expectation."""
    n_p = v.virtual_prompts
    rep, dec = [], []
    for p, ids in enumerate(prompts):
        c = fast_replay(v.subset(np.arange(p, v.num_prompts, n_p)), spec)
        rep.append(c.rounds / c.n)
        n = r = 0
        for seed in seeds:
            res = SpeculativeDecoder(pair, StoppingPolicy(spec, predictor), DecodingConfig(temperature=T)).generate(
                ids, MAX_NEW, seed=seed)
            n += res.counters["N"]
            r += res.counters["N_target"]
        dec.append(r / n)
    return np.asarray(rep), np.asarray(dec)


@pytest.mark.parametrize("family", ["confidence", "disco_ffn"])
def test_sampled_replay_of_adaptive_and_learned_policies_meets_the_decoder(sampled, family):
    """A rule that reads the drafted token's probability and a learned DISCO head (its scores from the
    dataset in the replay, from the live draft in decoding): the replay's rounds per token against the
    decoder's over many seeds, paired per prompt."""
    from specstop.eval.scoring import score_split
    from specstop.models import build_predictor

    pair, out, prompt_ids = sampled
    data = load_replay_data(out, "test")
    torch.manual_seed(0)
    predictor = build_predictor("disco_ffn").eval() if family == "disco_ffn" else None
    if predictor is not None:
        score_split(data, out, "test", "disco_ffn", predictor)
    v = replayable(data, out, "test", repeats=64, max_steps=8)
    if predictor is None:  # a threshold the drafted tokens' probabilities cross often
        spec = PolicySpec(kind="confidence", threshold=float(np.quantile(v.top1, 0.3)), sl_max=8)
    else:
        spec = PolicySpec(kind="predictor", family="disco_ffn", rule="below", reads="dist", sl_max=8,
                          threshold=float(np.quantile(data.row_scores["disco_ffn"], 0.4)))
    prompts = [prompt_ids[str(p)] for p in data.prompt_ids]
    rep, dec = _rounds_per_token(pair, data, v, prompts, spec, predictor, seeds=range(6))
    diff = dec - rep
    se = diff.std(ddof=1) / np.sqrt(len(diff))
    assert abs(diff.mean()) < 4 * se + 1e-9, (rep.mean(), dec.mean(), se)
    assert 0.3 < dec.mean() < 0.9  # rounds both end early and run several tokens: not a vacuous check
    # The policy really adapts: its rounds differ in length within a prompt.
    lengths = SpeculativeDecoder(pair, StoppingPolicy(spec, predictor), DecodingConfig(temperature=T)).generate(
        prompts[0], MAX_NEW, seed=0).round_lengths
    assert len(set(lengths)) > 1, lengths


def test_virtual_copies_draw_acceptance_with_the_conditional_probability(sampled):
    _pair, out, _ids = sampled
    data = load_replay_data(out, "test")
    v = replayable(data, out, "test", repeats=200, max_steps=8)
    c = accept_given_output(data)
    t = data.num_tokens
    acc = v.greedy_match.reshape(200, t)
    # Per row the draws are Bernoulli(c_i): the total over rows and realisations within 4 sigma, and
    # rows with c_i = 1 (rejection impossible) always accepted.
    total, expect = acc.sum(), 200 * c.sum()
    assert abs(total - expect) < 4 * np.sqrt(200 * (c * (1 - c)).sum())
    assert acc[:, c >= 1.0].all()
    rejected = ~acc[0]
    s = data._sampled
    assert (v.draft_argmax[:t][rejected] == s["reject_token"][rejected]).all()
    np.testing.assert_allclose(v.top1[:t][rejected], s["reject_draft_prob"][rejected])
    np.testing.assert_allclose(v.top1[:t][~rejected], s["draft_prob"][~rejected])
    # Every rejected row has a continuation long enough for the replay (stored + on-path proxies).
    assert (v.rollout_of_row[:t][rejected] >= 0).all()


def test_a_rejection_near_an_early_eos_replays_at_any_length(sampled):
    """A response that ends with EOS long before max_new_tokens has no on-path rows to stand in for
    the draft's steps after a late rejection: the replay must still run any SL_max (pipeline crash)."""
    _pair, out, _ids = sampled
    data = load_replay_data(out, "test")
    ends = data.offsets[1:] - 1
    data.eos_token_ids = tuple(sorted({*data.eos_token_ids, *(int(t) for t in data.token[ends])}))
    early = data.is_eos(data.token)
    early[ends] = False
    keep = [p for p in range(data.num_prompts) if not early[data.offsets[p]:data.offsets[p + 1]].any()]
    assert len(keep) >= 2
    data.max_new_tokens = MAX_NEW + 20  # the kept responses now end with EOS well before their budget
    attach_sampled_columns(data, out, "test")
    v = virtual_replay_data(data, repeats=8, max_steps=20)
    v = v.subset(np.asarray([p + r * data.num_prompts for r in range(8) for p in keep]))
    c = fast_replay(v, PolicySpec(kind="static", k=20))
    assert c.n == v.num_tokens and c.rounds > v.num_prompts  # every token emitted; rejections happened


def test_theorem1_holds_on_the_recorded_samples(sampled):
    _pair, out, _ids = sampled
    data = load_replay_data(out, "test")
    v = replayable(data, out, "test", repeats=4, max_steps=8)
    chk = v.theorem1
    assert chk["sum_tv"] > 1.0
    assert abs(chk["difference"]) < 4 * chk["difference_se"]


def test_tune_and_eval_run_on_sampled_data(sampled, tmp_path):
    from specstop.cli import main

    _pair, out, _ids = sampled
    tuned = tmp_path / "tuned.json"
    assert main(["tune", "--data", str(out), "--split", "test", "--cost-model", "llama2-7b-70b",
                 "--out", str(tuned), "--sl-max-grid", "4,8", "--repeats", "8"]) == 0
    import json

    t = json.loads(tuned.read_text())
    assert t["sampled_replay"]["repeats"] == 8 and "static_opt" in t["policies"]
    rep_dir = tmp_path / "eval"
    assert main(["eval", "--data", str(out), "--split", "test", "--tuned", str(tuned), "--out", str(rep_dir),
                 "--mc-repeats", "8"]) == 0
    rep = json.loads((rep_dir / "report.json").read_text())
    assert rep["mode"].startswith("sampled replay")
    assert rep["rows"]["static_opt"]["latency_spread"]["repeats"] == 8
    assert "theorem1" in rep and "oracle" in rep["rows"]


def test_virtual_data_needs_sampled_columns():
    d = from_arrays(np.ones(4, bool), max_new_tokens=8, eos_token_id=99, token=np.arange(4), temperature=1.0)
    with pytest.raises(ValueError, match="attach_sampled_columns"):
        virtual_replay_data(d)
    d._sampled = {"target_prob": np.full(4, 0.5), "draft_prob": np.array([0.5, 0.25, 0.0, 1.0]),
                  "reject_token": np.full(4, 7), "reject_draft_prob": np.full(4, 0.1)}
    np.testing.assert_allclose(accept_given_output(d), [1.0, 0.5, 0.0, 1.0])
    chk = theorem1_check(d)
    assert chk["rejections_expected_at_samples"] == pytest.approx(1.5)


def test_the_same_prompts_prediction_pools_realisations_and_meets_seeded_decoding(sampled):
    """The online check's prediction for sampled data: R realisations per prompt pooled in prompt order,
    whose tokens per round agree with the decoder's over seeds (measure(seeds=True) decodes repeat r
    with seed r, so the repeats are different samples)."""
    from specstop.eval.cost import CostModel
    from specstop.eval.same_prompts import applies, replay_policies
    from specstop.measure import online

    pair, out, prompt_ids = sampled
    names = sorted(prompt_ids)[:12]
    cost = CostModel(t_draft=0.02, t_target=0.1)
    pol = StoppingPolicy.from_string("static:3")
    rep = replay_policies(out, "test", names, MAX_NEW, {"static": pol}, cost)["static"]
    assert rep.copies == 16 and rep.k_hists is None and len(rep.per_prompt) == len(names)
    # Pooled per prompt: prompt i's tokens are its 16 realisations' (each emits the recorded response).
    data = load_replay_data(out, "test")
    lengths = dict(zip(map(str, data.prompt_ids), data.lengths.tolist()))
    assert rep.tokens == [16 * lengths[n] for n in names]

    generation = {"temperature": T, "top_k": 0, "top_p": 1.0, "max_new_tokens": MAX_NEW}
    assert applies(generation, MAX_NEW) and applies(generation, MAX_NEW, DecodingConfig(temperature=T))
    assert not applies(generation, MAX_NEW, DecodingConfig())  # greedy decoding is another workload
    assert not applies(generation, MAX_NEW, DecodingConfig(temperature=0.7))
    assert not applies(generation, MAX_NEW + 1)

    decoding = DecodingConfig(temperature=T)
    methods = [online.decoder_method("target", SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1"), decoding),
                                     max_draft=0, kind="baseline"),
               online.decoder_method("static", SpeculativeDecoder(pair, pol, decoding), spec=pol.spec,
                                     same_prompts=rep)]
    prompts = [prompt_ids[n] for n in names]
    meas = online.measure(prompts, methods, max_new_tokens=MAX_NEW, repeats=6, progress=False, seeds=True)
    assert len({tuple(r.tokens) for r in meas.runs["static"][0]}) > 1  # each seed samples anew
    s = online.summarize(meas, methods, baseline="target", cost=cost, sampled=True)
    row = s["rows"]["static"]
    med, lo, hi = row["decode_speedup_seeds"]
    assert lo <= med <= hi
    assert row["replay_tokens_per_round"] == pytest.approx(rep.tokens_per_round)
    # 12 prompts x 6 seeds against 12 x 16 realisations of other samples: within 15%.
    assert row["tokens_per_round"] == pytest.approx(rep.tokens_per_round, rel=0.15)
    assert "; seeds " in online.to_markdown(s)
