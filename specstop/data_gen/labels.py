"""Steps 2-3: teacher-forced distributions p_i, q_i and the per-position labels of the tokens table.

For a batch of (prompt x, response X) pairs one target forward and one draft forward over x + X
give p_i = p(. | x, X_<i) and q_i = q(. | x, X_<i); all distribution math is
:mod:`specstop.probs` in float32. Random draws (Y_i ~ q_i, the Bernoulli ``verified``) use uniforms
seeded per prompt (:func:`specstop.data_gen.batching.uniforms`), so labels do not depend on batch
composition and a resumed run reproduces them exactly.

Label semantics follow the decoding the dataset describes (:data:`LABEL_SEMANTICS`): greedy data
(T = 0) label the argmax draft token, accepted iff it equals X_i (``accept_prob`` and ``verified``
are the greedy match); sampled data label Y_i ~ q_i at the decoding temperature/top-k/top-p with
``accept_prob = min(1, p(Y_i)/q(Y_i))`` and a Bernoulli ``verified``. ``tv`` (DISCO) is TV(p_i, q_i)
in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstop.data_gen.batching import sample_from_uniform, uniforms
from specstop.data_gen.forward import PrefixCache, RowLogits, forward_positions
from specstop.errors import UserError
from specstop.probs import (
    DecodingConfig,
    accept_probability,
    entropy,
    logits_to_probs,
    residual_distribution,
    top_k_probs_and_ids,
    tv_distance,
)


@dataclass
class TeacherLabels:
    """Columns of the tokens table for a batch, flattened over (prompt b, position i).

    Attributes:
        offsets: ``[B + 1]``; prompt b owns rows ``offsets[b]:offsets[b+1]``.
        columns: numpy columns named as in ``schema.features_for("tokens")`` except the id
            columns; ``topk`` is ``[R, k]``, ``hidden`` ``[R, H]`` float16 when requested.
    """

    offsets: list[int]
    columns: dict[str, np.ndarray]
    draft_prefix: PrefixCache | None = None


# Recorded in manifests and in the shard fingerprint: a dataset never mixes label semantics.
# 2: greedy data label the argmax draft token (1 sampled Y_i at T = 1). 3: tokens also record
# p_i(X_i), q_i(X_i) and a draw from the residual norm(max(q_i - p_i, 0)) (sampled replay).
# 4: tokens also record the ids of q_i's top-k (topk_ids) and X_i's rank among them (target_rank):
# the candidate children a token tree drafts at i, and which of them the target accepts.
LABELS_VERSION = 4


def label_semantics(decoding: DecodingConfig) -> str:
    """One line saying what ``draft_token`` / ``accept_prob`` / ``verified`` mean for ``decoding``."""
    if decoding.greedy:
        return "greedy: draft_token = argmax q_i; accept_prob = verified = greedy match (draft_token == X_i)"
    return (f"sampled (T={decoding.temperature:g}, top_k={decoding.top_k}, top_p={decoding.top_p:g}): "
            "draft_token ~ q_i; accept_prob = min(1, p/q); verified ~ Bernoulli(accept_prob)")


class NonFiniteLogitsError(UserError, FloatingPointError):
    """A model produced NaN/inf logits (usually an overflow in float16)."""


def check_finite(logits: torch.Tensor, row0: int, offsets: Sequence[int], prompt_ids: Sequence[str], who: str) -> None:
    """Raise naming the prompt (and position) when ``logits [r, V]`` hold NaN or inf."""
    # amax propagates NaN and +inf (one reduction instead of a [r, V] bool tensor); -inf is a
    # legitimate masked logit unless the whole row is -inf.
    _raise_if_not_finite(logits.amax(-1), row0, offsets, prompt_ids, who)


def checked_argmax(logits: torch.Tensor, row0: int, offsets: Sequence[int], prompt_ids: Sequence[str],
                   who: str) -> torch.Tensor:
    """:func:`check_finite` and the row argmax in one pass over ``logits [r, V]`` -> ``[r]``.

    ``max`` returns the first maximal index, as ``argmax`` does, and bf16 -> float32 is exact, so
    this equals :func:`argmax_vocab` on the same (sliced) logits."""
    top, arg = logits.max(-1)
    _raise_if_not_finite(top, row0, offsets, prompt_ids, who)
    return arg


def _raise_if_not_finite(top: torch.Tensor, row0: int, offsets: Sequence[int], prompt_ids: Sequence[str],
                         who: str) -> None:
    bad = ~torch.isfinite(top)
    if bool(bad.any()):
        r = row0 + int(bad.nonzero()[0, 0])
        b = int(np.searchsorted(np.asarray(offsets), r, side="right") - 1)
        raise NonFiniteLogitsError(
            f"the {who} produced NaN/inf logits for prompt {prompt_ids[b]!r} at response position "
            f"{r - offsets[b]}; the model overflows in its dtype - rerun with --dtype float32 (or bfloat16 "
            "instead of float16), or drop the prompt"
        )


def argmax_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Greedy token over the shared vocabulary. ``[R, V_model] -> [R]``.

    Equal to ``argmax q`` (softmax, temperature, top-k and top-p all keep the maximum), but taken on
    the float32 logits so that two logits which round to the same float32 probability are still
    ordered as the decoder's ``argmax(logits)`` orders them.
    """
    return logits[..., :vocab_size].float().argmax(-1)


@torch.no_grad()
def teacher_labels(
    pair,
    prompt_ids: Sequence[str],
    prompt_indices: Sequence[int],
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    decoding: DecodingConfig,
    k: int,
    seed: int,
    hidden: bool = False,
    chunk_rows: int = 16,
    target_logits: Sequence[torch.Tensor] | None = None,
    keep_draft_cache: bool = False,
) -> TeacherLabels:
    """Label every response position of a batch by teacher forcing.

    Args:
        pair: the ModelPair.
        prompt_ids: B prompt ids (for error messages).
        prompt_indices: B stable prompt indices (``PromptRecord.source_index``) seeding the draws.
        prompts, responses: B token-id lists each.
        decoding: the decoding transform (greedy: untempered softmax).
        k: top-k feature size.
        seed: run seed.
        hidden: store the draft's final hidden state after X_i is fed in.
        chunk_rows: rows turned into ``[rows, V]`` float32 distributions at once.
        target_logits: B ``[N_b, V_model]`` target logits captured while generating the responses
            (:func:`~specstop.data_gen.responses.generate_responses` ``capture_logits``); None runs a
            teacher-forced target pass instead. Both are p_i = p(. | x, X_<i); they differ only by
            kernel rounding (a block pass vs single steps).
        keep_draft_cache: keep the draft pass's KV cache (``draft_prefix``) for rollouts.

    Returns:
        :class:`TeacherLabels`.
    """
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
    V = pair.vocab_size
    if target_logits is not None:
        t_logits = RowLogits(target_logits)  # rows read per chunk: no [R, V] copy of every response
    else:
        t_logits = forward_positions(pair.target, prompts, responses, pad).logits
    d_out = forward_positions(pair.draft, prompts, responses, pad, hidden=hidden, keep_cache=keep_draft_cache)
    offsets = d_out.offsets
    R = offsets[-1]
    dev = pair.draft_device
    x_tok = torch.as_tensor([t for r in responses for t in r], dtype=torch.long, device=dev)
    u_sample = torch.cat([uniforms(seed, idx, "draft-sample", len(r)) for idx, r in zip(prompt_indices, responses)])
    u_verify = torch.cat([uniforms(seed, idx, "verify", len(r)) for idx, r in zip(prompt_indices, responses)])

    u_reject = torch.cat([uniforms(seed, idx, "reject-sample", len(r)) for idx, r in zip(prompt_indices, responses)])
    cols: dict[str, list] = {c: [] for c in (
        "draft_argmax", "target_top1", "topk", "entropy", "tv", "draft_token", "accept_prob", "verified",
        "target_prob", "draft_prob", "reject_token", "reject_draft_prob", "topk_ids", "target_rank")}
    for s in range(0, R, chunk_rows):
        e = min(R, s + chunk_rows)
        dl = d_out.logits[s:e]
        tl = t_logits[s:e].to(dev)
        d_arg = checked_argmax(dl[..., :V], s, offsets, prompt_ids, "draft")
        t_arg = checked_argmax(tl[..., :V], s, offsets, prompt_ids, "target")
        q = logits_to_probs(dl, decoding, vocab_size=V)
        p = logits_to_probs(tl, decoding, vocab_size=V)
        if decoding.greedy:
            # Greedy decoding drafts the argmax and accepts it iff it equals the target's token:
            # the draft token, its acceptance and the verification outcome follow that rule.
            y = d_arg
            acc = (d_arg == x_tok[s:e]).float()
        else:
            y = sample_from_uniform(q, u_sample[s:e])
            acc = accept_probability(p, q, y)
        cols["draft_argmax"].append(d_arg)
        cols["target_top1"].append(t_arg)
        top_vals, top_ids = top_k_probs_and_ids(q, k)
        cols["topk"].append(top_vals)
        # Token trees draft q_i's top-k as candidate children: their ids, and which one (if any)
        # is the target's token X_i (-1: none of them), label a tree node (specstop.train.tree_nodes).
        hit = top_ids == x_tok[s:e].unsqueeze(-1)
        cols["topk_ids"].append(top_ids)
        cols["target_rank"].append(torch.where(hit.any(-1), hit.int().argmax(-1), -1))
        cols["entropy"].append(entropy(q))
        cols["tv"].append(tv_distance(p, q))
        cols["draft_token"].append(y)
        cols["accept_prob"].append(acc)
        # Bernoulli(accept_prob) from a seeded uniform: the outcome speculative sampling would verify
        # (greedy: acc is 0 or 1, so this is the greedy match itself).
        cols["verified"].append(u_verify[s:e].to(dev) < acc.double())
        # For sampled replay (eval.sampled): the probabilities of the target's own token, and the draft
        # token a rejection at this position would have drawn, Y' ~ norm(max(q - p, 0)) (greedy: the
        # argmax, the only token greedy drafting proposes).
        xi = x_tok[s:e].unsqueeze(-1)
        cols["target_prob"].append(p.gather(-1, xi).squeeze(-1))
        cols["draft_prob"].append(q.gather(-1, xi).squeeze(-1))
        if decoding.greedy:
            rej = d_arg
        else:
            rej = sample_from_uniform(residual_distribution(q, p), u_reject[s:e].to(dev).float())
        cols["reject_token"].append(rej)
        cols["reject_draft_prob"].append(q.gather(-1, rej.long().unsqueeze(-1)).squeeze(-1))
        del q, p
    out: dict[str, np.ndarray] = {}
    for c, parts in cols.items():
        out[c] = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, k) if c in ("topk", "topk_ids") else 0)
    out["position"] = np.concatenate([np.arange(len(r)) for r in responses]).astype(np.int32) if R else np.zeros(0, np.int32)
    out["token"] = x_tok.cpu().numpy().astype(np.int32)
    out["accept_expected"] = (1.0 - out["tv"]).astype(np.float32)
    out["greedy_match"] = out["draft_argmax"] == out["token"]
    for c in ("draft_argmax", "target_top1", "draft_token", "reject_token", "topk_ids", "target_rank"):
        out[c] = out[c].astype(np.int32)
    if hidden:
        out["hidden"] = d_out.hidden.to(torch.float16).cpu().numpy() if R else np.zeros((0, 0), np.float16)
    return TeacherLabels(offsets, out, d_out.prefix)
