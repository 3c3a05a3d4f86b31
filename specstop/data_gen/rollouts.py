"""Step 5: greedy draft rollouts after every mismatch, for exact replay of greedy decoding.

At a mismatch position m (d_m = argmax q_m != X_m) a policy that keeps drafting continues from
the wrong prefix (x, X_<m, d_m). We roll the draft out greedily from there and store each step's
features, so replay can follow any stopping policy off the trajectory.

Batched manual loop: prefixes are left padded, the first forward fills a ``DynamicCache``, and
each further step feeds one token per row with the attention mask extended by one and explicit
position ids (last real position + 1), which is what single-sequence greedy ``generate`` computes.
Tests check the equality with ``draft.generate`` from each prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstop.data_gen.batching import left_pad
from specstop.data_gen.labels import argmax_vocab
from specstop.probs import DecodingConfig, entropy, logits_to_probs, top_k_probs


@dataclass
class Rollout:
    """One greedy continuation r_1..r_n after a mismatch token.

    Attributes:
        tokens: ``[n]`` int32.
        topk: ``[n, k]`` float32 top-k of the distribution r_j is drawn from.
        entropy: ``[n]`` float32.
        mismatch_hidden: ``[H]`` float16 hidden after d_m is fed in, or None.
        hidden: ``[n, H]`` float16 hidden after r_j is fed in, or None.
    """

    tokens: np.ndarray
    topk: np.ndarray
    entropy: np.ndarray
    mismatch_hidden: np.ndarray | None
    hidden: np.ndarray | None


def rollout_cap(position: int, length: int, max_new_tokens: int) -> int:
    """Steps worth rolling out after a mismatch at ``position``.

    A round never drafts past response position ``max_new_tokens - 2`` (K <= remaining - 1), and
    r_j sits at ``position + j``, so more than ``max_new_tokens - 2 - position`` steps are unused.
    """
    return max(0, min(length, max_new_tokens - 2 - position))


@torch.no_grad()
def greedy_rollouts(
    draft,
    prefixes: Sequence[Sequence[int]],
    lengths: Sequence[int],
    *,
    vocab_size: int,
    decoding: DecodingConfig,
    k: int,
    eos_ids: Sequence[int],
    pad_id: int,
    hidden: bool = False,
    batch_size: int = 64,
) -> list[Rollout]:
    """Roll the draft out greedily from every prefix.

    Args:
        draft: the draft HF causal LM.
        prefixes: P token lists ``x + X_<m + [d_m]``.
        lengths: P step caps (0 allowed: only ``mismatch_hidden`` is computed).
        vocab_size: the shared vocabulary (logits beyond it are never proposed).
        decoding: the decoding transform for the features (greedy: untempered softmax).
        k: top-k size. eos_ids: a drafted EOS ends the rollout (it is kept, as in drafting).
        pad_id: padding id. hidden: also return hidden states.
        batch_size: prefixes rolled out together (sorted by length to limit padding).

    Returns:
        P :class:`Rollout` in the order of ``prefixes``.
    """
    from transformers import DynamicCache

    device = draft.get_input_embeddings().weight.device
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=device)
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    results: list[Rollout | None] = [None] * len(prefixes)
    for cs in range(0, len(order), batch_size):
        idx = order[cs : cs + batch_size]
        ids, mask, pos = left_pad([prefixes[i] for i in idx], pad_id, device)
        cap = torch.as_tensor([int(lengths[i]) for i in idx], dtype=torch.long, device=device)
        B = len(idx)
        cache = DynamicCache(config=draft.config)
        out = draft(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
            use_cache=True, logits_to_keep=1, output_hidden_states=hidden,
        )
        logits = out.logits[:, -1]
        mis_h = out.hidden_states[-1][:, -1].to(torch.float16).cpu().numpy() if hidden else None
        toks, tks, ents, hids = [], [], [], []
        n = torch.zeros(B, dtype=torch.long, device=device)  # steps recorded so far
        alive = cap > 0
        next_pos = pos[:, -1] + 1
        step = 0
        while bool(alive.any()):
            q = logits_to_probs(logits, decoding, vocab_size=vocab_size)
            tok = argmax_vocab(logits, vocab_size)
            toks.append(tok)
            tks.append(top_k_probs(q, k))
            ents.append(entropy(q))
            rec = alive.clone()  # rows that recorded this step
            n = n + rec.long()
            step += 1
            alive = rec & (n < cap) & ~torch.isin(tok, eos)
            if not hidden and not bool(alive.any()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            out = draft(
                input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos.unsqueeze(-1),
                past_key_values=out.past_key_values, use_cache=True, output_hidden_states=hidden,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1]
            if hidden:
                hids.append(out.hidden_states[-1][:, -1])
        T = len(toks)
        tok_m = torch.stack(toks, 1).cpu().numpy() if T else np.zeros((B, 0), np.int64)
        tk_m = torch.stack(tks, 1).cpu().numpy() if T else np.zeros((B, 0, k), np.float32)
        en_m = torch.stack(ents, 1).cpu().numpy() if T else np.zeros((B, 0), np.float32)
        hid_m = torch.stack(hids, 1).to(torch.float16).cpu().numpy() if hids else None
        n_np = n.cpu().numpy()
        for j, i in enumerate(idx):
            m = int(n_np[j])
            results[i] = Rollout(
                tokens=tok_m[j, :m].astype(np.int32),
                topk=tk_m[j, :m].astype(np.float32),
                entropy=en_m[j, :m].astype(np.float32),
                mismatch_hidden=mis_h[j] if hidden else None,
                hidden=(hid_m[j, :m] if hid_m is not None else np.zeros((0, mis_h.shape[1]), np.float16))
                if hidden else None,
            )
    return results  # type: ignore[return-value]
