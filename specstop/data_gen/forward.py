"""One batched forward over prompt + response, returning what each response position needs.

Layout (see :mod:`specstop.data_gen.batching`): row b holds ``prompt_b + resp_b`` flush right in
``L`` columns, so response token i of row b sits at column ``L - N_b + i``. The distribution
token i is drawn from (q_i / p_i) comes from the logits at the column *before* it,
``L - N_b + i - 1``; the hidden state "after token i is fed in" is at column ``L - N_b + i``.
Only the last ``N_max + 1`` columns of logits are materialised (``logits_to_keep``): the prompt's
own next-token logits are never needed, and ``[B, L, V]`` logits would not fit for long prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstop.data_gen.batching import left_pad
from specstop.pair.compat import cache_kwarg


class RowLogits:
    """``[R, V]`` logit rows read lazily from per-sequence blocks, without one big copy.

    Row r is row ``r - offsets[b]`` of ``parts[b]`` (a ``[N_b, V]`` tensor, typically a view into a
    model's ``[B, C, V]`` output or the logits captured during ``generate``). Materialising all R
    rows at once would copy B x N x V logits (about 0.6 GB for 16 x 128 rows of Qwen's 151,936 in
    bf16) and page-fault through fresh memory; label math reads a few rows at a time instead.

    Indexing with a slice or a 1-D index array returns a ``[r, V]`` tensor (a copy of those rows); an
    int returns one ``[V]`` row; a tuple indexes rows first, then the remaining dimensions.
    """

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.vocab = int(self.parts[0].shape[-1]) if self.parts else 0

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.vocab)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device if self.parts else torch.device("cpu")

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, tuple):  # (rows, columns...): rows first, then the rest as on a tensor
            return self[key[0]][(slice(None), *key[1:])] if not isinstance(key[0], int) else self[key[0]][key[1:]]
        if isinstance(key, int):
            return self[np.array([key])][0]
        if isinstance(key, slice):
            rows = np.arange(len(self))[key]
        else:
            rows = np.asarray(key.cpu() if isinstance(key, torch.Tensor) else key, dtype=np.int64).reshape(-1)
        if len(rows) == 0:
            return torch.zeros((0, self.vocab), dtype=self.parts[0].dtype if self.parts else torch.float32)
        b = np.searchsorted(self.offsets, rows, side="right") - 1
        i = rows - self.offsets[b]
        # Runs of consecutive rows of one sequence are sliced, not gathered row by row.
        starts = np.flatnonzero(np.r_[True, (b[1:] != b[:-1]) | (i[1:] != i[:-1] + 1)])
        ends = np.r_[starts[1:], len(rows)]
        pieces = [self.parts[b[s]][i[s] : i[s] + (e - s)] for s, e in zip(starts, ends)]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)


@dataclass
class PositionOutputs:
    """Per-response-position outputs of one batched forward, flattened row-major.

    Attributes:
        logits: ``[R, V_model]`` raw logits (model dtype) predicting response token i, where
            ``R = sum_b N_b`` and rows run over (b, i) in order (:class:`RowLogits`: read lazily).
        hidden: ``[R, H]`` final-layer hidden state at response token i (after the model's final
            norm: HF's ``hidden_states[-1]``), or None when not requested.
        offsets: ``[B + 1]`` row offsets: rows of sequence b are ``offsets[b]:offsets[b+1]``.
    """

    logits: RowLogits
    hidden: torch.Tensor | None
    offsets: list[int]
    prefix: PrefixCache | None = None


@dataclass
class PrefixCache:
    """The KV cache of a teacher-forced pass, kept so later passes can continue from any prefix of a
    row without re-encoding it (rollouts start from x + X_<m of every mismatch m).

    Attributes:
        cache: the pass's ``DynamicCache`` ``[B, heads, L, d]`` per layer (left padded).
        mask: ``[B, L]`` attention mask. positions: ``[B, L]`` position ids.
        lengths: ``[B]`` response lengths N_b; response token i of row b sits at column L - N_b + i.
    """

    cache: object
    mask: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]

    def column(self, b: int, i: int) -> int:
        """Padded column of response token i of row b (the prefix x + X_<i ends just before it)."""
        return self.mask.shape[1] - self.lengths[b] + i


@torch.no_grad()
def forward_positions(
    model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, *, hidden: bool = False,
    keep_cache: bool = False,
) -> PositionOutputs:
    """Teacher-forced forward of ``model`` over ``prompt_b + response_b`` for every b.

    Args:
        model: a HF causal LM (inputs go to its embedding's device).
        prompts: B prompt id lists (each non-empty).
        responses: B response id lists (may be empty).
        pad_id: padding id (masked).
        hidden: also return the final hidden state at every response token.
        keep_cache: also return the pass's KV cache (:class:`PrefixCache`).

    Returns:
        :class:`PositionOutputs` for the ``sum_b N_b`` response positions.
    """
    device = model.get_input_embeddings().weight.device
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    n = [len(r) for r in responses]
    offsets = [0]
    for x in n:
        offsets.append(offsets[-1] + x)
    nmax = max(n) if n else 0
    if nmax == 0:
        return PositionOutputs(RowLogits([]), None, offsets)
    ids, mask, pos = left_pad(seqs, pad_id, device)
    L = ids.shape[1]
    cache = None
    if keep_cache:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        **cache_kwarg(model, cache),
        use_cache=keep_cache,
        logits_to_keep=nmax + 1,
        output_hidden_states=hidden,
    )
    b_idx = torch.cat([torch.full((x,), b, dtype=torch.long) for b, x in enumerate(n)])
    i_idx = torch.cat([torch.arange(x) for x in n])
    n_b = torch.as_tensor(n, dtype=torch.long)[b_idx]
    # kept column c holds full column L - (nmax + 1) + c; token i's logits are at full L - N_b + i - 1.
    logits = RowLogits([out.logits[b, nmax - x : nmax] for b, x in enumerate(n)])
    h = None
    if hidden:
        hs = out.hidden_states[-1]
        h = hs[b_idx.to(hs.device), (L - n_b + i_idx).to(hs.device)]
    prefix = PrefixCache(cache, mask, pos, n) if keep_cache else None
    return PositionOutputs(logits, h, offsets, prefix)
