"""Why are multi-row float32 forwards slow and erratic on some CPUs? Time the target's largest
linear ([M, 1536] x [1536, 8960], the 1.5B model's MLP) for M = 1..17 rows under each candidate cause.

Each candidate is toggled alone and measured side by side in one run (interleaved repeats, medians
with the interquartile range):

* the GEMM call: ``F.linear`` (MKL sgemm on x86 builds, weight [out, in]) against ``x @ W^T`` with
  the weight stored [in, out] (the other sgemm layout) and a loop of matrix-vector products per row
  (which never shares a weight read between rows);
* threads: 1 against all (the OpenMP pool);
* denormals: ``torch.set_flush_denormal(True)``;
* bfloat16 ``F.linear`` for scale.

    python benchmarks/float32_gemm.py [--reps 7] [--rows 1,2,3,4,8,9,16,17]

Found on a 2-core AMD EPYC (Zen 4, avx512_bf16, torch 2.13 with MKL 2024.2): float32 ``F.linear``
costs 4.3 / 9.0 / 13.0 / 9.6 / 9.1 ms at M = 1 / 2 / 3 / 4 / 8 - at 2 and 3 rows exactly 2x and 3x
one row, as the per-row loop does, then a real GEMM from 4 rows on. That is the erratic float32
t_target(K) (K drafted tokens = K + 1 rows: 0.29 / 0.59 / 0.84 / 0.52 s at K = 0 / 1 / 2 / 3 on a
Zen 5): MKL's sgemm takes a per-row path for 2-3 rows on these CPUs. Threads and denormals change
nothing; bf16 runs 1.7-2.3 ms flat for every M. Not ours to fix: ``dtype: auto`` times the pair and
avoids float32 where bf16 is faster, and the cost table check refuses a table that falls with K.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specstop.script_args import ScriptParser, positive_int, positive_int_list
from specstop.script_main import run_main


def cpu_line() -> str:
    from specstop.pair.hardware import cpu_flags, cpu_model_name

    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return f"{cpu_model_name()} ({', '.join(sorted(f for f in cpu_flags() if f in keep))}), torch {torch.__version__}"


def variants(w32: torch.Tensor):
    wbf = w32.to(torch.bfloat16)
    wt = w32.t().contiguous()  # [in, out]: x @ wt, the layout oneDNN/MKL "NN" paths prefer

    def loop_mv(x):
        return torch.stack([torch.mv(w32, r) for r in x])

    return {
        "float32 F.linear": (lambda x: torch.nn.functional.linear(x, w32), torch.float32),
        "float32 x @ W^T (NN layout)": (lambda x: x @ wt, torch.float32),
        "float32 row-by-row mv": (loop_mv, torch.float32),
        "bfloat16 F.linear": (lambda x: torch.nn.functional.linear(x, wbf), torch.bfloat16),
    }


def main() -> None:
    ap = ScriptParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=positive_int, default=7)
    ap.add_argument("--rows", type=positive_int_list, default="1,2,3,4,8,9,16,17")
    args = ap.parse_args()
    rows = args.rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8960, 1536, generator=g) * 0.02
    xs = {m: torch.randn(m, 1536, generator=g) for m in rows}
    print(cpu_line())
    threads_all = torch.get_num_threads()
    settings = [(f"threads={threads_all}", threads_all, False), ("threads=1", 1, False),
                (f"threads={threads_all}, flush denormals", threads_all, True)]
    kernels = variants(w)
    results: dict[tuple[str, str, int], list[float]] = {}
    with torch.no_grad():
        for rep in range(args.reps + 1):  # rep 0 warms up
            for sname, threads, flush in settings:
                torch.set_num_threads(threads)
                torch.set_flush_denormal(flush)
                for vname, (fn, dt) in kernels.items():
                    for m in rows:
                        x = xs[m].to(dt)
                        t0 = time.perf_counter()
                        fn(x)
                        t = time.perf_counter() - t0
                        if rep:
                            results.setdefault((sname, vname, m), []).append(t)
    torch.set_num_threads(threads_all)
    torch.set_flush_denormal(False)
    for sname, _, _ in settings:
        print(f"\n{sname}: ms per product (median [IQR]) for M = {rows}")
        for vname in kernels:
            cells = []
            for m in rows:
                v = np.array(results[(sname, vname, m)]) * 1e3
                cells.append(f"{np.median(v):7.2f} [{np.percentile(v, 25):.1f}-{np.percentile(v, 75):.1f}]")
            print(f"  {vname:28s} " + " ".join(cells))


if __name__ == "__main__":
    run_main(main, __file__)
