"""How much do the target's one-row and few-row steps drift between processes and minutes on this machine?

Every speedup specstop predicts is a ratio to the target's one-token step, priced by a calibration made
minutes earlier (often in another process). This script starts ``--processes`` fresh Python processes one
after another; each loads the target, and times ``--reps`` interleaved decode steps of 1, 2, 3 ... rows
(``--rows``) after a prefill of ``--context`` tokens (raw ``transformers`` forwards with a DynamicCache,
nothing of specstop's decoders), and reports their medians. Steps that drift together cancel in a
speedup; a one-row step that moves against the multi-row ones moves every prediction with it.

    python benchmarks/step_drift.py --pair qwen2.5-coder-0.5b-1.5b --dtype bfloat16 --processes 4

Found on a 2-core AMD EPYC (Zen 4, avx512_bf16), the reference pair in bf16, 108 tokens of context, four
processes in a row: one row 0.215 / 0.219 / 0.251 / 0.266 s, two rows 0.192 / 0.217 / 0.219 / 0.237 s -
a drift of up to 24% within five minutes, the one-row / two-row ratio between 1.01 and 1.14; twenty
minutes later 0.232-0.239 s and 0.195-0.198 s (3%, ratio 1.18-1.23). docs/results/sampling.md has what
that did to predictions measured against a calibration minutes old.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from specstop.script_args import ScriptParser, positive_int, positive_int_list
from specstop.script_main import run_main


def measure(args) -> dict:
    """This process's medians: ``{rows: seconds}`` for one step of that many rows."""
    import torch
    from transformers import DynamicCache

    from specstop.pair import load_named_pair

    pair = load_named_pair(args.pair, dtype=args.dtype, device="cpu")
    target = pair.target
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, pair.vocab_size, (1, args.context), generator=gen)
    rows = args.rows
    times: dict[int, list[float]] = {r: [] for r in rows}
    with torch.no_grad():
        for _ in range(args.reps + 1):  # the first round warms up
            for r in rows:
                cache = DynamicCache()
                target(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                step = torch.randint(100, pair.vocab_size, (1, r), generator=gen)
                t0 = time.perf_counter()
                target(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=r)
                times[r].append(time.perf_counter() - t0)
    return {r: statistics.median(v[1:]) for r, v in times.items()}


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--processes", type=positive_int, default=4, help="fresh processes, one after another")
    ap.add_argument("--reps", type=positive_int, default=12, help="timed steps per row count and process")
    ap.add_argument("--rows", type=positive_int_list, default="1,2,3", help="comma list of rows per step")
    ap.add_argument("--context", type=positive_int, default=108, help="prefill tokens before each step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measuring process
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    base = [sys.executable, __file__, "--pair", args.pair, "--dtype", args.dtype, "--reps", str(args.reps),
            "--rows", ",".join(map(str, args.rows)), "--context", str(args.context), "--child"]
    results = []
    for i in range(args.processes):
        done = subprocess.run(base, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"process {i + 1} failed: {done.stderr.strip().splitlines()[-1:]}")
        medians = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
        results.append(medians)
        steps = ", ".join(f"{r} row{'s' if r > 1 else ''} {s:.4f} s" for r, s in medians.items())
        print(f"process {i + 1}: {steps}", flush=True)
    for r in results[0]:
        vals = [m[r] for m in results]
        print(f"{r} row(s): {min(vals):.4f}-{max(vals):.4f} s over {len(vals)} processes "
              f"(max / min {max(vals) / min(vals):.2f})")
    if 1 in results[0] and 2 in results[0]:
        ratios = [m[1] / m[2] for m in results]
        print(f"one-row / two-row step: {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
