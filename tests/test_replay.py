"""Exact greedy replay: hand-built answers, closed forms, the fast engine vs the reference."""

import numpy as np
import pytest

from specstop.eval.cost import PRESETS, CostModel
from specstop.eval.episodes import from_arrays
from specstop.eval.pearl import pearl_replay
from specstop.eval.replay import RolloutTooShortError, replay
from specstop.eval.segments import build_layout, fast_replay
from specstop.eval.synthetic import random_replay_data
from specstop.policy import PolicySpec, RoundPolicy

EOS = 99


def _counts(c):
    return (c.n, c.rounds, c.drafted, c.accepted)


def test_static_hand_built():
    # matches: T T F T T T T F T T ; length-stopped at max_new = 10.
    gm = [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    ro = {2: {"tokens": [5, 6, 7]}, 7: {"tokens": [5]}}
    d = from_arrays(gm, max_new_tokens=10, eos_token_id=EOS, token=np.arange(10), rollouts=ro)
    # K=3: round@0 drafts 0,1,2 (mismatch at 2): n=2, emits 3 -> s=3.
    # round@3 drafts 3,4,5 all match -> emits 4 (bonus 6) -> s=7.
    # round@7: remaining 3 -> cap 2: drafts 7 (mismatch) + rollout step 1 -> n=0, emits 1 -> s=8.
    # round@8: remaining 2 -> cap 1: drafts 8 -> match, bonus 9 -> s=10.
    c = replay(d, PolicySpec(kind="static", k=3))
    assert _counts(c) == (10, 4, 3 + 3 + 2 + 1, 2 + 3 + 0 + 1)
    assert c.discarded == 1 + 2
    assert _counts(fast_replay(d, PolicySpec(kind="static", k=3))) == _counts(c)


def test_a_policy_factory_replays_a_custom_rule_shape():
    # A rule that stops at the round's 2nd token replays exactly as static K=2; the stock policy
    # is the default, so a confidence spec still replays as confidence.
    class StopAtTwo(RoundPolicy):
        def should_stop(self, step):
            return step.j >= 2

    d = random_replay_data(n_prompts=6, tokens=40, seed=3)
    custom = replay(d, PolicySpec(kind="confidence", threshold=0.9), make_policy=StopAtTwo)
    assert _counts(custom) == _counts(replay(d, PolicySpec(kind="static", k=2)))
    conf = PolicySpec(kind="confidence", threshold=0.9)
    assert _counts(replay(d, conf)) == _counts(replay(d, conf, make_policy=RoundPolicy))
    assert _counts(replay(d, conf)) != _counts(custom)


def test_oracle_hand_built_and_eos():
    # EOS-ended response shorter than max_new: the accepted EOS ends it (no bonus after EOS).
    gm = [0, 1, 1, 1]
    d = from_arrays(
        gm, max_new_tokens=20, eos_token_id=EOS, token=[1, 2, 3, EOS], rollouts={0: {"tokens": [4] * 19}}
    )
    c = replay(d, PolicySpec(kind="oracle"))
    # round@0: K=0 target-only; round@1: drafts 1,2,3(EOS) all accepted, emits 3.
    assert _counts(c) == (4, 2, 3, 3) and c.target_only == 1
    s = replay(d, PolicySpec(kind="static", k=2))
    # round@0 drafts d_0 + rollout 1 -> n=0 emits 1; round@1 drafts 1,2 -> bonus EOS(3): emits 3.
    assert _counts(s) == (4, 2, 4, 2)
    s3 = replay(d, PolicySpec(kind="static", k=5))
    # round@1 drafts 1,2,3=EOS and stops at EOS: emits 3, no bonus.
    assert _counts(s3) == (4, 2, 5 + 3, 3)


def test_rollout_too_short_raises():
    gm = [1, 0, 1, 1, 1, 1]
    d = from_arrays(
        gm, max_new_tokens=50, eos_token_id=EOS, token=np.arange(6), rollouts={1: {"tokens": [1]}}
    )
    with pytest.raises(RolloutTooShortError, match="rollout-length"):
        replay(d, PolicySpec(kind="static", k=5))
    with pytest.raises(RolloutTooShortError, match="rollout-length"):
        fast_replay(d, PolicySpec(kind="static", k=5))


def static_closed_form(data, k):
    """Static K, no remaining-cap/EOS effects: a segment with l matches then a mismatch takes
    ceil((l+1)/(k+1)) rounds; r = (l+1) mod (k+1) > 0 means its last round reaches the mismatch,
    accepting r-1 and discarding k-r+1. A final all-match segment of length l' (ending in EOS)
    takes ceil(l'/(k+1)) rounds and drafts l' - rounds + [l' mod (k+1) != 0]."""
    rounds = drafted = accepted = 0
    for p in range(data.num_prompts):
        gm = data.greedy_match[data.offsets[p] : data.offsets[p + 1]]
        mism = np.flatnonzero(~gm)
        a = 0
        for m in mism:
            run = m - a
            q, r = divmod(run + 1, k + 1)
            rounds += q + (r > 0)
            drafted += (q + (r > 0)) * k
            accepted += q * k + (r - 1 if r > 0 else 0)
            a = m + 1
        lp = len(gm) - a
        if lp:
            q, r = divmod(lp, k + 1)
            nr = q + (r > 0)
            rounds += nr
            drafted += q * k + r
            accepted += q * k + r
    return rounds, drafted, accepted


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_static_closed_form(k):
    # EOS-ended responses far from max_new, long rollouts, no EOS inside rollouts/mismatches.
    d = random_replay_data(25, 60, seed=k, max_new_tokens=500, rollout_length=30, eos_rate=0.0)
    c = replay(d, PolicySpec(kind="static", k=k))
    assert (c.rounds, c.drafted, c.accepted) == static_closed_form(d, k)
    assert c.n == d.num_tokens


SPECS = [
    PolicySpec(kind="static", k=1),
    PolicySpec(kind="static", k=4),
    PolicySpec(kind="heuristic", start=1, sl_max=12),
    PolicySpec(kind="heuristic", start=5, sl_max=12),
    PolicySpec(kind="oracle"),
    PolicySpec(kind="confidence", threshold=0.4, sl_max=8),
    PolicySpec(kind="confidence", rule="cumprod", threshold=0.6, sl_max=8),
    PolicySpec(kind="predictor", family="dist", threshold=0.35, sl_max=10),
    PolicySpec(kind="predictor", family="dist", rule="cumprod", threshold=0.5, sl_max=10),
    PolicySpec(kind="predictor", family="hidden", reads="hidden", threshold=0.45, sl_max=12),
    PolicySpec(kind="predictor", family="hidden", reads="hidden", rule="cumprod", threshold=0.7, sl_max=12),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_engine_equals_reference(seed):
    # Length-stopped and EOS-ended responses, EOS in rollouts and mismatches, quantised (tied) scores.
    d = random_replay_data(20, 50, seed=seed, max_new_tokens=50 + 10 * seed, score_levels=None if seed else 8)
    lay = build_layout(d)
    for spec in SPECS:
        ref = replay(d, spec)
        assert ref.n == d.num_tokens
        assert ref.to_dict() == fast_replay(d, spec, lay).to_dict(), spec.label


@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_never_slower(seed):
    d = random_replay_data(20, 60, seed=seed)
    costs = [
        PRESETS["llama2-7b-70b"],
        PRESETS["reference-cpu"],
        CostModel(0.01, 0.1, predictor_per_step=0.005),
    ]
    for cost in costs:
        orc = replay(d, PolicySpec(kind="oracle")).metrics(cost)["latency_per_token"]
        for spec in SPECS:
            assert orc <= replay(d, spec).metrics(cost)["latency_per_token"] + 1e-12, spec.label


def test_pearl_emits_every_token_and_costs():
    d = random_replay_data(10, 40, seed=3)
    m = pearl_replay(d, PRESETS["llama2-7b-70b"])
    assert m["n"] == d.num_tokens
    assert m["gamma"] == 5
    assert m["latency_per_token"] > 0
    # All matches: one pre-verify phase then post-verify phases of gamma tokens.
    d2 = from_arrays(np.ones(30, bool), max_new_tokens=30, eos_token_id=EOS, token=np.arange(30))
    m2 = pearl_replay(d2, CostModel(t_draft=0.02, t_target=0.1))
    assert m2["n"] == 30
    assert m2["n_target"] < 30 / 4


def test_every_eos_id_ends_a_response():
    # Qwen2.5 Instruct lists two EOS ids ([151645, 151643]); a response may end with either, and the
    # draft stops drafting at either. Same hand-built answers as test_oracle_hand_built_and_eos with
    # the response ending in the second id.
    eos_ids = [EOS, EOS + 1]
    gm = [0, 1, 1, 1]
    d = from_arrays(
        gm, max_new_tokens=20, eos_token_id=eos_ids, token=[1, 2, 3, EOS + 1], rollouts={0: {"tokens": [4] * 19}}
    )
    assert d.eos_token_ids == (EOS, EOS + 1)
    assert _counts(replay(d, PolicySpec(kind="oracle"))) == (4, 2, 3, 3)
    for k in (2, 5):
        spec = PolicySpec(kind="static", k=k)
        assert _counts(fast_replay(d, spec)) == _counts(replay(d, spec))
    assert _counts(replay(d, PolicySpec(kind="static", k=5))) == (4, 2, 5 + 3, 3)
    assert pearl_replay(d, CostModel(t_draft=0.02, t_target=0.1))["n"] == 4


def test_manifest_eos_lists_load(tmp_path):
    # A manifest whose generation.eos_token_id is a list (the target's generation config had several)
    # used to crash replay with int(list).
    import json

    from specstop.eval.episodes import eos_tuple, load_replay_data
    from specstop.testing import SYNTHETIC_EOS, write_synthetic_dataset

    assert eos_tuple([151645, 151643]) == (151643, 151645)
    assert eos_tuple(7) == (7,) and eos_tuple(None) == ()
    data = write_synthetic_dataset(tmp_path / "d", {"validation": 2}, tokens_per_prompt=12, with_rollouts=True)
    man_path = data / "manifest.json"
    man = json.loads(man_path.read_text())
    man["generation"]["eos_token_id"] = [SYNTHETIC_EOS, SYNTHETIC_EOS + 1]
    man_path.write_text(json.dumps(man))
    d = load_replay_data(data, "validation")
    assert d.eos_token_ids == (SYNTHETIC_EOS, SYNTHETIC_EOS + 1)
    spec = PolicySpec(kind="static", k=3)
    assert _counts(fast_replay(d, spec)) == _counts(replay(d, spec))


def test_a_round_that_drops_the_failing_token_pays_its_draft_step():
    # llama.cpp's p_min: the draft ends *before* a token below the threshold (drafted, not proposed).
    top1 = [0.9, 0.9, 0.3, 0.9, 0.9, 0.9]
    d = from_arrays([1] * 6, max_new_tokens=6, eos_token_id=EOS, token=np.arange(6), top1=top1)
    spec = PolicySpec(kind="confidence", threshold=0.5, sl_max=8)
    # round@0: tokens 0, 1 proposed, token 2 drafted and dropped; the target emits token 2 -> s=3.
    # round@3: remaining 3 -> cap 2: tokens 3, 4 (both above tau) -> bonus 5 -> s=6.
    dropped = replay(d, spec, drop_failing=True)
    assert _counts(dropped) == (6, 2, 4, 4) and dropped.unproposed == 1
    assert list(dropped.k_hist) == [0, 0, 2]
    # specstop's rule proposes token 2 and stops after it: round@0 K=3 -> s=4; round@4: cap 1 -> s=6.
    kept = replay(d, spec)
    assert _counts(kept) == (6, 2, 4, 4) and kept.unproposed == 0 and list(kept.k_hist) == [0, 1, 0, 1]
    cost = CostModel(t_draft=0.01, t_target=0.1, target_by_k={0: 0.05, 1: 0.1, 2: 0.12, 3: 0.14})
    seconds = 2 * (2 * 0.01 + 0.12) + 1 * 0.01  # two K=2 rounds and the dropped token's step
    assert dropped.metrics(cost)["latency_per_token"] == pytest.approx(seconds / 6)
    assert dropped.metrics(cost)["speedup"] == pytest.approx(cost.target_only_per_token / (seconds / 6))


def test_a_mismatch_at_the_dropped_token_leaves_every_proposed_token_accepted():
    # The draft's token 2 is wrong *and* below tau: dropped, so tokens 0, 1 are the whole proposal.
    top1 = [0.9, 0.9, 0.3, 0.9]
    d = from_arrays([1, 1, 0, 1], max_new_tokens=4, eos_token_id=EOS, token=np.arange(4), top1=top1,
                    rollouts={2: {"tokens": [7, 8], "top1": [0.9, 0.9]}})
    c = replay(d, PolicySpec(kind="confidence", threshold=0.5, sl_max=8), drop_failing=True)
    # round@0: K=2, both accepted, the target emits token 2 -> s=3; round@3: remaining 1 -> target-only.
    assert _counts(c) == (4, 2, 2, 2) and c.unproposed == 1 and c.target_only == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_dropping_never_fires_below_every_score_and_always_fires_above(seed):
    d = random_replay_data(n_prompts=5, tokens=40, seed=seed)
    never = PolicySpec(kind="confidence", threshold=0.0, sl_max=4)
    assert _counts(replay(d, never, drop_failing=True)) == _counts(replay(d, PolicySpec(kind="static", k=4)))
    always = replay(d, PolicySpec(kind="confidence", threshold=1.0 + 1e-9, sl_max=4), drop_failing=True)
    # every round drops its first token: a target-only step that paid one draft step, except the last
    # step of a response at the budget (nothing left to draft)
    lengths = np.diff(d.offsets)
    may_draft = int(sum(min(n, d.max_new_tokens - 1) for n in lengths))
    assert always.drafted == 0 and always.rounds == always.n == always.target_only
    assert always.unproposed == may_draft > 0
