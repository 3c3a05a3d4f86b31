"""Tiny random model pairs for tests, demos and CI (no network, seconds on CPU).

The tokenizer is byte-level (256 byte tokens plus Qwen-style special tokens and a Qwen-style chat
template), so any text round-trips. The models are Qwen2 (or Llama) configs with hidden size 32.
The draft is a noisy copy of the target so the two agree often enough for speculative decoding
to be interesting (a pair of independent random models almost never agrees).
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(extra_tokens: list[str] | None = None):
    """A byte-level tokenizer with 256 + 3 (+ extras) tokens, EOS ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:] + list(extra_tokens or []),
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:] + list(extra_tokens or [])})
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def tiny_causal_lm(
    vocab_size: int,
    *,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    arch: str = "qwen2",
    padded_vocab: int = 16,
    init_range: float = 0.3,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A random causal LM. Logits are padded by ``padded_vocab`` rows past the tokenizer (as Qwen's are).

    ``init_range`` is large on purpose: with the usual 0.02 a random model's distributions are almost
    uniform, which makes greedy ties (and hence flaky equality tests) likely.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(
        vocab_size=vocab_size + padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init_range,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(cfg)
    model.eval()
    return model


def tiny_pair_models(seed: int = 0, noise: float = 0.03, arch: str = "qwen2", draft_layers: int = 2):
    """Return ``(draft, target, tokenizer)``: a random target and a noisy copy as the draft.

    The draft copies the target (its first ``draft_layers`` layers) plus Gaussian noise
    of relative size ``noise``), so the pair agrees on roughly half to most greedy tokens.
    """
    tok = tiny_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    target = tiny_causal_lm(len(tok), seed=seed, arch=arch, num_layers=2, eos_token_id=eos, pad_token_id=pad)
    draft = tiny_causal_lm(len(tok), seed=seed + 1, arch=arch, num_layers=draft_layers, eos_token_id=eos, pad_token_id=pad)
    tsd = target.state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    new_sd = {}
    for k, v in draft.state_dict().items():
        src = tsd[k]
        scale = float(src.float().std()) if src.numel() > 1 else 0.0
        new_sd[k] = src + noise * scale * torch.randn(src.shape, generator=gen)
    draft.load_state_dict(new_sd)
    draft.eval()
    target.eval()
    for m in (draft, target):
        m.generation_config.eos_token_id = eos
        m.generation_config.pad_token_id = pad
    return draft, target, tok


def save_tiny_pair(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Write a tiny pair as ``path/{draft,target}`` Hugging Face folders (loadable by ``--pair path``)."""
    path = Path(path)
    draft, target, tok = tiny_pair_models(seed=seed, **kwargs)
    for name, model in (("draft", draft), ("target", target)):
        model.save_pretrained(path / name)
        tok.save_pretrained(path / name)
    return path


def tiny_pair(seed: int = 0, **kwargs):
    """A loaded :class:`~specstop.pair.ModelPair` of tiny random models (float32, CPU)."""
    from specstop.pair.loader import pair_from_models

    draft, target, tok = tiny_pair_models(seed=seed, **kwargs)
    return pair_from_models(draft, target, tok, draft_name="tiny-draft", target_name="tiny-target", name="tiny")
