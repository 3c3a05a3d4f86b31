"""Work-arounds for slow kernel paths that cost more than the forward pass they sit in.

Output head fed a strided slice (CPU). HF causal LMs compute only the logits they are asked for
(``logits_to_keep``) by slicing the last hidden states, ``hidden[:, -k:, :]``, before the output
head. When fewer positions are kept than were fed (a prompt prefill keeping 1, a draft catching up
on 2 tokens after a fully accepted round), that slice is a strided view, and on CPU PyTorch's
``matmul`` then takes its batched path and copies the whole transposed output weight (151,936 x 896
for the 0.5B draft) on every call: measured on a 2-core Xeon in bf16, a 2-token draft step kept 1
logit row in 0.7-1.0 s against 0.085 s for 1 token, and a prompt prefill paid the same again. That
copy was the "fixed cost per round" of our decoder and of HF assisted generation.

:func:`contiguous_output_head` gives the head a fresh contiguous input (a copy of at most a few
rows), which takes the plain GEMM path. It is a forward pre-hook, so every caller benefits:
``generate`` (prefill), our decoder, HF assisted generation, data generation.

Single-row bf16 linears (CPU). A decode step feeds one token, so every linear layer multiplies one
row by its weight. For bf16 weights on CPU, ``F.linear`` runs that through a GEMM kernel well below
the memory bandwidth, while ``torch.mv`` streams the weight at about twice the rate: measured on a
2-core AMX Xeon, a 0.5B draft step went from 0.086 s to 0.062 s and a 1.5B target step from 0.194
s to 0.145 s (float32 gains nothing: its GEMM already streams at the bandwidth). :func:`single_row_matvec`
routes exactly-one-row inputs of bf16/fp16 CPU linears through ``torch.mv``; blocks of 2+ rows
(verification, prefill, batches) keep the GEMM. It is applied to the draft and the target alike, so
the "target alone" baseline every speedup is measured against gets the same faster single steps.
Which kernel is faster depends on the CPU kind: on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX)
``torch.mv`` was the *slower* one (0.38 vs 0.21 ms for a [1, 896] x [896, 4864] bf16 product, 29 vs
17 ms for the 0.5B draft's output head), so the route is taken only where a short measured check
(:func:`single_row_mv_gain`, cached per CPU model, dtype, torch version and thread count like the
``dtype: auto`` check) finds ``torch.mv`` at least 10% faster; ``SPECSTOP_SINGLE_ROW=mv|linear``
forces either.
Numerically the two kernels round differently (bf16 logits moved by up to 0.15 in a check), which
only matters at near-ties - the same class of difference bf16 already has between single-token
steps and batched verification.

cuDNN attention at a new sequence length (CUDA). PyTorch may dispatch ``scaled_dot_product_attention``
to cuDNN on Hopper GPUs, and cuDNN builds an execution plan for every new shape. Decoding grows the
KV cache by one or a few tokens per step, so nearly every step meets a new key length and pays a plan
build. Measured on an H100 (torch 2.11, cu130) with a random-init model of the reference target's
shape (1.5B, bf16), target-only decoding steps at fresh lengths took 0.060-0.071 s each with the
default backends, 0.024-0.026 s with flash / memory-efficient attention, and 0.022-0.025 s with the
default backends at lengths already seen; a cost table, timed at one fixed length, priced the decoder
1.2-1.9x too cheap. :func:`avoid_cudnn_attention` turns cuDNN attention off when a model of the pair
is on CUDA (PyTorch's switch is process-wide); ``SPECSTOP_CUDNN_ATTENTION=1`` keeps it.
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch

log = logging.getLogger(__name__)

_FLAG = "_specstop_contiguous_head"
_MV_FLAG = "_specstop_single_row_mv"
_LOW_PRECISION = (torch.bfloat16, torch.float16)
SINGLE_ROW_ENV = "SPECSTOP_SINGLE_ROW"
MV_MIN_GAIN = 1.1  # torch.mv must beat F.linear by this much: a tie keeps the stock kernel
_CHOICES: dict[str, dict] = {}  # per process: dtype -> the check's result


def _contiguous_input(module, args):
    x = args[0]
    if not isinstance(x, torch.Tensor) or (x.storage_offset() == 0 and _dense(x)):
        return None
    # clone() would keep the strides of a dense slice; ask for row-major explicitly.
    return (x.clone(memory_format=torch.contiguous_format), *args[1:])


def _dense(x: torch.Tensor) -> bool:
    """True when ``x``'s strides are the plain row-major ones (size-1 dims included)."""
    expected = 1
    for size, stride in zip(reversed(x.shape), reversed(x.stride())):
        if stride != expected:
            return False
        expected *= size
    return True


def contiguous_output_head(model) -> None:
    """Install the pre-hook on ``model``'s output embeddings (idempotent; no-op without one)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, _FLAG, False):
        return
    head.register_forward_pre_hook(_contiguous_input)
    setattr(head, _FLAG, True)


def _linear_single_row_mv(self, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == self.in_features:  # exactly one row: [..., 1, in] -> matrix-vector product
        y = torch.mv(self.weight, x.reshape(-1))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def measure_single_row(dtype: torch.dtype, reps: int = 25) -> dict:
    """Fastest ``F.linear`` and ``torch.mv`` time of one [1, 2048] row times a [2048, 8192] weight (a
    1.5B model's MLP size) in ``dtype``, interleaved so that drift hits both; ``mv_gain`` = linear / mv."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8192, 2048, generator=g).to(dtype)
    x = torch.randn(1, 2048, generator=g).to(dtype)
    kernels = {"linear": lambda: torch.nn.functional.linear(x, w), "mv": lambda: torch.mv(w, x[0])}
    best = dict.fromkeys(kernels, float("inf"))
    with torch.no_grad():
        for fn in kernels.values():
            for _ in range(3):
                fn()
        for _ in range(reps):
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)  # other load only adds time
    return {"linear_ms": 1e3 * best["linear"], "mv_ms": 1e3 * best["mv"], "mv_gain": best["linear"] / best["mv"]}


def single_row_mv_gain(dtype: torch.dtype) -> dict:
    """Whether one-row products in ``dtype`` run faster through ``torch.mv`` on this CPU: ``{"use_mv",
    "reason", ...}``, measured once per CPU model / dtype / torch / threads and cached on disk."""
    key = str(dtype)
    if key in _CHOICES:
        return _CHOICES[key]
    forced = os.environ.get(SINGLE_ROW_ENV)
    if forced in ("mv", "linear"):
        choice = {"use_mv": forced == "mv", "reason": f"{SINGLE_ROW_ENV}={forced} set"}
    else:
        from specstop.pair.hardware import cached_check, cpu_model_name, store_check

        cache_key = f"single_row|{cpu_model_name()}|{dtype}|torch {torch.__version__}|threads {torch.get_num_threads()}"
        m = cached_check(cache_key)
        if m is None:
            m = measure_single_row(dtype)
            store_check(cache_key, m)
        use = m["mv_gain"] >= MV_MIN_GAIN
        choice = {**m, "use_mv": use,
                  "reason": f"one-row {str(dtype).split('.')[-1]} linears via {'torch.mv' if use else 'F.linear'} "
                            f"(measured torch.mv {m['mv_gain']:.2f}x the speed of F.linear on this CPU)"}
    _CHOICES[key] = choice
    log.info(choice["reason"])
    return choice


def single_row_record() -> dict:
    """``{dtype: reason}`` for every one-row kernel choice this process made (cost files record it)."""
    return {k: v["reason"] for k, v in _CHOICES.items()}


def record_single_row_choice(dtype: torch.dtype, use_mv: bool, reason: str) -> None:
    """Settle the one-row route for ``dtype`` from a measurement of the real models (``dtype: auto``
    times both routes on the pair itself): later :func:`single_row_matvec` calls follow it."""
    _CHOICES[str(dtype)] = {"use_mv": bool(use_mv), "reason": reason}
    log.info(reason)


def routes_single_rows(model) -> bool:
    """Does any linear of ``model`` take the ``torch.mv`` route for one-row inputs now?"""
    return any(getattr(m, _MV_FLAG, False) for m in model.modules())


def route_single_rows(model, *, use_mv: bool) -> None:
    """Switch every bf16/fp16 CPU ``nn.Linear`` of ``model`` to ``torch.mv`` for one-row inputs
    (``use_mv``) or back to the stock ``F.linear``, whatever any check says (timing both routes)."""
    for mod in model.modules():
        if type(mod) is not torch.nn.Linear:
            continue
        if use_mv and mod.weight.device.type == "cpu" and mod.weight.dtype in _LOW_PRECISION:
            mod.forward = types.MethodType(_linear_single_row_mv, mod)
            setattr(mod, _MV_FLAG, True)
        elif getattr(mod, _MV_FLAG, False):
            del mod.forward  # the instance attribute: the class's forward applies again
            setattr(mod, _MV_FLAG, False)


def single_row_matvec(model) -> int:
    """Route one-row inputs of ``model``'s bf16/fp16 CPU ``nn.Linear`` layers through ``torch.mv``
    where :func:`single_row_mv_gain` finds it faster on this CPU (idempotent). Returns the number of
    layers patched (0 on GPUs, for float32 weights and where ``F.linear`` is as fast)."""
    n = 0
    for mod in model.modules():
        if type(mod) is not torch.nn.Linear or getattr(mod, _MV_FLAG, False):
            continue
        w = mod.weight
        if w.device.type != "cpu" or w.dtype not in _LOW_PRECISION or not single_row_mv_gain(w.dtype)["use_mv"]:
            continue
        mod.forward = types.MethodType(_linear_single_row_mv, mod)
        setattr(mod, _MV_FLAG, True)
        n += 1
    return n


def avoid_cudnn_attention(model) -> bool:
    """Turn cuDNN attention off (process-wide) when ``model`` is on CUDA; True when it did.

    Flash and memory-efficient attention, the backends left, need no per-shape plan (see above).
    """
    if os.environ.get("SPECSTOP_CUDNN_ATTENTION", "").strip() == "1":
        return False
    if model.get_input_embeddings().weight.device.type != "cuda":
        return False
    backends = torch.backends.cuda
    if not hasattr(backends, "enable_cudnn_sdp") or not backends.cudnn_sdp_enabled():
        return False
    backends.enable_cudnn_sdp(False)
    log.info("cuDNN attention off for decoding (a plan per new sequence length; SPECSTOP_CUDNN_ATTENTION=1 keeps it)")
    return True


def install_fast_paths(model) -> None:
    """Every fix above that applies to ``model`` (what the pair loader calls)."""
    contiguous_output_head(model)
    single_row_matvec(model)
    avoid_cudnn_attention(model)
