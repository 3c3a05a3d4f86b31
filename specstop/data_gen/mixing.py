"""Step 4: SpecDec++ token mixing (section 4.4).

Per response and draw, Z_i = X_i with probability ``rate`` and Y_i (the teacher-forced draft
sample) otherwise. One draft pass over x + Z gives, at each position i holding a draft token,
the features of q(. | x, Z_<i) (what Y_i would be judged on at decode time) and the hidden state
e_i(x, Z_<i, Y_i) after Y_i is fed in. The label stays the teacher-forced
min(1, p(Y_i | x, X_<i) / q(Y_i | x, X_<i)), as in the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specstop.data_gen.batching import uniforms
from specstop.data_gen.forward import forward_positions
from specstop.data_gen.labels import TeacherLabels, check_finite
from specstop.probs import DecodingConfig, entropy, logits_to_probs, top_k_probs


def mixing_keep_mask(seed: int, prompt_index: int, draw: int, n: int, rate: float) -> np.ndarray:
    """``[n]`` bool: True where Z_i keeps the target token X_i (probability ``rate``)."""
    return (uniforms(seed, prompt_index, f"mix-{draw}", n) < rate).numpy()


@torch.no_grad()
def mixed_rows(
    pair,
    prompt_ids: Sequence[str],
    prompt_indices: Sequence[int],
    prompts: Sequence[Sequence[int]],
    teacher: TeacherLabels,
    *,
    decoding: DecodingConfig,
    k: int,
    seed: int,
    rate: float,
    draws: int,
    batch_size: int,
    chunk_rows: int = 16,
) -> tuple[list[int], dict[str, np.ndarray]]:
    """Mixed rows of a batch (hidden states are always stored: mixing exists for them).

    Args:
        prompt_ids, prompt_indices, prompts: per prompt of the batch.
        teacher: the batch's teacher-forced labels (X, Y and the labels per position).
        rate: probability of keeping the target token; draws: mixed sequences per response.
        batch_size: mixed sequences per draft forward.

    Returns:
        ``(row_prompt, columns)``: for every row the batch index of its prompt, and the mixed
        table's columns except the id columns (``draw``, ``position``, ``draft_token``, ``topk``
        ``[R, k]``, ``entropy``, ``accept_prob``, ``accept_expected``, ``hidden`` ``[R, H]`` float16).
    """
    V = pair.vocab_size
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
    c, off = teacher.columns, teacher.offsets
    jobs = []  # (batch index b, draw, Z, draft positions)
    for b in range(len(prompts)):
        x = c["token"][off[b] : off[b + 1]]
        y = c["draft_token"][off[b] : off[b + 1]]
        for d in range(draws):
            keep = mixing_keep_mask(seed, prompt_indices[b], d, len(x), rate)
            z = np.where(keep, x, y)
            pos = np.nonzero(~keep)[0]
            if len(pos):
                jobs.append((b, d, z, pos))
    cols: dict[str, list] = {n: [] for n in (
        "draw", "position", "draft_token", "topk", "entropy", "accept_prob", "accept_expected", "hidden")}
    row_prompt: list[int] = []
    for js in range(0, len(jobs), batch_size):
        chunk = jobs[js : js + batch_size]
        out = forward_positions(
            pair.draft, [prompts[b] for b, *_ in chunk], [z.tolist() for _, _, z, _ in chunk], pad, hidden=True
        )
        # Keep only the positions that hold a draft token.
        sel = np.concatenate([out.offsets[j] + pos for j, (_, _, _, pos) in enumerate(chunk)])
        sel_t = torch.as_tensor(sel, dtype=torch.long, device=out.logits.device)
        logits = out.logits[sel_t]
        hidden = out.hidden[sel_t.to(out.hidden.device)]
        sel_off = np.cumsum([0] + [len(pos) for *_, pos in chunk]).tolist()
        for s in range(0, len(sel), chunk_rows):
            e = min(len(sel), s + chunk_rows)
            check_finite(logits[s:e, :V], s, sel_off, [prompt_ids[b] for b, *_ in chunk], "draft (mixing pass)")
            q = logits_to_probs(logits[s:e], decoding, vocab_size=V)
            cols["topk"].append(top_k_probs(q, k).cpu().numpy())
            cols["entropy"].append(entropy(q).cpu().numpy())
        cols["hidden"].append(hidden.to(torch.float16).cpu().numpy())
        for b, d, _z, pos in chunk:
            rows = off[b] + pos
            cols["draw"].append(np.full(len(pos), d, np.int32))
            cols["position"].append(pos.astype(np.int32))
            cols["draft_token"].append(c["draft_token"][rows])
            cols["accept_prob"].append(c["accept_prob"][rows])
            cols["accept_expected"].append(c["accept_expected"][rows])
            row_prompt.extend([b] * len(pos))
    H = c["hidden"].shape[1] if "hidden" in c else 0
    empty = {"topk": np.zeros((0, k), np.float32), "hidden": np.zeros((0, H), np.float16)}
    result = {n: (np.concatenate(v) if v else empty.get(n, np.zeros(0))) for n, v in cols.items()}
    return row_prompt, result
