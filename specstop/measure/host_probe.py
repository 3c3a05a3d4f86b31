"""Whether the host kept its speed through a benchmark: a fixed workload timed whenever no engine runs.

A speedup is a ratio between methods measured minutes apart. Interleaving engine starts spreads slow
minutes over every method, but a host whose speed moves a lot within a run still reads as a slow method:
on a 2-core KVM guest (Intel Xeon with AMX) one serving run's no-speculation baseline at batch size 8 took
9.8 s in its first pass and 15.0 s in its second, nothing else running, and a sweep of one-row bf16
products over the 0.5B draft's weights took 91 ms before the run and 152 ms after it
(docs/results/vllm_serving.md). Such a run's ratios say more about the host than about the methods.

:func:`probe` times two fixed torch workloads in the calling process, each the median of a few repeats:
``stream``, a one-row product with :data:`STREAM_MIB` MiB of bf16 weights (bound by memory bandwidth,
as a decode step is) and ``gemm``, a :data:`GEMM_ROWS`-row product with one of those matrices (bound by
compute, as a prefill is). :func:`drift` says how far the probes of one run spread, and
:func:`drift_line` words it when the spread is past :data:`DRIFT`. A probe takes a fraction of a second and
holds its weights only while it runs.
"""

from __future__ import annotations

import statistics
import time

#: MiB of bf16 weights the streaming probe reads per repeat (well past a CPU's own caches per core).
STREAM_MIB = 256
#: Rows of the compute-bound probe's product.
GEMM_ROWS = 1024
#: Repeats per workload (their median is the probe's figure).
REPEATS = 7
#: How far a run's probes may spread (max / min - 1) before its ratios are called not comparable. A choice: the
#: serving runs that could not be read slowed a one-row weight stream 1.3-2.7x (docs/results/vllm_serving.md).
DRIFT = 0.20
KINDS = ("stream_ms", "gemm_ms")


def probe(stream_mib: int = STREAM_MIB, gemm_rows: int = GEMM_ROWS, repeats: int = REPEATS) -> dict:
    """Time the fixed workloads once: ``{"stream_ms": ..., "gemm_ms": ...}`` (medians over ``repeats``).

    Args:
        stream_mib: MiB of bf16 weights the streaming workload reads (matrices of ``[2048, 4096]``).
        gemm_rows: rows of the compute-bound product (``[rows, 2048] @ [2048, 4096]``).
        repeats: timed repeats per workload, after one untimed.
    """
    import torch

    cols, rows_w = 2048, 4096
    count = max(1, int(stream_mib) * 2**20 // (cols * rows_w * 2))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows_w, cols, generator=gen).to(torch.bfloat16) for _ in range(count)]
    x = torch.randn(1, cols, generator=gen).to(torch.bfloat16)
    block = torch.randn(int(gemm_rows), cols, generator=gen).to(torch.bfloat16)

    def stream() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    def gemm() -> None:
        torch.nn.functional.linear(block, weights[0])

    out = {}
    with torch.inference_mode():
        for kind, work in (("stream_ms", stream), ("gemm_ms", gemm)):
            work()
            took = []
            for _ in range(max(1, int(repeats))):
                began = time.perf_counter()
                work()
                took.append(1e3 * (time.perf_counter() - began))
            out[kind] = round(statistics.median(took), 3)
    return out


def drift(probes: list[dict]) -> dict:
    """Per workload, how far ``probes`` (:func:`probe` results, extra keys allowed) spread:
    ``{kind: {"min", "max", "spread"}}`` with spread = max / min - 1 (workloads with no figures left out)."""
    out = {}
    for kind in KINDS:
        values = [float(p[kind]) for p in probes if p.get(kind)]
        if values:
            out[kind] = {"min": min(values), "max": max(values), "spread": round(max(values) / min(values) - 1.0, 4)}
    return out


def drift_line(probes: list[dict], limit: float = DRIFT) -> str | None:
    """One line saying the host's speed moved past ``limit`` during the run, or None where it held."""
    moved = {k: v for k, v in drift(probes).items() if v["spread"] > limit}
    if not moved:
        return None
    words = ", ".join(f"{k.removesuffix('_ms')} {v['min']:.1f}-{v['max']:.1f} ms (+{100 * v['spread']:.0f}%)"
                      for k, v in moved.items())
    return (f"the host's speed moved during this run: a fixed workload timed between engine starts took {words}, "
            f"past the {100 * limit:.0f}% a run's ratios can carry; compare methods within a pass, and run again "
            "on a quiet host")
