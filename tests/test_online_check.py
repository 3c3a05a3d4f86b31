"""The online check's statistics: fastest of repeats, median of per-prompt ratios, bootstrap interval,
measured-vs-predicted flags, round costs - on synthetic runs (no models)."""

from __future__ import annotations

import numpy as np
import pytest

from specstop.eval.cost import CostModel
from specstop.measure import online


def _run(seconds: float, k_hist: list[int] | None = None, tokens: int = 10, prefill: float = 0.0) -> online.Run:
    rounds = None if k_hist is None else int(sum(k_hist))
    return online.Run(tokens=list(range(tokens)), seconds=seconds, prefill=prefill, k_hist=k_hist, rounds=rounds,
                      phases={"draft": 0.0}, round_seconds=seconds - prefill)


def _measurement(runs: dict[str, list[list[online.Run]]]) -> online.Measurement:
    first = next(iter(runs.values()))
    return online.Measurement(prompts=len(first), repeats=len(first[0]), max_new_tokens=10, runs=runs)


def test_one_slowed_repeat_does_not_move_the_speedup():
    # 4 prompts x 2 repeats; the baseline's and the method's 2nd repeat of prompt 1 hit a 10x slowdown
    # from other load. The fastest repeat per prompt ignores it.
    base = [[_run(10.0, [10]), _run(10.0, [10])] for _ in range(4)]
    meth = [[_run(5.0, [0, 0, 5]), _run(5.0, [0, 0, 5])] for _ in range(4)]
    base[1][1] = _run(100.0, [10])
    meth[1][1] = _run(50.0, [0, 0, 5])
    methods = [online.Method("target", None, "baseline"), online.Method("ours", None)]
    s = online.summarize(_measurement({"target": base, "ours": meth}), methods, baseline="target")
    med, lo, hi = s["rows"]["ours"]["speedup"]
    assert med == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    # Seconds per round: the median over runs, not a sum an outlier dominates.
    assert s["rows"]["ours"]["round_seconds"] == pytest.approx(1.0)


def test_sampled_runs_compare_time_per_token():
    # Sampled outputs differ in length: a method that stopped at EOS after 4 tokens in 2 s is not
    # "2.5x faster" than a baseline that ran 10 tokens in 5 s - it is as fast per token.
    base = [[_run(5.0, [10], tokens=10)] for _ in range(4)]
    meth = [[_run(2.0, [0, 2], tokens=4)] for _ in range(4)]
    methods = [online.Method("target", None, "baseline"), online.Method("ours", None)]
    meas = _measurement({"target": base, "ours": meth})
    assert online.summarize(meas, methods, baseline="target", sampled=True)["rows"]["ours"]["speedup"][0] == (
        pytest.approx(1.0))
    assert online.summarize(meas, methods, baseline="target")["rows"]["ours"]["speedup"][0] == pytest.approx(2.5)


def test_median_of_per_prompt_ratios_with_a_bootstrap_interval():
    ratios = [1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]
    base = [[_run(10.0, [10])] for _ in ratios]
    meth = [[_run(10.0 / r, [0, 5])] for r in ratios]
    methods = [online.Method("target", None, "baseline"), online.Method("ours", None)]
    s = online.summarize(_measurement({"target": base, "ours": meth}), methods, baseline="target")
    med, lo, hi = s["rows"]["ours"]["speedup"]
    assert med == pytest.approx(np.median(ratios))
    assert min(ratios) <= lo <= med <= hi <= max(ratios) and hi > lo


def test_measured_and_predicted_more_than_ten_percent_apart_are_flagged():
    cost = CostModel(t_draft=0.1, t_target=0.2, t_target_single=0.2, target_by_k={0: 0.2, 1: 0.2, 4: 0.2},
                     provenance="measured")
    # One round drafting 4 tokens per run: predicted round cost 4 * 0.1 + 0.2 = 0.6 s for 10 tokens,
    # target alone 10 * 0.2 = 2 s -> predicted decode speedup 2 / 0.6 = 3.33x.
    base = [[_run(2.0, [10])] for _ in range(3)]
    close = [[_run(0.62, [0, 0, 0, 0, 1])] for _ in range(3)]
    far = [[_run(1.0, [0, 0, 0, 0, 1])] for _ in range(3)]
    methods = [online.Method("target", None, "baseline"), online.Method("close", None), online.Method("far", None)]
    s = online.summarize(_measurement({"target": base, "close": close, "far": far}), methods, baseline="target",
                         cost=cost)
    assert s["rows"]["close"]["predicted_decode_speedup"] == pytest.approx(2.0 / 0.6)
    assert s["rows"]["close"]["predicted_round_seconds"] == pytest.approx(0.6)
    assert s["rows"]["close"]["flags"] == []
    # No phases measured (every live price at the table's): the live prediction is the table's, flagged alike.
    assert len(s["rows"]["far"]["flags"]) == 2 and all("predicted" in f for f in s["rows"]["far"]["flags"])
    md = online.to_markdown(s)
    assert "| far |" in md and "90% bootstrap interval" in md


def test_the_live_prediction_prices_the_counts_with_the_steps_this_run_paid():
    """The table said 0.1 s per draft step; the run paid 0.2 s (its phases say so), and the target's steps
    what the table said. Priced by the table the round is 0.6 s (3.33x predicted); at live prices 1.0 s
    (2.0x), which is what was measured."""
    cost = CostModel(t_draft=0.1, t_target=0.2, t_target_single=0.2, target_by_k={0: 0.2, 1: 0.2, 4: 0.2},
                     provenance="measured")

    def run(seconds, hist, draft, target):
        r = _run(seconds, hist)
        r.phases = {"draft": draft, "predictor": 0.0, "target": target}
        return r

    base = [[run(2.0, [10], 0.0, 2.0)] for _ in range(3)]
    slow_draft = [[run(1.0, [0, 0, 0, 0, 1], 0.8, 0.2)] for _ in range(3)]
    methods = [online.Method("target", None, "baseline"), online.Method("m", None)]
    s = online.summarize(_measurement({"target": base, "m": slow_draft}), methods, baseline="target", cost=cost)
    row = s["rows"]["m"]
    assert row["live_scales"] == {"draft": pytest.approx(2.0), "decision": 1.0, "verify": pytest.approx(1.0),
                                  "single": pytest.approx(1.0)}
    assert row["predicted_decode_speedup"] == pytest.approx(2.0 / 0.6)
    assert row["live_predicted_decode_speedup"] == pytest.approx(2.0)
    assert [f for f in row["flags"] if "live" in f] == []
    assert "- m: draft 2.00x, verification 1.00x, target-only step 1.00x" in online.to_markdown(s)


def test_methods_run_interleaved_after_a_warm_up():
    calls: list[tuple[str, int]] = []

    def method(name):
        def fn(ids, max_new):
            calls.append((name, max_new))
            return _run(1.0)
        return online.Method(name, fn)

    prompts = [[1], [2], [3]]
    meas = online.measure(prompts, [method("a"), method("b")], max_new_tokens=20, repeats=2, warmup_tokens=4,
                          progress=False)
    assert calls[:2] == [("a", 4), ("b", 4)]  # warm-up first, short
    timed = calls[2:]
    assert len(timed) == 2 * 3 * 2
    # Every consecutive pair of timed calls is one prompt run by both methods.
    for i in range(0, len(timed), 2):
        assert {timed[i][0], timed[i + 1][0]} == {"a", "b"}
    assert all(len(rs) == 2 for rs in meas.runs["a"])


def test_paired_comparison_with_a_reference_cancels_prompt_difficulty():
    # Prompts differ 3x in difficulty, so each method's speedup over the target spreads widely, but
    # "learned" is 10% faster than "static" on every prompt: the paired ratio says so exactly.
    from specstop.eval.same_prompts import SamePromptsReplay

    hard = [1.0, 1.5, 2.0, 2.5, 3.0, 1.2, 2.2, 2.8]
    base = [[_run(10.0, [10])] for _ in hard]
    static = [[_run(3.0 * h, [0, 0, 2])] for h in hard]
    learned = [[_run(3.0 * h / 1.1, [0, 0, 0, 2])] for h in hard]
    far = [[_run(3.0 * h / 1.1, [0, 0, 0, 2])] for h in hard]

    def replay(ratio: float) -> SamePromptsReplay:
        per = [ratio / h for h in hard]
        return SamePromptsReplay(float(np.median(per)), [[0, 0, 2]] * len(hard), [10] * len(hard), per)

    methods = [online.Method("target", None, "baseline"), online.Method("static", None, same_prompts=replay(3.0)),
               online.Method("learned", None, same_prompts=replay(3.3)),
               online.Method("far", None, same_prompts=replay(4.5))]
    s = online.summarize(_measurement({"target": base, "static": static, "learned": learned, "far": far}), methods,
                         baseline="target", reference="static")
    spread = s["rows"]["learned"]["speedup"]
    assert spread[2] - spread[1] > 0.3  # against the target: wide
    med, lo, hi = s["rows"]["learned"]["vs_reference"]
    assert med == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    assert s["rows"]["learned"]["vs_reference_predicted"] == pytest.approx(1.1)
    assert not any("vs static" in f for f in s["rows"]["learned"]["flags"])
    assert any("vs static" in f for f in s["rows"]["far"]["flags"])  # replay said 1.5x, measured 1.1x
    assert "vs_reference" not in s["rows"]["static"]
    assert "Against `static`, paired per prompt" in online.to_markdown(s)
    with pytest.raises(ValueError, match="reference method"):
        online.summarize(_measurement({"target": base, "static": static}), methods[:2], baseline="target",
                         reference="nope")
