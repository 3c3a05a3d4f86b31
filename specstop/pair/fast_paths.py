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

Linear layers on CPU: the route (CPU). Every decoding step multiplies a few rows (one for a draft
step or a target-only step, K + 1 for a verification) by every weight of the model, so the kernel
route of ``nn.Linear`` decides what a step costs. PyTorch's stock ``F.linear`` hands oneDNN a plain
row-major weight on every call, and oneDNN repacks it into its blocked (VNNI) layout before it
multiplies: measured on a 2-core AMD EPYC (Zen 5, avx512_bf16, torch 2.13), a [1, 1536] x [1536,
8960] bf16 product took 1.17 ms through ``F.linear`` and 0.36 ms through a weight packed once with
``torch.ops.mkldnn._reorder_linear_weight`` (bit-identical results; 0.56 against 1.18 ms at 9 rows,
2.1 against 2.8 ms at 64; float32 0.77 against 2.70 ms). On the 1.5B reference target a one-row
bf16 step went from 0.157 s to 0.064-0.070 s, a two-row one from 0.130 s to 0.062-0.067 s, and the
0.5B draft's step from 0.047-0.058 s to 0.030-0.036 s. The repack is also where one row cost more
than two: its one-row form sat at two levels from one process to the next (0.120-0.131 s in most,
0.157-0.163 s in about one in three, against 0.116-0.135 s for two rows in the same processes),
while packed weights cost the same for one and two rows in every process
(``benchmarks/linear_route.py``).

Four routes are known (:data:`ROUTES`): ``linear`` (stock), ``mv`` (one-row inputs through
``torch.mv``; once the fastest on a 2-core AMX Xeon: 0.194 -> 0.145 s per 1.5B target step),
``pad2`` (a one-row input padded to the two-row shape, the first row kept) and ``packed`` (oneDNN's
packed weights for every row count). Which is fastest depends on the CPU kind and torch build, so it
is measured (:func:`measure_routes`: the shapes of a 1.5B model's MLP at one and nine rows,
interleaved; cached per CPU model, dtype, torch version and thread count) unless ``dtype: auto``
already timed the routes on the pair itself (:mod:`specstop.pair.dtype_timing`, which then settles
it with :func:`record_route_choice`). ``SPECSTOP_LINEAR_ROUTE=linear|mv|pad2|packed`` forces one
(``SPECSTOP_SINGLE_ROW=mv|linear`` is read as before). Every model a pair loads, draft and target,
takes the same route, so the "target alone" baseline every speedup is measured against (our decoder
with no draft, and Hugging Face's ``generate``, which calls the same modules) gets the same kernels.
Packed weights are a second copy of each linear's weight (the dense one stays for quantization,
saving and the stock route); where the pair loader finds no memory for that copy the next-fastest
route is used and said so. Autograd and ``torch.compile`` graphs always take the stock kernel.
Numerically the routes can round differently (bf16 logits moved by up to 0.15 between ``torch.mv``
and ``F.linear``), which only matters at near-ties - the same class of difference bf16 already has
between single-token steps and batched verification.

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

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_FLAG = "_specstop_contiguous_head"
_ROUTE_ATTR = "_specstop_linear_route"
_PACKED_ATTR = "_specstop_packed_weight"
_LOW_PRECISION = (torch.bfloat16, torch.float16)
ROUTES = ("linear", "mv", "pad2", "packed")
ROUTE_ENV = "SPECSTOP_LINEAR_ROUTE"
SINGLE_ROW_ENV = "SPECSTOP_SINGLE_ROW"  # the older switch: mv | linear
MIN_GAIN = 1.05  # another route must beat the stock kernel by this much: a tie keeps F.linear
_CHOICES: dict[str, dict] = {}  # per process: dtype -> the route chosen and why


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


def _mv_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == self.in_features:  # exactly one row: [..., 1, in] -> matrix-vector product
        y = torch.mv(self.weight, x.reshape(-1))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


def _pad2_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == self.in_features:  # one row, run in the two-row shape, the copy dropped
        row = x.reshape(1, -1)
        return F.linear(torch.cat((row, row)), self.weight, self.bias)[:1].view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


class _Packed:
    """oneDNN's packed copy of one linear's weight, and the version of the weight it was packed from.

    A weight changed in place since (``load_state_dict``, an edit in a test), replaced, or cast is
    packed again at the next forward; a copy of the module (``copy.deepcopy``) packs its own weight.
    """

    __slots__ = ("tensor", "version", "ptr", "dtype")

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        self.tensor = self.version = self.ptr = self.dtype = None
        if weight is not None:
            self.pack(weight)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.version, self.ptr, self.dtype = weight._version, weight.data_ptr(), weight.dtype
        return self.tensor

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed weight, packed again when ``weight`` is not the one it was packed from."""
        if (self.tensor is None or self.version != weight._version or self.ptr != weight.data_ptr()
                or self.dtype != weight.dtype):
            return self.pack(weight)
        return self.tensor

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()  # the copy packs its own (copied) weight at its first forward

    def __reduce__(self):
        return (_Packed, ())


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)  # autograd and compiled graphs: the stock kernel
    packed = self.__dict__[_PACKED_ATTR].of(self.weight)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), packed, self.bias, "none", [], "")
    return y.view(*x.shape[:-1], self.out_features)


_FORWARDS = {"mv": _mv_forward, "pad2": _pad2_forward, "packed": _packed_forward}


def route_applies(route: str, dtype: torch.dtype) -> bool:
    """Can ``route`` run CPU linears of ``dtype`` in this torch build?"""
    if route == "linear":
        return True
    if route in ("mv", "pad2"):
        return dtype in _LOW_PRECISION
    if route == "packed":
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return dtype == torch.float32
    raise ValueError(f"unknown linear route {route!r}; one of {ROUTES}")


def _time_routes(dtype: torch.dtype, routes: tuple[str, ...], reps: int) -> dict[str, dict[str, float]]:
    """Median ms per route of a [rows, 2048] x [2048, 8192] product (a 1.5B model's MLP) at one and nine
    rows, routes interleaved so that drift hits all alike."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(2048, 8192, bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8192, 2048, generator=g).to(dtype))
    xs = {rows: torch.randn(1, rows, 2048, generator=g).to(dtype) for rows in (1, 9)}
    samples: dict[str, dict[int, list[float]]] = {r: {1: [], 9: []} for r in routes}
    with torch.no_grad():
        for rep in range(reps + 2):  # two warm-ups: kernel choice per shape, allocator
            for route in routes:
                apply_route(lin, route, keep_packed=True)
                for rows, x in xs.items():
                    t0 = time.perf_counter()
                    lin(x)
                    if rep >= 2:
                        samples[route][rows].append(time.perf_counter() - t0)
    apply_route(lin, "linear")
    return {r: {f"rows{rows}_ms": 1e3 * float(np.median(v)) for rows, v in by_rows.items()}
            for r, by_rows in samples.items()}


def measure_routes(dtype: torch.dtype, reps: int = 25) -> dict[str, dict[str, float]]:
    """``{route: {"rows1_ms", "rows9_ms"}}`` for every route that applies to ``dtype`` here."""
    return _time_routes(dtype, tuple(r for r in ROUTES if route_applies(r, dtype)), reps)


def pick_route(timings: dict[str, dict[str, float]], *, one: str = "rows1_ms", many: str = "rows9_ms") -> str:
    """The route with the cheapest one-row product among those no slower than the stock kernel on many
    rows (``mv`` and ``pad2`` leave many rows to it); the stock kernel unless another beats it by
    :data:`MIN_GAIN`."""
    stock = timings["linear"]
    fair = {r: t for r, t in timings.items() if t[many] <= stock[many] * MIN_GAIN}
    best = min(fair, key=lambda r: fair[r][one] + fair[r][many])
    gain = (stock[one] + stock[many]) / (fair[best][one] + fair[best][many])
    return best if gain >= MIN_GAIN else "linear"


def describe_routes(timings: dict[str, dict[str, float]], chosen: str, what: str) -> str:
    """One line: the chosen route and every route's timings."""
    figures = ", ".join(f"{r} {t['rows1_ms']:.3f}/{t['rows9_ms']:.3f} ms" for r, t in timings.items())
    return f"{what} linears via the {chosen} route (one/nine rows: {figures})"


def _forced_route() -> tuple[str, str] | None:
    forced = os.environ.get(ROUTE_ENV, "").strip()
    if forced:
        if forced not in ROUTES:
            from specstop.errors import UserError

            raise UserError(f"{ROUTE_ENV}={forced!r}: choose one of {', '.join(ROUTES)}, or unset it to measure")
        return forced, f"{ROUTE_ENV}={forced} set"
    old = os.environ.get(SINGLE_ROW_ENV, "").strip()
    if old in ("mv", "linear"):
        return old, f"{SINGLE_ROW_ENV}={old} set"
    return None


def route_choice(dtype: torch.dtype) -> dict:
    """The linear route for CPU weights of ``dtype``: ``{"route", "reason"[, "timings"]}``, forced by
    the environment, settled by ``dtype: auto``'s timing of the pair, or measured once per CPU model /
    dtype / torch / threads and cached on disk."""
    key = str(dtype)
    if key in _CHOICES:
        return _CHOICES[key]
    forced = _forced_route()
    if forced:
        route, reason = forced
        choice = {"route": route if route_applies(route, dtype) else "linear", "reason": reason}
    else:
        from specstop.pair.hardware import cached_check, cpu_model_name, store_check

        cache_key = f"linear_route-v2|{cpu_model_name()}|{dtype}|torch {torch.__version__}|threads {torch.get_num_threads()}"
        timings = cached_check(cache_key)
        if timings is None:
            timings = measure_routes(dtype)
            store_check(cache_key, timings)
        route = pick_route(timings)
        choice = {"route": route, "timings": timings,
                  "reason": describe_routes(timings, route, f"{str(dtype).split('.')[-1]} (measured on this CPU)")}
    _CHOICES[key] = choice
    log.info(choice["reason"])
    return choice


def route_record() -> dict:
    """``{dtype: reason}`` for every linear route this process chose (cost files record it)."""
    return {k: v["reason"] for k, v in _CHOICES.items()}


def record_route_choice(dtype: torch.dtype, route: str, reason: str) -> None:
    """Settle the linear route for ``dtype`` from a measurement of the real models (``dtype: auto``
    times the routes on the pair itself): later :func:`install_linear_route` calls follow it, unless
    the environment forces another."""
    if _forced_route():
        return
    _CHOICES[str(dtype)] = {"route": route, "reason": reason}
    log.info(reason)


def route_of(model) -> str:
    """The route ``model``'s linears take now (``linear`` when none is set)."""
    return next((m.__dict__[_ROUTE_ATTR] for m in model.modules() if _ROUTE_ATTR in m.__dict__), "linear")


def apply_route(model, route: str, *, keep_packed: bool = False) -> int:
    """Put every CPU ``nn.Linear`` of ``model`` that ``route`` applies to on ``route`` (the others on the
    stock kernel), whatever any check says; returns the number of layers on a non-stock route.

    ``keep_packed``: a layer leaving the packed route keeps its packed weights, so that timing the
    routes in turns packs each weight once (:mod:`specstop.pair.dtype_timing`); the default frees them.
    """
    if route not in ROUTES:
        raise ValueError(f"unknown linear route {route!r}; one of {ROUTES}")
    n = 0
    for mod in model.modules():
        if type(mod) is not torch.nn.Linear:
            continue
        w = mod.weight
        use = route != "linear" and w.device.type == "cpu" and route_applies(route, w.dtype)
        packed = mod.__dict__.get(_PACKED_ATTR)
        mod.__dict__.pop("forward", None)  # the instance attribute: the class's forward applies again
        mod.__dict__.pop(_ROUTE_ATTR, None)
        mod.__dict__.pop(_PACKED_ATTR, None)
        if use and route == "packed":
            packed = packed or _Packed()
            packed.of(w)  # packed now (at load), not at the first forward
        if packed is not None and (keep_packed or (use and route == "packed")):
            mod.__dict__[_PACKED_ATTR] = packed
        if not use:
            continue
        mod.forward = types.MethodType(_FORWARDS[route], mod)
        mod.__dict__[_ROUTE_ATTR] = route
        n += 1
    return n


def install_linear_route(model, *, pack: bool = True) -> int:
    """Put ``model``'s CPU linears on this machine's route for their dtype (:func:`route_choice`);
    returns the number of layers off the stock kernel (0 on GPUs and where ``F.linear`` is the fastest).

    ``pack=False``: no packed copy of the weights (the pair loader found no memory for one): the
    fastest route measured without it, said once.
    """
    dtypes = {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"}
    if len(dtypes) != 1:
        return 0
    dtype = dtypes.pop()
    choice = route_choice(dtype)
    route = choice["route"]
    if route == "packed" and not pack:
        timings = {r: t for r, t in (choice.get("timings") or {}).items() if r != "packed"}
        route = pick_route(timings) if "linear" in timings else "linear"
        log.warning("linear weights left unpacked: no memory for a packed copy beside the pair (%s route instead, "
                    "slower)", route)
    return apply_route(model, route)


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


def install_fast_paths(model, *, pack: bool = True) -> None:
    """Every fix above that applies to ``model`` (what the pair loader calls); ``pack=False``: no packed
    copy of the linear weights (:func:`install_linear_route`)."""
    contiguous_output_head(model)
    install_linear_route(model, pack=pack)
    avoid_cudnn_attention(model)
