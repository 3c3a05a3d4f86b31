"""``dtype: auto``: pick this machine's fastest dtype that keeps decoding lossless, and say why.

On CUDA that is bfloat16. On a CPU it depends on the CPU *kind*: with native bf16 matrix units
(Intel AMX ``amx_bf16`` or AVX-512 ``avx512_bf16``) a bf16 target verifies 1 to 17 tokens in about
the time of one token (measured on a 2-core Xeon: 0.19 s at 1 token, 0.22 s at 17), while float32
runs 2-3x slower as soon as more than a couple of tokens are fed. Without those units bf16 matmuls
are emulated and float32 wins. The CPU flags decide whether bf16 is *possible*; a short measured
check (a [M, 2048] x [2048, 8192] matmul in both dtypes, about 0.3 s, cached per CPU model, flags,
torch version and thread count) decides whether it is *faster*, because a VM can advertise a flag
that its kernels do not use.

Speculative decoding stays lossless relative to the dtype the target runs in: the decoder accepts
exactly what the target, in that dtype, would pick. In bf16 the batched verification pass and
single-token ``generate`` steps run different kernels, so the two can differ where the target's
top-2 logits (nearly) tie; benchmarks list such flips with their logit gap.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16 must be at least this much faster at M = 8 (the verification regime) and no more than this
# much slower at M = 1 (single-token steps: measured 0.93x on the AMX Xeon in this matmul while the
# whole 1.5B target step was 1.25x faster in bf16, so only a clear loss counts).
MIN_GAIN_M8 = 1.2
MAX_LOSS_M1 = 1.25


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


def cpu_model_name() -> str:
    """The CPU model string (``/proc/cpuinfo`` "model name", else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU feature flags (``/proc/cpuinfo``; empty where unavailable, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _time_matmul(dtype: torch.dtype, m: int, reps: int = 15) -> float:
    """Fastest of ``reps`` [m, 2048] x [2048, 8192] matmuls (the size of a 1.5B model's MLP), in
    seconds: the minimum, because other load on the machine only ever adds time."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8192, 2048, generator=g).to(dtype)
    x = torch.randn(m, 2048, generator=g).to(dtype)
    with torch.no_grad():
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            ts.append(time.perf_counter() - t0)
    return min(ts)


def measure_bf16_gain() -> dict:
    """float32 time / bf16 time at M = 1 and M = 8 (above 1: bf16 faster)."""
    out = {}
    for m in (1, 8):
        f32 = _time_matmul(torch.float32, m)
        bf16 = _time_matmul(torch.bfloat16, m)
        out[f"gain_m{m}"] = f32 / bf16
        out[f"float32_ms_m{m}"] = 1e3 * f32
        out[f"bfloat16_ms_m{m}"] = 1e3 * bf16
    return out


def _check_cache_path() -> Path:
    from specstop.paths import cache_dir

    return cache_dir() / "hardware" / "dtype_check.json"


def cached_check(key: str) -> dict | None:
    """A hardware check's cached result (``~/.cache/specstop/hardware/dtype_check.json``), or None."""
    try:
        return json.loads(_check_cache_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def store_check(key: str, value: dict) -> None:
    """Cache a hardware check's result under ``key`` (atomic write; a read-only cache is ignored)."""
    path = _check_cache_path()
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        doc[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError):  # a read-only cache only costs a re-measurement next time
        pass


def choose_cpu_dtype(*, measure: bool = True) -> DtypeChoice:
    """bfloat16 where the CPU has native bf16 matrix units and a measured check confirms it is
    faster; float32 otherwise. ``SPECSTOP_CPU_DTYPE`` (float32/bfloat16) overrides the choice."""
    cpu = cpu_model_name()
    flags = tuple(sorted(f for f in cpu_flags() if f in BF16_FLAGS))
    forced = os.environ.get("SPECSTOP_CPU_DTYPE")
    if forced:
        return DtypeChoice(forced, "cpu", f"SPECSTOP_CPU_DTYPE={forced} set", cpu, flags)
    if not flags:
        return DtypeChoice(
            "float32", "cpu", "CPU has no native bf16 matrix units (no amx_bf16/avx512_bf16): float32", cpu, flags
        )
    if not measure:
        return DtypeChoice("bfloat16", "cpu", f"CPU has {'+'.join(flags)} (not measured)", cpu, flags)
    key = f"{cpu}|{'+'.join(flags)}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    gain = cached_check(key)
    if gain is None:
        gain = measure_bf16_gain()
        store_check(key, gain)
    ok = gain["gain_m8"] >= MIN_GAIN_M8 and gain["gain_m1"] >= 1.0 / MAX_LOSS_M1
    what = (
        f"measured bf16 vs float32 matmul: {gain['gain_m1']:.2f}x at 1 row, {gain['gain_m8']:.2f}x at 8 rows"
    )
    if ok:
        return DtypeChoice("bfloat16", "cpu", f"CPU has {'+'.join(flags)}; {what}: bfloat16", cpu, flags, gain)
    return DtypeChoice(
        "float32", "cpu", f"CPU has {'+'.join(flags)} but {what} (not faster): float32", cpu, flags, gain
    )


def choose_dtype(device: str | None) -> DtypeChoice:
    """What ``dtype: auto`` means on ``device`` (None: CUDA when available, else CPU)."""
    on_cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if on_cuda:
        return DtypeChoice("bfloat16", "cuda", "CUDA device: bfloat16")
    if device not in (None, "cpu"):
        return DtypeChoice("float32", str(device), f"device {device}: float32 (auto picks bf16 only on CUDA and bf16 CPUs)")
    return choose_cpu_dtype()
