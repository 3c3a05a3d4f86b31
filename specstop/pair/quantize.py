"""Weight-only int8 / int4 linear layers: a cheaper draft step on CPU.

A CPU decode step streams every weight of the model once per token, so its cost is close to the
model's size in bytes over the memory bandwidth. Storing the draft's linear weights in int8 (per
output channel scales) or int4 (asymmetric, one scale and zero per group of ``group_size`` inputs)
moves 2x or about 3.5x fewer bytes than bf16. PyTorch ships CPU kernels for both that multiply a
bf16/fp32 activation by the packed weight without dequantizing it in memory:
``torch._weight_int8pack_mm`` and ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

The output head is quantized too (a separate copy: tied input embeddings stay in the model's dtype),
since for the 0.5B reference draft it is a quarter of the weights (151,936 x 896).

Only a draft is ever quantized: the target's distribution is the one decoding must reproduce, and
every decoder verifies the draft's proposals against the full-precision target, so a quantized draft
changes the acceptance rate and the cost of a step, never the output. Which scheme is fastest (and
whether int4's lower agreement with the target costs more than its cheaper step saves) depends on
the CPU. Measured on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX), one-token steps of the 0.5B
reference draft: bf16 0.112 s, int8 0.060 s, int4 0.025 s; a prefill of 150 rows takes bf16 0.44 s,
int8 1.22 s and int4 0.93 s. So a quantized draft keeps a float copy of its weights for blocks of
:data:`PREFILL_ROWS` rows and more (``prefill_rows``): its decode steps stream the packed weights, its
prefills run at bf16's speed, for the float copy's memory. Data generation loads the draft without the
copy (``load_pair(draft_prefill_copy=False)``): its teacher-forced forwards score every response
position in one block, and those rows must be the packed kernels' numerics, which the draft's decode
steps run. In vLLM, ``calibrate-cost --engine vllm --draft-quant`` times the quantized draft where it
runs.
"""

from __future__ import annotations

import torch
from torch import nn

from specstop.errors import UserError

#: Weight-only schemes a draft can be quantized with.
SCHEMES = ("int8", "int4")
#: Rows from which a block runs on a float copy of the weights (a prefill): where the packed kernels
#: start to lose to bf16 for the 0.5B reference draft, whole forwards timed on the 2-core Zen 4
#: (int8 slower from 8 rows, int4 from 16; at 150 rows 1.22 s and 0.93 s against bf16's 0.44 s).
PREFILL_ROWS = {"int8": 8, "int4": 16}
#: int4 group sizes tried, largest first: the inputs sharing one scale and zero point.
INT4_GROUPS = (128, 64, 32)
INT4_GROUP = INT4_GROUPS[0]
_INT4_TILES = 8  # the CPU packing's inner-k tiles (the kernel's layout)
_INT4_ROWS = 16  # the CPU packing's output rows per block


def _flatten(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return x.reshape(-1, in_features).contiguous()


class _WeightOnlyLinear(nn.Module):
    """What both weight-only layers share: an optional float copy for blocks of many rows.

    The packed kernels win where a step streams the weights for a few rows (decoding); a prefill of
    hundreds of rows is compute-bound, and there they lose to the float matmul (see the module doc).
    With ``prefill_rows`` set, blocks of at least that many rows run on a float copy of the weight.
    """

    prefill_rows: int | None = None

    def _keep_float(self, linear: nn.Linear, prefill_rows: int | None) -> None:
        self.prefill_rows = prefill_rows
        self.register_buffer("float_weight", linear.weight.detach().clone() if prefill_rows is not None else None)

    def _float_rows(self, flat: torch.Tensor) -> bool:
        return self.prefill_rows is not None and flat.shape[0] >= self.prefill_rows

    def _float_forward(self, flat: torch.Tensor) -> torch.Tensor:
        w = self.float_weight if self.float_weight.dtype == flat.dtype else self.float_weight.to(flat.dtype)
        return torch.nn.functional.linear(flat, w)


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x W^T + b`` with ``W`` stored as int8, one scale per output channel (symmetric).

    Args:
        linear: the layer to replace; its weight ``[out, in]`` is quantized, its bias kept.
        prefill_rows: blocks of at least this many rows run on a float copy of the weight (None: never).
    """

    def __init__(self, linear: nn.Linear, prefill_rows: int | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._keep_float(linear, prefill_rows)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` float32 (for checks)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``, in ``x``'s dtype."""
        flat = _flatten(x, self.in_features)
        if self._float_rows(flat):
            y = self._float_forward(flat)
        else:
            y = torch._weight_int8pack_mm(flat, self.qweight, self.scales.to(flat.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x W^T + b`` with ``W`` stored as int4: per group of ``group_size`` inputs of one output
    channel, ``W = (q - 8) * scale + zero`` with ``q`` in 0..15 (the CPU kernel's convention).

    Args:
        linear: the layer to replace; ``in_features`` must be a multiple of ``group_size``.
        group_size: inputs per scale/zero pair.
        prefill_rows: blocks of at least this many rows run on a float copy of the weight (None: never).
    """

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP, prefill_rows: int | None = None) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
        self.in_features, self.out_features, self.group_size = k, n, group_size
        # The CPU packing takes output sizes in multiples of 16: pad with zero rows, sliced off after.
        self.padded = -(-n // _INT4_ROWS) * _INT4_ROWS
        w = linear.weight.detach().float()
        if self.padded != n:
            w = torch.cat([w, w.new_zeros(self.padded - n, k)])
        n = self.padded
        w = w.reshape(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8.0 * scale  # so that (q - 8) * scale + zero == q * scale + lo
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_TILES))
        # [k / group, n, 2]: the kernel's layout of (scale, zero) pairs.
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._keep_float(linear, prefill_rows)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``[out, in]`` float32 (for checks): the kernel applied
        to the identity matrix, so the check does not depend on the packed layout."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_and_zeros)
        return cols.float().t()[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``, in ``x``'s dtype."""
        flat = _flatten(x, self.in_features)
        if self._float_rows(flat):
            y = self._float_forward(flat)
        else:
            sz = self.scales_and_zeros if self.scales_and_zeros.dtype == flat.dtype else self.scales_and_zeros.to(flat.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, sz)
            if self.padded != self.out_features:
                y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def check_scheme(scheme: str | None) -> str | None:
    """``scheme`` normalized (None, "", "none", "bf16" -> None), or a UserError naming the choices."""
    if scheme is None or str(scheme).strip().lower() in ("", "none", "bf16", "float"):
        return None
    s = str(scheme).strip().lower()
    if s not in SCHEMES:
        raise UserError(f"unknown draft quantization {scheme!r}; choose one of: none, {', '.join(SCHEMES)}")
    return s


def _int4_group(in_features: int, group_size: int | None) -> int | None:
    if group_size is not None:
        return group_size if in_features % group_size == 0 else None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def _weight_only_layer(linear: nn.Linear, scheme: str, group_size: int | None,
                       prefill_rows: int | None) -> _WeightOnlyLinear | None:
    """``linear`` as a weight-only ``scheme`` layer, or None where no int4 group size divides its inputs."""
    if scheme == "int8":
        return Int8WeightOnlyLinear(linear, prefill_rows)
    group = _int4_group(linear.in_features, group_size)
    return None if group is None else Int4WeightOnlyLinear(linear, group, prefill_rows)


def weight_only(weight: torch.Tensor, scheme: str, group_size: int | None = None) -> _WeightOnlyLinear | None:
    """A bias-free weight-only ``scheme`` layer multiplying by ``weight`` ``[out, in]`` (a copy, packed), or None
    where no int4 group size divides ``in``: for engines that keep their own layers and bias (vLLM's, see
    :mod:`specstop.decode.vllm_draft_quant`).

    Args:
        weight: ``[out, in]`` float weight on CPU.
        scheme: "int8" or "int4".
        group_size: int4 inputs per scale/zero pair (None: the largest of :data:`INT4_GROUPS` dividing ``in``).
    """
    scheme = check_scheme(scheme)
    if scheme is None:
        raise UserError("weight_only needs a scheme: " + ", ".join(SCHEMES))
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return _weight_only_layer(linear, scheme, group_size, None)


def quantize_weights(model: nn.Module, scheme: str, *, group_size: int | None = None,
                     prefill_rows: int | None = None) -> dict:
    """Replace ``model``'s ``nn.Linear`` layers (output head included) by weight-only ``scheme`` layers, in place.

    int4 groups are ``group_size`` inputs, or by default the largest of :data:`INT4_GROUPS` dividing
    the layer's input size; a layer no group size divides stays as it is (counted in ``kept``). The
    model must be on CPU: the kernels are CPU ones.

    Args:
        model: a causal LM (or any module) on CPU.
        scheme: "int8" or "int4".
        group_size: int4 inputs per scale/zero pair (None: chosen per layer, see above).
        prefill_rows: blocks of at least this many rows (a prefill) run on a float copy of each weight,
            kept beside the packed one (None: no copy, every block through the packed kernel).

    Returns:
        ``{"scheme", "group_sizes" (int4), "layers", "kept", "bytes_before", "bytes_after",
        "prefill_rows", "prefill_copy_bytes"}``: the linear weights' bytes before and after (what a
        decode step streams, embeddings aside) and the float copies' bytes.
    """
    scheme = check_scheme(scheme)
    if scheme is None:
        raise UserError("quantize_weights needs a scheme: " + ", ".join(SCHEMES))
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        raise UserError(f"weight-only {scheme} drafts run on CPU (PyTorch's CPU kernels); the draft is on "
                        f"{param.device.type}: load it on CPU or leave it unquantized")
    record = {"scheme": scheme, "layers": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0,
              "prefill_rows": prefill_rows, "prefill_copy_bytes": 0}
    groups: set[int] = set()
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        before = mod.weight.numel() * mod.weight.element_size()
        new = _weight_only_layer(mod, scheme, group_size, prefill_rows)
        if new is None:
            record["kept"] += 1
            record["bytes_before"] += before
            record["bytes_after"] += before
            continue
        if scheme == "int4":
            groups.add(new.group_size)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        record["layers"] += 1
        record["bytes_before"] += before
        sizes = {n: b.numel() * b.element_size() for n, b in new.named_buffers()}
        record["prefill_copy_bytes"] += sizes.pop("float_weight", 0)
        record["bytes_after"] += sum(sizes.values())
    if scheme == "int4":
        record["group_sizes"] = sorted(groups)
    if hasattr(model, "config"):
        # The output head is its own copy now; a later tie_weights() must not put the float one back.
        model.config.tie_word_embeddings = False
    model.specstop_draft_quant = dict(record)  # how this draft was made, for records and checks
    return record
