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
"""

from __future__ import annotations

import torch

_FLAG = "_specstop_contiguous_head"


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
