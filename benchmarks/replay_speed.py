"""Replay / exact-tuning speed on synthetic data (CPU, numpy).

    python benchmarks/replay_speed.py [--tokens 1000000] [--match-rate 0.75]

Measures: building the slot layout, one exact threshold sweep (every breakpoint) per rule at
SL_max = 20, the full tuner grid (SL_max in {4, 8, 12, 16, 20}) for one predictor, static K = 1..20,
and, for scale, the step-by-step reference replay on a 1% subset.
"""

from __future__ import annotations

import time

from specstop.eval.cost import PRESETS
from specstop.eval.replay import replay
from specstop.eval.segments import build_layout, sweep
from specstop.eval.synthetic import random_replay_data
from specstop.eval.tune import tune_static, tune_threshold
from specstop.policy import PolicySpec
from specstop.script_args import ScriptParser, positive_int, unit_interval
from specstop.script_main import run_main


def main() -> None:
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=1_000_000)
    ap.add_argument("--tokens-per-prompt", type=positive_int, default=500)
    ap.add_argument("--match-rate", type=unit_interval, default=0.75)
    args = ap.parse_args()
    if args.tokens < args.tokens_per_prompt:
        ap.error(f"--tokens {args.tokens} is less than one prompt (--tokens-per-prompt {args.tokens_per_prompt})")
    n_prompts = args.tokens // args.tokens_per_prompt
    t0 = time.perf_counter()
    data = random_replay_data(
        n_prompts,
        args.tokens_per_prompt,
        seed=0,
        match_rate=args.match_rate,
        rollout_length=20,
        vary_lengths=False,
        eos_end=False,
    )
    print(
        f"data: {data.num_tokens} tokens, {data.num_prompts} prompts, {len(data.r_offsets) - 1} mismatches "
        f"(generated in {time.perf_counter() - t0:.1f}s)"
    )
    cost = PRESETS["llama2-7b-70b"]
    t = time.perf_counter()
    layout = build_layout(data)
    print(
        f"layout: {time.perf_counter() - t:.2f}s ({len(layout.pos)} slots, {len(layout.seg_start)} segments)"
    )
    rules = {
        "confidence (below, dist)": PolicySpec(kind="confidence", sl_max=20),
        "DISCO-like (below, dist)": PolicySpec(kind="predictor", family="dist", sl_max=20),
        "MCSD-hidden-like (below, hidden)": PolicySpec(
            kind="predictor", family="hidden", reads="hidden", sl_max=20
        ),
        "SpecDec++-like (cumprod, hidden)": PolicySpec(
            kind="predictor", family="hidden", reads="hidden", rule="cumprod", sl_max=20
        ),
    }
    for name, spec in rules.items():
        t = time.perf_counter()
        curve = sweep(data, spec, layout)
        print(f"exact sweep {name}: {time.perf_counter() - t:.2f}s, {len(curve.b)} breakpoints")
    t = time.perf_counter()
    tune_threshold(data, rules["DISCO-like (below, dist)"], cost, (4, 8, 12, 16, 20), layout=layout)
    print(f"full tune grid (5 SL_max x all breakpoints), DISCO-like: {time.perf_counter() - t:.2f}s")
    t = time.perf_counter()
    tune_threshold(data, rules["SpecDec++-like (cumprod, hidden)"], cost, (4, 8, 12, 16, 20), layout=layout)
    print(f"full tune grid, SpecDec++-like: {time.perf_counter() - t:.2f}s")
    t = time.perf_counter()
    tune_static(data, cost, 20, layout=layout)
    print(f"static K = 1..20: {time.perf_counter() - t:.2f}s")
    sub = data.subset(list(range(max(1, n_prompts // 100))))
    t = time.perf_counter()
    replay(sub, PolicySpec(kind="predictor", family="dist", threshold=0.4, sl_max=20))
    dt = time.perf_counter() - t
    print(
        f"reference step-by-step replay, ONE threshold, {sub.num_tokens} tokens: {dt:.2f}s "
        f"(~{dt * data.num_tokens / sub.num_tokens:.0f}s per threshold at full size)"
    )


if __name__ == "__main__":
    run_main(main, __file__)
