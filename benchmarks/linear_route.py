"""Which kernel route makes a one-row step cheapest, and does one row cost more than two, process by process?

Every decoding step multiplies one row (a draft step, a target-only step) or a few (a verification) by
every linear weight of the model, so the kernel route of ``nn.Linear`` (:mod:`specstop.pair.fast_paths`:
``linear`` = PyTorch's ``F.linear``, ``mv`` = ``torch.mv`` for one row, ``pad2`` = one row padded to the
two-row shape, ``packed`` = oneDNN weights packed once) sets what a step costs. This script starts
``--processes`` fresh Python processes one after another; each loads the pair and times, for the draft and
the target, one forward of 1, 2 and 9 rows (``--rows``) after ``--context`` tokens of KV cache under every
route, all interleaved in shuffled turns, and reports the medians with their interquartile range. Beside
them each process records what could set its level: the CPU's MHz, the threads' CPU affinity and the
process's transparent huge pages. Routes and row counts measured side by side in one process are the
figures to compare; processes show how much a level moves between them.

    python benchmarks/linear_route.py --pair qwen2.5-coder-0.5b-1.5b --dtype bfloat16 --processes 3

Found on a 2-core AMD EPYC (Zen 5, family 26, avx512_bf16, no AMX), torch 2.13, the reference pair in bf16,
256 tokens of context: ``F.linear`` hands oneDNN a row-major weight on every call and oneDNN repacks it
before multiplying; packed once, the target's one-row step fell from 0.126-0.163 s to 0.064-0.094 s and
the draft's from 0.047-0.058 s to 0.030-0.041 s, and one row cost within 3% of two in every process,
where the stock one-row step sat 1.02x-1.23x above two rows depending on the process
(docs/results/cpu_kinds.md, "Linear routes").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

from specstop.script_args import ScriptParser, positive_int, positive_int_list, result_file, write_result
from specstop.script_main import run_main


def machine_facts() -> dict:
    """What this process runs on: CPU MHz (first core), CPU affinity, anonymous huge pages in use."""
    facts: dict = {"affinity": sorted(os.sched_getaffinity(0))}
    try:
        mhz = [ln.split(":")[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("cpu MHz")]
        facts["mhz"] = float(mhz[0]) if mhz else None
    except OSError:
        facts["mhz"] = None
    try:
        huge = [ln.split()[1] for ln in open("/proc/self/smaps_rollup") if ln.startswith("AnonHugePages")]
        facts["anon_huge_kb"] = int(huge[0]) if huge else 0
    except OSError:
        facts["anon_huge_kb"] = None
    return facts


def measure(args) -> dict:
    """This process's figures: ``{"steps": {"role route rows": [median, q1, q3]}, "machine": {...}}``."""
    import numpy as np
    import torch

    from specstop.pair import load_named_pair
    from specstop.pair.cached_forward import CachedForward
    from specstop.pair.fast_paths import ROUTES, apply_route, route_applies

    pair = load_named_pair(args.pair, dtype=args.dtype, device="cpu")
    dtype = next(pair.target.parameters()).dtype
    routes = [r for r in (args.routes.split(",") if args.routes else ROUTES) if route_applies(r, dtype)]
    rows = args.rows
    context = torch.randint(100, pair.vocab_size, (args.context + max(rows),),
                            generator=torch.Generator().manual_seed(0)).tolist()
    out: dict[str, list[float]] = {}
    rng = random.Random(0)
    for role, model in (("draft", pair.draft), ("target", pair.target)):
        fwd = CachedForward(model, context[: args.context])
        # mv and pad2 change one-row inputs only: more rows take the stock kernel, timed once as linear.
        jobs = [(route, r) for route in routes for r in rows if r == 1 or route not in ("mv", "pad2")]
        samples: dict[tuple[str, int], list[float]] = {j: [] for j in jobs}
        for rep in range(args.reps + 1):  # the first turn warms up every shape
            rng.shuffle(jobs)
            for route, r in jobs:
                apply_route(model, route, keep_packed=True)
                t = fwd.time_feed(context[args.context : args.context + r])[0]
                if rep:
                    samples[(route, r)].append(t)
        apply_route(model, "linear")
        for (route, r), v in samples.items():
            q1, med, q3 = np.percentile(v, [25, 50, 75])
            out[f"{role} {route} {r}"] = [float(med), float(q1), float(q3)]
        del fwd
    return {"steps": out, "machine": machine_facts()}


def summarize(results: list[dict]) -> list[str]:
    """Lines: per role and route, the one-row step against the two-row one in every process."""
    lines = []
    keys = list(results[0]["steps"])
    for role_route in dict.fromkeys(k.rsplit(" ", 1)[0] for k in keys):
        per = []
        for res in results:
            steps = res["steps"]
            role = role_route.split(" ")[0]
            one, two = steps.get(f"{role_route} 1"), steps.get(f"{role_route} 2") or steps.get(f"{role} linear 2")
            if one and two:
                per.append((one[0], two[0]))
        if per:
            ratios = ", ".join(f"{a / b:.2f}" for a, b in per)
            lines.append(f"{role_route}: one row {min(a for a, _ in per):.4f}-{max(a for a, _ in per):.4f} s, "
                         f"two rows {min(b for _, b in per):.4f}-{max(b for _, b in per):.4f} s; "
                         f"one / two rows per process {ratios}")
    return lines


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--processes", type=positive_int, default=3, help="fresh processes, one after another")
    ap.add_argument("--reps", type=positive_int, default=10, help="timed forwards per route, row count and process")
    ap.add_argument("--rows", type=positive_int_list, default="1,2,9", help="comma list of rows per forward")
    ap.add_argument("--routes", default=None, help="comma list of routes (default: every route that applies)")
    ap.add_argument("--context", type=positive_int, default=256, help="tokens of KV cache before each forward")
    ap.add_argument("--out", type=result_file(__file__), default=None, help="write every process's figures here (JSON)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measuring process
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    base = [sys.executable, __file__, "--pair", args.pair, "--dtype", args.dtype, "--reps", str(args.reps),
            "--rows", ",".join(map(str, args.rows)), "--context", str(args.context), "--child"]
    if args.routes:
        base += ["--routes", args.routes]
    results = []
    for i in range(args.processes):
        done = subprocess.run(base, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"linear_route.py: process {i + 1} failed: {tail}", file=sys.stderr)
            return 1
        res = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(res)
        m = res["machine"]
        print(f"process {i + 1} (MHz {m.get('mhz')}, CPUs {m.get('affinity')}, anonymous huge pages "
              f"{m.get('anon_huge_kb')} kB):", flush=True)
        for key, (med, q1, q3) in res["steps"].items():
            print(f"  {key:<22} {med:.4f} s [IQR {q1:.4f}-{q3:.4f}]", flush=True)
    print("\nper route, across processes:")
    for line in summarize(results):
        print("  " + line)
    if args.out:
        write_result(args.out, {"args": vars(args), "processes": results}, __file__, indent=1)
        print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
