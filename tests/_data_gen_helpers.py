"""Shared helpers for the data_gen tests: prompt records, a renderer, brute-force references."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specstop.data_gen.responses import _SharedVocabMask


@dataclass
class Rec:
    """Stand-in for ``specstop.prompts.PromptRecord`` (same fields)."""

    prompt_id: str
    text: str
    split: str
    source_index: int
    meta: dict = field(default_factory=dict)


TEXTS = [
    "def add(a, b):",
    "Write a haiku about the sea and the wind in the evening.",
    "hi",
    "Sort a list of numbers in Python, then print the largest three.",
    "What is 2 + 2?",
    "Explain speculative decoding in one sentence.",
    "x = [i * i for i in range(10)]",
    "Translate 'good morning' to French.",
]


def records(n: int, splits=("train", "validation", "test")) -> list[Rec]:
    return [Rec(f"p{i}", TEXTS[i % len(TEXTS)] + f" #{i}", splits[i % len(splits)], i) for i in range(n)]


def replay_data_config(*, max_new_tokens: int, batch_size: int, rollout_length: int, prompts_per_shard: int,
                      temperature: float = 0.0):
    """A DataGenConfig for replay tests: hidden states on, rollouts on the test split, no mixing."""
    from specstop.data_gen.config import DataGenConfig

    cfg = DataGenConfig()
    cfg.generation.max_new_tokens = max_new_tokens
    cfg.generation.temperature = temperature
    cfg.generation.batch_size = batch_size
    cfg.labels.hidden_states = True
    cfg.labels.rollouts.splits = ["test"]
    cfg.labels.rollouts.length = rollout_length
    cfg.labels.mixing.splits = []
    cfg.prompts_per_shard = prompts_per_shard
    return cfg


def make_render(tokenizer):
    def render(text: str) -> list[int]:
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(t) for t in out]

    return render


def ref_probs(logits: torch.Tensor, vocab: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Brute-force decoding transform in float64 numpy (a reference, independent of specstop.probs)."""
    z = logits[:vocab].double().numpy().copy()
    if temperature > 0:
        z = z / temperature
        if top_k:
            kth = np.sort(z)[::-1][top_k - 1]
            z[z < kth] = -np.inf
        if top_p < 1.0:
            order = np.argsort(-z, kind="stable")
            pz = np.exp(z[order] - z[order][0])
            pz /= pz.sum()
            before = 0.0
            for rank, tok in enumerate(order):
                if before >= top_p:
                    z[tok] = -np.inf
                before += pz[rank]
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V_model]`` logits of one unpadded sequence (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def greedy_generate(model, ids: list[int], max_new_tokens: int, vocab: int, eos: int):
    """Single-sequence HF greedy generate (shared vocabulary), returning (tokens, per-step logits)."""
    from transformers import GenerationConfig, LogitsProcessorList

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                          top_k=0, top_p=1.0, temperature=1.0, repetition_penalty=1.0)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=gc, logits_processor=LogitsProcessorList([_SharedVocabMask(vocab)]),
            output_logits=True, return_dict_in_generate=True,
        )
    toks = out.sequences[0, len(ids):].tolist()
    return toks, [lg[0].float() for lg in out.logits]
