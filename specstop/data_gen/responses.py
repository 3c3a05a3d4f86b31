"""Step 1: render prompts and let the target write its responses (batched HF ``generate``).

The target decodes with exactly the transform of :mod:`specstop.probs` (temperature, top-k,
top-p, logits sliced to the shared vocabulary): the model's own ``generation_config`` (Qwen
instruct ships ``repetition_penalty=1.1``, ``top_k=20``...) is swapped for a clean one during the
call, so nothing outside our config shapes the responses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specstop.data_gen.batching import derive_seed, left_pad
from specstop.data_gen.config import GenerationConfig
from specstop.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class PreparedPrompt:
    """A prompt record rendered to token ids.

    Attributes:
        record: the ``specstop.prompts.PromptRecord``.
        ids: prompt token ids (after left truncation, if any).
        truncated: whether tokens were cut from the left to fit the context.
    """

    record: object
    ids: list[int]
    truncated: bool = False


@dataclass
class Response:
    """The target's response X_0..X_{N-1} (EOS included when it was emitted).

    Attributes:
        logits: ``[N, V_model]`` the target's raw logits p_0..p_{N-1} as ``generate`` computed them
            (model dtype, so bf16 logits are kept exactly), or None when not captured.
    """

    ids: list[int]
    stop_reason: str  # "eos" | "length"
    logits: torch.Tensor | None = None


# Capturing the target's logits during generation saves the teacher-forced target pass (about a
# third of labelling time on a CPU) but holds B x max_new_tokens x V logits per batch; above this
# many bytes the labels fall back to the teacher-forced pass.
CAPTURE_BUDGET_BYTES = 1536 * 2**20


def default_render(tokenizer, chat_template: bool, system_prompt: str | None) -> Callable[[str], list[int]]:
    """The renderer of ``specstop.prompts`` (imported lazily: data_gen tests do not need it)."""
    from specstop.prompts import render_prompt

    return lambda text: render_prompt(text, tokenizer, chat_template, system_prompt=system_prompt)


def context_limit(pair) -> int | None:
    """The smaller of the two models' ``max_position_embeddings`` (None when unknown)."""
    from specstop.pair.context import context_window

    return context_window(pair)


def max_prompt_tokens(pair, gen: GenerationConfig) -> int | None:
    """Prompt budget: the configured one, else the context minus room for the response and rollouts."""
    if gen.max_prompt_tokens is not None:
        return int(gen.max_prompt_tokens)
    ctx = context_limit(pair)
    if ctx is None:
        return None
    from specstop.pair.context import check_fits

    # A response that fills the window leaves a budget of zero or less: refused here, with both numbers,
    # rather than as a negative count of tokens once the first prompt is rendered.
    check_fits(pair, gen.max_new_tokens + 1, f"generation.max_new_tokens {gen.max_new_tokens} plus a prompt of at "
               "least one token", "lower generation.max_new_tokens (--max-new-tokens)")
    return ctx - gen.max_new_tokens


def prepare_prompts(
    records: Sequence, render: Callable[[str], list[int]], limit: int | None, overflow: str
) -> tuple[list[PreparedPrompt], list[str]]:
    """Render records; enforce non-empty prompts and the length limit.

    Returns:
        The prepared prompts and the ids of prompts skipped for length (``overflow == "skip"``).

    Raises:
        ValueError: an empty prompt (names its id).
    """
    out, skipped = [], []
    for rec in records:
        if not str(rec.text).strip():
            raise UserError(
                f"prompt {rec.prompt_id!r} is empty; remove it from the prompt set or fix its template/field"
            )
        ids = list(render(rec.text))
        if not ids:
            raise UserError(f"prompt {rec.prompt_id!r} renders to zero tokens; check the template")
        truncated = False
        if limit is not None and len(ids) > limit:
            if limit < 1:
                raise UserError(
                    f"no room for prompts: the context leaves {limit} tokens after max_new_tokens; "
                    "lower generation.max_new_tokens"
                )
            if overflow == "skip":
                log.warning("prompt %s has %d tokens > limit %d: skipped (prompt_overflow=skip)", rec.prompt_id, len(ids), limit)
                skipped.append(rec.prompt_id)
                continue
            log.warning(
                "prompt %s has %d tokens > limit %d: truncated from the left (prompt_overflow=truncate)",
                rec.prompt_id, len(ids), limit,
            )
            ids = ids[-limit:]
            truncated = True
        out.append(PreparedPrompt(rec, ids, truncated))
    return out, skipped


def eos_ids(pair) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS plus the target's generation EOS ids."""
    ids = []
    gen_eos = getattr(pair.target.generation_config, "eos_token_id", None)
    for e in [pair.tokenizer.eos_token_id] + (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
        if e is not None and int(e) not in ids and int(e) < pair.vocab_size:
            ids.append(int(e))
    if not ids:
        raise UserError("the tokenizer and the target define no EOS token; set tokenizer.eos_token")
    return ids


class _CaptureLogits:
    """Logits processor that records the raw next-token logits of every step (runs first, so it
    sees what the model computed, before masking, temperature or top-k/p)."""

    def __init__(self, dtype: torch.dtype, max_steps: int):
        self.dtype = dtype
        self.max_steps = max_steps
        self.buffer: torch.Tensor | None = None  # [B, max_steps, V], written in place step by step
        self.steps = 0

    def __call__(self, input_ids, scores):
        if self.buffer is None:
            # One allocation for the whole batch: stacking per-step copies at the end would copy
            # B x steps x V logits a second time.
            self.buffer = torch.empty((scores.shape[0], self.max_steps, scores.shape[-1]), dtype=self.dtype,
                                      device=scores.device)
        self.buffer[:, self.steps].copy_(scores)
        self.steps += 1
        return scores


def capture_fits(batch: int, max_new_tokens: int, vocab: int, dtype: torch.dtype) -> bool:
    """Whether a batch's captured logits stay under :data:`CAPTURE_BUDGET_BYTES`."""
    return batch * max_new_tokens * vocab * torch.empty(0, dtype=dtype).element_size() <= CAPTURE_BUDGET_BYTES


class _SharedVocabMask:
    """Logits processor: tokens past the shared vocabulary can never be generated."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids, scores):
        if scores.shape[-1] > self.vocab_size:
            scores = scores.clone()
            scores[:, self.vocab_size :] = float("-inf")
        return scores


@contextlib.contextmanager
def _clean_generation_config(model, gc):
    old = model.generation_config
    model.generation_config = gc
    try:
        yield
    finally:
        model.generation_config = old


@torch.no_grad()
def generate_responses(
    pair, prompts: Sequence[PreparedPrompt], gen: GenerationConfig, seed: int, *, capture_logits: bool = False
) -> list[Response]:
    """Target responses for one batch of prompts.

    Args:
        pair: the ModelPair.
        prompts: B prepared prompts (left padded together).
        gen: generation settings; ``temperature == 0`` is greedy.
        seed: run seed; sampled batches are seeded from it and the first prompt's index, so a
            resumed shard reproduces its batches.
        capture_logits: keep the target's logits of every response position (``Response.logits``).

    Returns:
        B responses, padding after EOS stripped, EOS kept as the last token.
    """
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers import LogitsProcessorList

    eos = eos_ids(pair)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else eos[0]
    ids, mask, _ = left_pad([p.ids for p in prompts], pad, pair.target_device)
    sample = not gen.decoding().greedy
    # Sampling knobs are set only when sampling (transformers warns about them under greedy).
    knobs = {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p} if sample else {}
    gc = HFGenerationConfig(
        max_new_tokens=gen.max_new_tokens,
        do_sample=sample,
        eos_token_id=eos,
        pad_token_id=pad,
        num_beams=1,
        repetition_penalty=1.0,
        **knobs,
    )
    if sample:
        torch.manual_seed(derive_seed(seed, prompts[0].record.source_index, "target-sample"))
    model_dtype = next(pair.target.parameters()).dtype
    capture = _CaptureLogits(model_dtype, gen.max_new_tokens) if capture_logits else None
    procs = ([capture] if capture else []) + [_SharedVocabMask(pair.vocab_size)]
    with _clean_generation_config(pair.target, gc):
        out = pair.target.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=gc,
            logits_processor=LogitsProcessorList(procs),
        )
    new = out[:, ids.shape[1] :].tolist()
    eos_set = set(eos)
    # [B, steps, V]: row b's first N_b steps (step t predicted response token t), as views.
    steps = capture.buffer if capture is not None else None
    responses = []
    for b, row in enumerate(new):
        cut = next((j for j, t in enumerate(row) if t in eos_set), None)
        ids_b = row[: gen.max_new_tokens] if cut is None else row[: cut + 1]
        logits_b = steps[b, : len(ids_b)] if steps is not None else None
        responses.append(Response(ids_b, "length" if cut is None else "eos", logits_b))
    return responses
