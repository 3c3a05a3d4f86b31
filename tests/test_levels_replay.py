"""The multi-level replay (specstop.eval.levels) re-runs MultiLevelDecoder's greedy rounds exactly: on a
record made with the stack's models (specstop.measure.level_record), every level's rounds, drafted and
accepted tokens and forwards equal the decoder's own counters, prompt by prompt and policy by policy; a
priced replay charges each forward by the tokens it feeds; joint tuning ranks the combinations by that
price; the level timing measures every model's forwards."""

from __future__ import annotations

import json

import pytest

from specstop.decode.chain import eos_token_ids
from specstop.decode.multilevel import MultiLevelDecoder
from specstop.errors import UserError
from specstop.eval.levels import (
    LevelCost,
    level_combos,
    level_grid,
    load_records,
    replay_levels,
    save_records,
    tune_levels,
)
from specstop.measure.level_cost import time_levels
from specstop.measure.level_record import record_levels
from specstop.testing import tiny_pair
from tests.test_multilevel import SHAPE, _noisy_copy

PROMPTS = [("a", [5, 9, 13, 2, 40]), ("b", [7, 7, 31]), ("c", [3])]
COMBOS = [["static:3", "static:2"], ["confidence:0.3", "confidence:0.5"], ["heuristic", "static:4"],
          ["static:1", "static:6"], ["confidence:0.5", "static:5"]]
BUDGET = 20


@pytest.fixture(scope="module")
def stack():
    pair = tiny_pair(seed=5, **SHAPE)
    middle = _noisy_copy(pair.target, 0.05, seed=1)
    records = record_levels([pair.draft, middle, pair.target], PROMPTS, BUDGET, COMBOS, vocab_size=pair.vocab_size,
                            eos=eos_token_ids(pair), progress=False)
    return pair, middle, records


@pytest.mark.parametrize("combo", COMBOS)
def test_the_replay_counts_what_the_decoder_ran(stack, combo):
    pair, middle, records = stack
    dec = MultiLevelDecoder(pair, [middle], combo)
    for (name, ids), rec in zip(PROMPTS, records):
        res = dec.generate(ids, BUDGET)
        rep = replay_levels([rec], combo)
        assert rec.path[: len(res.token_ids)] == res.token_ids and rep.tokens == [len(res.token_ids)], name
        for lv, got in enumerate(res.counters["levels"]):
            want = (got["rounds"], got["drafted"], got["accepted"], got["forwards"])
            have = (rep.rounds[lv], rep.drafted[lv], rep.accepted[lv], rep.forwards[lv])
            assert have == want, (name, combo, got["name"])


def test_a_response_that_ends_in_eos_replays_as_decoded():
    """The target's path ends at EOS before the budget: rounds that draft up to it stop there, and the
    replay still counts the decoder's forwards (the target's token after EOS is cut, as in the decoder)."""
    pair = tiny_pair(seed=5, **SHAPE)
    middle = _noisy_copy(pair.target, 0.05, seed=1)
    probe = record_levels([pair.draft, middle, pair.target], PROMPTS[:1], BUDGET, [], vocab_size=pair.vocab_size,
                          eos=eos_token_ids(pair), progress=False)[0]
    pair.target.generation_config.eos_token_id = probe.path[7]  # the 8th token of the response ends it
    eos = eos_token_ids(pair)
    assert probe.path[7] not in probe.path[:7]
    records = record_levels([pair.draft, middle, pair.target], PROMPTS[:1], BUDGET, COMBOS, vocab_size=pair.vocab_size,
                            eos=eos, progress=False)
    assert records[0].path == probe.path[:8]
    for combo in COMBOS:
        res = MultiLevelDecoder(pair, [middle], combo).generate(PROMPTS[0][1], BUDGET)
        rep = replay_levels(records, combo)
        assert res.token_ids == records[0].path and rep.tokens == [8]
        assert [lv["forwards"] for lv in res.counters["levels"]] == rep.forwards, combo


def test_a_priced_replay_charges_each_forward_by_its_rows(stack):
    _, _, records = stack
    flat = LevelCost(["d", "m", "t"], [{1: 1.0, 2: 1.0}, {1: 2.0}, {1: 4.0}])  # rows do not matter
    rep = replay_levels(records[:1], ["static:3", "static:2"], flat)
    assert rep.seconds[:3] == [rep.forwards[0] * 1.0, rep.forwards[1] * 2.0, rep.forwards[2] * 4.0]
    assert rep.per_prompt[0] == pytest.approx(rep.tokens[0] * 4.0 / sum(rep.seconds))
    by_rows = LevelCost(["d", "m", "t"], [{1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0}])
    rows = replay_levels(records[:1], ["static:3", "static:2"], by_rows)  # seconds = tokens fed (decode phase)
    fed = sum(rows.seconds[:3])
    assert fed > sum(rep.forwards) and rows.speedup == pytest.approx(rows.tokens[0] / fed)


def test_joint_tuning_ranks_the_grid_by_its_priced_replay(stack):
    pair, middle, _ = stack
    cost = LevelCost(["d", "m", "t"], [{1: 0.1, 2: 0.12}, {1: 0.3, 8: 0.5}, {1: 1.0, 8: 1.2}], policy_step=0.001)
    grids = [level_grid("static:1,static:3"), level_grid("static:2,static:4,confidence:0.4")]
    records = record_levels([pair.draft, middle, pair.target], PROMPTS[:2], BUDGET, level_combos(grids),
                            vocab_size=pair.vocab_size, eos=eos_token_ids(pair), progress=False)
    rows = tune_levels(records, grids, cost)
    assert len(rows) == 6 and [r["speedup"] for r in rows] == sorted((r["speedup"] for r in rows), reverse=True)
    best = rows[0]
    assert best["speedup"] == replay_levels(records, best["policies"], cost).speedup > 0


def test_records_round_trip_and_missing_prefixes_are_named(stack, tmp_path):
    _, _, records = stack
    save_records(tmp_path / "rec.json", records, {"models": ["d", "m", "t"]})
    again, meta = load_records(tmp_path / "rec.json")
    assert meta["models"] == ["d", "m", "t"] and json.loads((tmp_path / "rec.json").read_text())["records"]
    for combo in COMBOS:
        assert replay_levels(again, combo).forwards == replay_levels(records, combo).forwards
    with pytest.raises(UserError, match="record them too"):
        replay_levels(again, ["static:8", "static:12"])
    with pytest.raises(UserError, match="give 2 policies"):
        replay_levels(again, ["static:3"])
    with pytest.raises(UserError, match="unknown policy 'nonsense:3'"):
        level_grid("static:2,nonsense:3")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="not a multi-level record"):
        load_records(tmp_path / "bad.json")


def test_time_levels_measures_every_model_by_rows(stack, tmp_path):
    pair, middle, _ = stack
    cost = time_levels([pair.draft, middle, pair.target], ["d", "m", "t"], list(range(3, 40)), [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]],
                       vocab_size=pair.vocab_size, budget_s=0.0, progress=False)
    assert [sorted(t) for t in cost.forward] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert all(s > 0 for t in cost.forward for s in t.values()) and cost.policy_step > 0
    assert cost.seconds(2, 7) == pytest.approx(cost.forward[2][5] + 2 * (cost.forward[2][5] - cost.forward[2][4]))
    cost.save(tmp_path / "c.json")
    assert LevelCost.load(tmp_path / "c.json").forward == cost.forward
