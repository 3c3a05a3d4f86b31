"""``dtype: auto``: pick the dtype in which *this pair* runs fastest on this machine, and say why.

On CUDA that is bfloat16 where the device supports it (compute capability 8.0 or newer), float16
otherwise. On a CPU it depends on the CPU *kind* and cannot be read off its flags: without native
bf16 matrix units (Intel AMX ``amx_bf16``, AVX-512 ``avx512_bf16``) bf16 matmuls are emulated and
float32 wins; with them bf16 is usually much faster for the pair (2-core AMD EPYC Zen 5: a 1.5B
target verifies 9 tokens in 0.129 s in bf16 against 0.636 s in float32) - but a synthetic one-row
matmul there timed bf16 at 0.71x float32, which is why the decision is taken by timing the pair's
own forwards (:mod:`specstop.pair.dtype_timing`): a draft step, a target step and a K = 8
verification per dtype for decoding and calibration, batched steps for data generation, the bf16
one-row kernel route settled in the same rounds. The figures are printed, recorded in manifests
and cost files, and cached per CPU model, flags, torch version, thread count and pair.

Speculative decoding stays lossless relative to the dtype the target runs in: the decoder accepts
exactly what the target, in that dtype, would pick. In bf16 the batched verification pass and
single-token ``generate`` steps run different kernels, so the two can differ where the target's
top-2 logits (nearly) tie; benchmarks list such flips with their logit gap.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specstop.pair.hardware import cached_check, cpu_flags, cpu_model_name, store_check

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
WORKLOADS = ("decode", "generate")
CHECK_VERSION = "pair-timing-v2"  # older cached checks (a synthetic matmul; two routes) are not reused


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` resolved to on this machine, and why (recorded in manifests, cost files, reports)."""

    dtype: str
    device: str
    reason: str
    cpu: str | None = None
    flags: tuple[str, ...] = ()
    measured: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flags"] = list(self.flags)
        return d


def pair_key(draft: str, target: str) -> str:
    """What identifies a pair for the cached check: each model's path (or hub id), config and weight
    files' sizes and modification times (a re-converted pair is timed again)."""
    import hashlib

    h = hashlib.sha256()
    for src in (draft, target):
        p = Path(src)
        h.update(str(p.resolve() if p.exists() else src).encode())
        if p.is_dir():
            for f in sorted(p.iterdir()):
                if f.suffix in (".json", ".safetensors", ".bin"):
                    st = f.stat()
                    h.update(f"{f.name}\0{st.st_size}\0{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def choose_cpu_dtype(*, pair: tuple[str, str] | None = None, workload: str = "decode") -> DtypeChoice:
    """The faster of float32 and bfloat16 for ``workload`` on this CPU, measured on ``pair``.

    Args:
        pair: the (draft, target) folders or hub ids to time. Without one nothing can be timed: the
            answer then follows the flags alone and says it was not measured.
        workload: ``decode`` (batch-1 decoding and calibration) or ``generate`` (batched data
            generation); the two can prefer different dtypes.

    ``SPECSTOP_CPU_DTYPE`` (float32/bfloat16) overrides the choice.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    cpu = cpu_model_name()
    flags = tuple(sorted(f for f in cpu_flags() if f in BF16_FLAGS))
    forced = os.environ.get("SPECSTOP_CPU_DTYPE")
    if forced:
        return DtypeChoice(forced, "cpu", f"SPECSTOP_CPU_DTYPE={forced} set", cpu, flags)
    if not flags:
        return DtypeChoice(
            "float32", "cpu", "CPU has no native bf16 matrix units (no amx_bf16/avx512_bf16): float32", cpu, flags
        )
    if pair is None:
        return DtypeChoice("bfloat16", "cpu", f"CPU has {'+'.join(flags)} (not measured: no pair to time)", cpu, flags)
    import specstop.pair.dtype_timing as dtype_timing
    from specstop.pair.fast_paths import record_route_choice

    key = (f"{CHECK_VERSION}|{cpu}|{'+'.join(flags)}|torch {torch.__version__}|threads {torch.get_num_threads()}"
           f"|pair {pair_key(*pair)}")
    m = cached_check(key)
    cached = m is not None
    if m is None:
        room = dtype_timing.float32_room(*pair)
        if room:
            return DtypeChoice("bfloat16", "cpu", f"CPU has {'+'.join(flags)} (not measured: {room})", cpu, flags)
        m = dtype_timing.measure_pair_dtypes(*pair)
        store_check(key, m)
    for name, route in m["routes"].items():
        record_route_choice(_DTYPES[name], route, dtype_timing.describe_routes(m, name))
    totals = m[workload]
    best = min(totals, key=totals.get)
    other = next(d for d in totals if d != best)
    reason = (f"CPU has {'+'.join(flags)}; timed on this pair{' (cached)' if cached else ''}: "
              f"{dtype_timing.describe(m, workload)}: {best} ({totals[other] / totals[best]:.2f}x faster "
              f"{'decoding' if workload == 'decode' else 'batched generation'} than {other})")
    return DtypeChoice(best, "cpu", reason, cpu, flags, m)


def choose_dtype(device: str | None, *, pair: tuple[str, str] | None = None, workload: str = "decode") -> DtypeChoice:
    """What ``dtype: auto`` means on ``device`` (None: CUDA when available, else CPU) for ``pair``."""
    on_cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if on_cuda:
        index = torch.device(device).index if device and ":" in device else None
        major, minor = torch.cuda.get_device_capability(index)
        if major >= 8:
            return DtypeChoice("bfloat16", "cuda", f"CUDA device with compute capability {major}.{minor}: bfloat16")
        return DtypeChoice("float16", "cuda",
                           f"CUDA device with compute capability {major}.{minor} has no bf16 units (needs 8.0): float16")
    if device not in (None, "cpu"):
        return DtypeChoice("float32", str(device), f"device {device}: float32 (auto picks bf16 only on CUDA and bf16 CPUs)")
    return choose_cpu_dtype(pair=pair, workload=workload)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | None = None) -> torch.dtype:
    """Map a dtype name (or ``auto``) to a torch dtype.

    ``auto`` without a pair to time follows the device alone (bf16 on CUDA and on CPUs with native
    bf16 units, float32 otherwise); :func:`load_pair` times the pair itself
    (:func:`choose_dtype`).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return _DTYPES[choose_dtype(device).dtype]
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or 'auto'") from None
