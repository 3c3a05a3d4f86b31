"""Left-padded batches with explicit attention masks and position ids, and per-prompt seeds.

Every batched forward in data_gen (teacher forcing, mixing, rollouts) packs sequences of
different lengths flush right, so the last real token of every row sits at the last column and
response positions of row b are the last N_b columns. Position ids count real tokens only, so a
padded row sees exactly the positions it would see alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack token lists flush right.

    Args:
        seqs: B token-id lists (each non-empty).
        pad_id: id written into padding (masked out, so any valid id works).
        device: where the tensors go.

    Returns:
        ``input_ids [B, L]`` long, ``attention_mask [B, L]`` long (1 = real token) and
        ``position_ids [B, L]`` long (0 for the first real token; padding gets 0 too).
    """
    if not seqs:
        raise ValueError("left_pad needs at least one sequence")
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        if len(s) == 0:
            raise ValueError("left_pad got an empty sequence (every row needs at least one token)")
        ids[b, L - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, L - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def derive_seed(seed: int, index: int, stream: str) -> int:
    """A 63-bit seed for (run seed, prompt index, purpose) that does not depend on batching.

    Seeds derive from the prompt's stable ``source_index`` rather than from batch order, so a
    resumed run, another batch size or another worker count draws the same random numbers.
    """
    h = hashlib.sha256(f"{int(seed)}:{int(index)}:{stream}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def uniforms(seed: int, index: int, stream: str, n: int) -> torch.Tensor:
    """``[n]`` float64 uniforms in [0, 1) from a CPU generator seeded by :func:`derive_seed`."""
    gen = torch.Generator().manual_seed(derive_seed(seed, index, stream))
    return torch.rand(n, generator=gen, dtype=torch.float64)


def sample_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of ``probs`` from given uniforms.

    Uniforms are drawn on the CPU (:func:`uniforms`) and the search runs on the probabilities'
    device, so samples are reproducible across devices and batch compositions without copying
    ``[rows, V]`` distributions to the host.

    Args:
        probs: ``[R, V]`` float32 distributions.
        u: ``[R]`` uniforms in [0, 1).

    Returns:
        ``[R]`` long token ids; each has positive probability (the CDF jumps at it).
    """
    cdf = probs.float().cumsum(-1)
    total = cdf[:, -1:]
    target = (u.to(cdf.device, torch.float64).unsqueeze(-1) * total.double()).float()
    # float32 rounding could lift the target to the total mass; keep it strictly below.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first index whose CDF exceeds the target, i.e. a token with q > 0.
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
