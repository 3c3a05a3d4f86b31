"""The replay (eval) must count exactly what the real decoder (export) does.

One dataset from `specstop generate`'s runner on the tiny pair; for each policy, every prompt is
replayed from the dataset and decoded online with the speculative decoder, and the round-by-round
drafted/accepted counts and the totals must be identical. This ties together data_gen's labels and
rollouts, the replay's round rules and the decoder's KV-cache handling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _data_gen_helpers import make_render, records, replay_data_config

from specstop.data_gen.runner import generate_dataset
from specstop.data_gen.storage import load_table
from specstop.decode.chain import SpeculativeDecoder
from specstop.eval.episodes import load_replay_data
from specstop.eval.replay import ReplayTrace, replay_prompt
from specstop.eval.scoring import score_split
from specstop.export.runtime import StoppingPolicy
from specstop.models import build_predictor
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig
from specstop.testing import tiny_pair

MAX_NEW = 24
_DATA_DIR: dict = {}  # the module fixture's dataset folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    pair = tiny_pair(seed=3)
    out = tmp_path_factory.mktemp("replay_vs_decoder") / "data"
    cfg = replay_data_config(max_new_tokens=MAX_NEW, batch_size=3, rollout_length=20, prompts_per_shard=3)
    recs = records(6, splits=("test",))
    generate_dataset(pair, recs, cfg, out, render=make_render(pair.tokenizer), progress=False)
    _DATA_DIR["path"] = out
    data = load_replay_data(out, "test")
    torch.manual_seed(0)
    disco = build_predictor("disco_ffn").eval()
    spp = build_predictor("specdecpp_resnet", hidden_size=pair.draft_identity.hidden_size, depth=1).eval()
    # A DISCO head that also reads the state that produced q_j (with_state): scored on the previous
    # row's / rollout step's / mismatch's stored state in replay, on the live forward's in decoding.
    state = build_predictor("disco_ffn", with_state=True, hidden_size=pair.draft_identity.hidden_size).eval()
    with torch.no_grad():  # make the state part matter as much as the distribution part
        state.net[0].weight[:, -pair.draft_identity.hidden_size:] *= 20.0
    score_split(data, out, "test", "disco_ffn", disco)
    score_split(data, out, "test", "specdecpp_resnet", spp)
    score_split(data, out, "test", "disco_state", state)
    seqs = load_table(out, "sequences", "test")
    prompt_ids = {r["prompt_id"]: list(r["prompt_ids"]) for r in seqs}
    return pair, data, prompt_ids, {"disco_ffn": disco, "specdecpp_resnet": spp, "disco_state": state}


def _policies(data, predictors):
    # Thresholds at score quantiles so that learned policies really vary their round lengths.
    d = np.quantile(data.row_scores["disco_ffn"], 0.3)
    s = np.quantile(data.row_scores["specdecpp_resnet"], 0.5)
    w = np.quantile(data.row_scores["disco_state"], 0.3)
    return [
        PolicySpec(kind="static", k=1),
        PolicySpec(kind="static", k=3),
        PolicySpec(kind="static", k=6),
        PolicySpec(kind="heuristic", start=2),
        PolicySpec(kind="confidence", threshold=0.3, sl_max=8),
        PolicySpec(kind="confidence", rule="cumprod", threshold=0.5, sl_max=8),
        PolicySpec(kind="predictor", family="disco_ffn", rule="below", threshold=float(d), sl_max=8, reads="dist"),
        PolicySpec(kind="predictor", family="disco_ffn", rule="cumprod", threshold=0.6, sl_max=8, reads="dist"),
        PolicySpec(
            kind="predictor", family="specdecpp_resnet", rule="cumprod", threshold=float(1 - s), sl_max=10, reads="hidden"
        ),
        PolicySpec(kind="predictor", family="disco_ffn", rule="below", threshold=float(w), sl_max=8, reads="dist",
                   extra={"scores": "disco_state"}),
    ]


def test_decoder_counts_equal_replay(setup):
    pair, data, prompt_ids, predictors = setup
    checked = 0
    for spec in _policies(data, predictors):
        predictor = predictors.get(spec.extra.get("scores", spec.family)) if spec.kind == "predictor" else None
        for p in range(data.num_prompts):
            trace = ReplayTrace()
            counts = replay_prompt(data, p, spec, trace=trace)
            policy = StoppingPolicy.from_spec(spec, predictor)
            dec = SpeculativeDecoder(pair, policy, DecodingConfig(temperature=0.0))
            res = dec.generate(prompt_ids[str(data.prompt_ids[p])], max_new_tokens=MAX_NEW)
            ctx = f"policy {spec.label}, prompt {data.prompt_ids[p]}"
            assert list(res.round_lengths) == list(trace.k), ctx
            assert list(res.accepted_per_round) == list(trace.n), ctx
            assert res.counters["N"] == counts.n, ctx
            assert res.counters["N_target"] == counts.rounds, ctx
            assert res.counters["N_draft"] == counts.drafted, ctx
            assert res.counters["N_discarded"] == counts.discarded, ctx
            checked += 1
    assert checked == len(_policies(data, predictors)) * data.num_prompts


def test_policies_exercise_varied_rounds(setup):
    """Guard against a vacuous comparison: the policies above must produce mismatches, several
    round lengths, discarded tokens and rollout use."""
    _pair, data, _ids, predictors = setup
    assert (~data.greedy_match).sum() > 5
    for spec in _policies(data, predictors)[3:]:
        trace = ReplayTrace()
        discarded = 0
        for p in range(data.num_prompts):
            discarded += replay_prompt(data, p, spec, trace=trace).discarded
        assert len(set(trace.k)) >= 2, spec.label
        assert discarded > 0, spec.label


def test_state_head_reads_the_producing_state(setup):
    """The with_state head's scores depend on the state (else the equality above is vacuous for it),
    except at position 0, where the state is zeroed in replay as in decoding."""
    import copy

    _pair, data, _ids, predictors = setup
    state = predictors["disco_state"]
    blind = copy.deepcopy(state)
    with torch.no_grad():
        blind.net[0].weight[:, -state.feature_spec.hidden_size:] = 0.0
    scores = data.row_scores["disco_state"]
    score_split(data, _DATA_DIR["path"], "test", "disco_blind", blind)
    diff = np.abs(scores - data.row_scores["disco_blind"])
    pos0 = data.offsets[:-1]
    later = np.setdiff1d(np.arange(data.num_tokens), pos0)
    assert diff[pos0].max() < 1e-6
    assert diff[later].max() > 0.1


def test_online_check_replays_the_same_prompts_round_for_round(setup):
    """The online check's like-for-like prediction (same prompts, budget cut below the dataset's,
    the export's own predictor scoring the split) has the decoder's rounds on every prompt, and its
    speedup is the cost model priced on exactly those rounds."""
    from specstop.eval.cost import CostModel
    from specstop.eval.same_prompts import replay_policies
    from specstop.measure import online

    pair, data, prompt_ids, predictors = setup
    budget = MAX_NEW - 7  # cut responses: rounds near the new end are capped as the decoder caps them
    names = [str(p) for p in data.prompt_ids[::-1]]  # an order other than the split's
    specs = {s.label: s for s in _policies(data, predictors) if s.extra.get("scores") is None}
    policies = {label: StoppingPolicy.from_spec(s, predictors.get(s.family) if s.kind == "predictor" else None)
                for label, s in specs.items()}
    cost = CostModel(t_draft=0.02, t_target=0.1, target_by_k={0: 0.1, 1: 0.12, 8: 0.15, 16: 0.2},
                     policy_per_step={"confidence": 0.001, "disco_ffn": 0.002})
    same = replay_policies(_DATA_DIR["path"], "test", names, budget, policies, cost)
    methods = [online.decoder_method("target", SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1"),
                                                                  DecodingConfig()), max_draft=0, kind="baseline")]
    methods += [online.decoder_method(label, SpeculativeDecoder(pair, pol, DecodingConfig()), spec=pol.spec,
                                      same_prompts=same[label]) for label, pol in policies.items()]
    meas = online.measure([prompt_ids[n] for n in names], methods, max_new_tokens=budget, repeats=1)
    summary = online.summarize(meas, methods, baseline="target", cost=cost)
    for label in policies:
        row = summary["rows"][label]
        assert row["rounds_as_replayed"] == len(names), label
        assert same[label].tokens == [len(rs[0].tokens) for rs in meas.runs[label]], label
        # Same rounds, same pricing, same statistic: the replay is the cost model's prediction.
        assert row["replay_same_prompts"] == pytest.approx(row["predicted_decode_speedup"]), label
    assert max(max(len(h) for h in s.k_hists) for s in same.values()) > 2  # rounds of several lengths
    assert "replay (these prompts)" in online.to_markdown(summary)


def test_same_prompts_budget_above_the_dataset_is_refused(setup):
    from specstop.eval.same_prompts import applies, load_for_prompts

    assert applies({"temperature": 0.0, "max_new_tokens": MAX_NEW}, MAX_NEW)
    assert not applies({"temperature": 0.0, "max_new_tokens": MAX_NEW}, MAX_NEW + 1)
    # Sampled data predict sampled decoding at their own setting (over realisations), not greedy decoding.
    from specstop.probs import DecodingConfig

    assert not applies({"temperature": 1.0, "max_new_tokens": MAX_NEW}, MAX_NEW, DecodingConfig())
    assert applies({"temperature": 1.0, "max_new_tokens": MAX_NEW}, MAX_NEW, DecodingConfig(temperature=1.0))

    _pair, data, _ids, _pred = setup
    with pytest.raises(ValueError, match="dataset's budget"):
        load_for_prompts(_DATA_DIR["path"], "test", [str(data.prompt_ids[0])], MAX_NEW + 1)
    with pytest.raises(KeyError, match="no prompt"):
        load_for_prompts(_DATA_DIR["path"], "test", ["no-such-prompt"], MAX_NEW)


def test_heuristic_schedule_starts_over_for_each_sequence(setup):
    """One decoder reused across prompts (as every benchmark and server does) decodes a prompt the same
    whatever it decoded before: the heuristic schedule does not leak from one sequence to the next."""
    pair, data, prompt_ids, _pred = setup
    spec = PolicySpec(kind="heuristic", start=2)
    dec = SpeculativeDecoder(pair, StoppingPolicy.from_spec(spec), DecodingConfig())
    first, other = (prompt_ids[str(p)] for p in data.prompt_ids[:2])
    before = dec.generate(first, max_new_tokens=MAX_NEW).round_lengths
    dec.generate(other, max_new_tokens=MAX_NEW)
    trace = ReplayTrace()
    replay_prompt(data, 0, spec, trace=trace)
    assert list(dec.generate(first, max_new_tokens=MAX_NEW).round_lengths) == list(before) == list(trace.k)
