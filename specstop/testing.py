"""Tiny random model pairs for tests, demos and CI (no network, seconds on CPU).

The tokenizer is byte-level (256 byte tokens plus Qwen-style special tokens and a Qwen-style chat
template), so any text round-trips. The models are Qwen2 (or Llama) configs with hidden size 32.
The draft is a noisy copy of the target so the two agree often enough for speculative decoding
to be interesting (a pair of independent random models almost never agrees).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    num_heads: int = 4,
    num_kv_heads: int = 2,
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
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
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


def tiny_pair_models(seed: int = 0, noise: float = 0.03, arch: str = "qwen2", draft_layers: int = 2, **shape):
    """Return ``(draft, target, tokenizer)``: a random target and a noisy copy as the draft.

    The draft copies the target (its first ``draft_layers`` layers) plus Gaussian noise
    of relative size ``noise``), so the pair agrees on roughly half to most greedy tokens.
    ``shape``: ``hidden_size`` / ``num_heads`` / ``num_kv_heads`` for :func:`tiny_causal_lm`.
    """
    tok = tiny_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    target = tiny_causal_lm(len(tok), seed=seed, arch=arch, num_layers=2, eos_token_id=eos, pad_token_id=pad, **shape)
    draft = tiny_causal_lm(len(tok), seed=seed + 1, arch=arch, num_layers=draft_layers, eos_token_id=eos,
                           pad_token_id=pad, **shape)
    tsd = target.state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    new_sd = {}
    for k in draft.state_dict():
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


#: A tiny pair vLLM's CPU build loads: its attention kernels take head sizes of 32 and more
#: (``vllm/v1/attention/backends/cpu_attn.py``), so 2 heads of 32 (1 KV head) instead of 4 of 8.
VLLM_TINY_SHAPE = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}


def save_vllm_tiny_pair(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """:func:`save_tiny_pair` with a shape vLLM can serve (:data:`VLLM_TINY_SHAPE`); Qwen2 as before."""
    return save_tiny_pair(path, seed=seed, **{**VLLM_TINY_SHAPE, **kwargs})


def tiny_pair(seed: int = 0, **kwargs):
    """A loaded :class:`~specstop.pair.ModelPair` of tiny random models (float32, CPU)."""
    from specstop.pair.loader import pair_from_models

    draft, target, tok = tiny_pair_models(seed=seed, **kwargs)
    return pair_from_models(draft, target, tok, draft_name="tiny-draft", target_name="tiny-target", name="tiny")


class FakeClock:
    """A clock that moves only when told to: with :func:`charge_forwards`, each model forward advances it
    by the cost a test assigns, so step costs (and their levels) are exactly what the test says.
    Install it with ``specstop.clock.using(clock)``."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += float(seconds)


def charge_forwards(pair, clock: FakeClock, cost: Callable[[str, int, dict], float]) -> Callable[[], None]:
    """Make every forward of ``pair.draft`` and ``pair.target`` advance ``clock`` by ``cost(role, tokens,
    kwargs)`` seconds (role "draft" or "target", tokens fed per sequence, the forward's keyword
    arguments). Returns a function that removes the hooks."""
    handles = []
    for role, model in (("draft", pair.draft), ("target", pair.target)):
        def hook(module, args, kwargs, role=role):
            ids = kwargs.get("input_ids", args[0] if args else None)
            clock.advance(cost(role, int(ids.shape[-1]), kwargs))

        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
    return lambda: [h.remove() for h in handles]


class _NumberTokenizer:
    """Decodes ids as numbers; no EOS, so every sampled run has the same length."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@dataclass
class SmallVocabPair:
    """A 5-token pair for sampling checks: ``pair`` (a ModelPair), the ``prompt`` ids, the ``decoding``
    (T = 1) and the shared ``vocab`` size."""

    pair: object
    prompt: list[int]
    decoding: object
    vocab: int


def small_vocab_pair(device: str | None = None, vocab: int = 5, noise: float = 0.5) -> SmallVocabPair:
    """A pair over ``vocab`` tokens whose draft differs noticeably from the target (TV around 0.2-0.4
    for 5 tokens; more tokens need less ``noise``, the draft's relative weight perturbation, for that).

    Small enough that the exact distribution of the first two tokens has ``vocab ** 2`` cells, so a
    few hundred sampled decodes test losslessness by chi-square (:func:`pooled_chi_square`).
    """
    from specstop.pair.loader import ModelPair
    from specstop.probs import DecodingConfig

    target = tiny_causal_lm(vocab, seed=5, hidden_size=16, num_layers=1, padded_vocab=3, init_range=0.6)
    draft = tiny_causal_lm(vocab, seed=6, hidden_size=16, num_layers=1, padded_vocab=3, init_range=0.6)
    sd = {k: v + noise * v.std() * torch.randn_like(v) if v.numel() > 1 else v for k, v in target.state_dict().items()}
    draft.load_state_dict(sd)
    for m in (draft, target):
        m.generation_config.eos_token_id = None
        m.requires_grad_(False)
        if device is not None:
            m.to(device)
    pair = ModelPair(draft, target, _NumberTokenizer(), None, None, "stub", vocab, name="small")
    return SmallVocabPair(pair, [1, 3, 2], DecodingConfig(temperature=1.0), vocab)


@torch.no_grad()
def next_token_probs(model, ids: list[int], decoding, vocab: int) -> torch.Tensor:
    """``[len(ids), vocab]`` next-token distributions of ``model`` after each prefix of ``ids`` (on CPU)."""
    device = model.get_input_embeddings().weight.device
    from specstop.probs import logits_to_probs

    return logits_to_probs(model(torch.tensor([ids], device=device)).logits[0], decoding, vocab).cpu()


def two_token_distribution(target, prompt: list[int], decoding, vocab: int) -> dict[tuple[int, int], float]:
    """The target's exact probability of each first-two-token continuation of ``prompt``."""
    p1 = next_token_probs(target, prompt, decoding, vocab)[-1]
    exact = {}
    for a in range(vocab):
        p2 = next_token_probs(target, prompt + [a], decoding, vocab)[-1]
        for b in range(vocab):
            exact[(a, b)] = float(p1[a] * p2[b])
    return exact


def pooled_chi_square(counts: dict, exact: dict, runs: int, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square of observed ``counts`` against ``exact`` probabilities over ``runs`` draws.

    Cells are pooled in order of rising probability until each pool expects ``min_expected`` draws,
    so the chi-square approximation holds. Returns ``(statistic, degrees of freedom, p-value)``.
    """
    from scipy.stats import chi2

    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell in sorted(exact, key=exact.get):
        pool_obs += counts.get(cell, 0)
        pool_exp += exact[cell] * runs
        if pool_exp >= min_expected:
            stat += (pool_obs - pool_exp) ** 2 / pool_exp
            df += 1
            pool_obs, pool_exp = 0, 0.0
    df = max(df, 1)
    return stat, df, float(chi2.sf(stat, df))


# --------------------------------------------------------------------------------------------
# Synthetic datasets with a planted signal (training/eval/export tests without any model)
# --------------------------------------------------------------------------------------------

SYNTHETIC_VOCAB = 259  # the tiny byte tokenizer's size: ids line up with tiny_pair()
SYNTHETIC_EOS = 258


def write_synthetic_dataset(
    out_dir: str | Path,
    n_prompts: dict[str, int] | None = None,
    tokens_per_prompt: int = 64,
    *,
    k: int = 10,
    hidden_size: int | None = None,
    signal: float = 4.0,
    seed: int = 0,
    with_rollouts: bool = False,
    with_mixed: bool = False,
    mixing_rate: float = 0.15,
    rollout_length: int = 8,
    vocab_size: int = SYNTHETIC_VOCAB,
    prompt_tokens: int = 8,
    shards_per_split: int = 1,
    temperature: float = 0.0,
) -> Path:
    """Write a schema-valid specstop dataset whose labels depend on the features in a known way.

    The planted signal: every drafted token gets a latent score
    ``z = signal * (c + 0.35 * u)`` (then shifted so ~70% of tokens are accepted), where ``c``
    is a standardised *confidence* and ``u`` an independent standard normal. ``c`` decides the
    distribution features (top-1 probability rises and entropy falls with ``c``), so top-k
    predictors see most of the signal; the hidden state (when stored) is Gaussian noise plus
    ``3c`` along one fixed direction and ``3u`` along another, so hidden-state predictors can see
    all of it. Labels follow the schema's meaning: ``accept_expected = 1 - tv = sigmoid(z)``,
    ``accept_prob`` = min(1, p/q) of a sampled draft token (1 with probability ``accept_expected``,
    otherwise uniform below it), ``verified ~ Bernoulli(accept_prob)``, ``greedy_match ~
    Bernoulli(accept_expected)``. Tokens are consistent: ``target_top1 == token`` (the greedy
    target), ``draft_argmax == token`` iff ``greedy_match``, and ``draft_token`` is the draft argmax
    with probability top-1 (else a random token); EOS never appears inside a response.

    Args:
        out_dir: dataset folder to create (``manifest.json`` + ``shards/``).
        n_prompts: prompts per split, default ``{"train": 32, "validation": 8, "test": 8}``.
        tokens_per_prompt: response length N of every prompt.
        k: top-k feature size. hidden_size: store ``[H]`` float16 hidden states, or None.
        signal: logit scale of the planted signal (0 = labels independent of the features).
        seed: all randomness. with_rollouts / with_mixed: also fill those tables (every split).
        mixing_rate: fraction r of target tokens in token mixing (mixed rows are the other 1 - r).
        rollout_length: L of the rollout rows. vocab_size: token ids are drawn below it.
        prompt_tokens: prompt length. shards_per_split: prompts are spread over this many shards.
        temperature: recorded in the manifest only.

    Returns:
        ``Path(out_dir)``.
    """
    import datetime

    import datasets
    import numpy as np

    from specstop import __version__
    from specstop.data_gen.schema import SCHEMA_VERSION
    from specstop.data_gen.storage import MANIFEST, shard_name, write_shard
    from specstop.jsonio import atomic_write_json

    n_prompts = dict(n_prompts or {"train": 32, "validation": 8, "test": 8})
    out_dir = Path(out_dir)
    # Tests write many tiny shards; the per-table progress bars are noise there.
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    rng = np.random.default_rng(seed)
    # Fixed directions in hidden space carrying the two signal components.
    if hidden_size:
        dirs = np.linalg.qr(rng.standard_normal((hidden_size, 2)))[0].T  # [2, H] orthonormal
    n_tok = tokens_per_prompt
    split_counts: dict[str, dict] = {}
    for split, n_p in n_prompts.items():
        counts = {"prompts": 0, "tokens": 0, "mixed": 0, "rollouts": 0}
        for shard_idx, prompt_idx in enumerate(np.array_split(np.arange(n_p), max(1, shards_per_split))):
            tables = {t: {} for t in ("sequences", "tokens", "mixed", "rollouts")}
            seq_rows, tok_rows, mix_rows, roll_rows = [], [], [], []
            for i in prompt_idx:
                pid = f"syn-{split}-{int(i):05d}"
                c = rng.standard_normal(n_tok)
                u = rng.standard_normal(n_tok)
                z = signal * (c + 0.35 * u) + 1.0
                acc_exp = 1.0 / (1.0 + np.exp(-z))
                top1 = 1.0 / (1.0 + np.exp(-(1.2 * c + 0.8)))  # confident drafts agree more often
                # Remaining mass over k-1 visible + a tail, sorted and capped below top1.
                rest = rng.dirichlet(np.ones(k + 2), size=n_tok)[:, : k - 1] * (1.0 - top1)[:, None]
                rest = -np.sort(-np.minimum(rest, top1[:, None]), axis=1)
                topk = np.concatenate([top1[:, None], rest], axis=1).astype(np.float32)
                tail = np.clip(1.0 - topk.sum(1), 1e-6, None)
                n_tail = max(vocab_size - k, 1)
                ent = -(topk * np.log(np.clip(topk, 1e-12, None))).sum(1) - tail * np.log(tail / n_tail)
                greedy = rng.random(n_tok) < acc_exp
                token = rng.integers(0, vocab_size - 1, n_tok)  # never EOS (= vocab_size - 1 here)
                token = np.where(token == SYNTHETIC_EOS, 0, token)
                other = (token + 1 + rng.integers(0, vocab_size - 3, n_tok)) % (vocab_size - 1)
                other = np.where(other == token, (token + 1) % (vocab_size - 1), other)
                draft_argmax = np.where(greedy, token, other)
                draft_tok = np.where(rng.random(n_tok) < top1, draft_argmax, rng.integers(0, vocab_size - 1, n_tok))
                accept_prob = np.where(rng.random(n_tok) < acc_exp, 1.0, acc_exp * rng.random(n_tok))
                verified = rng.random(n_tok) < accept_prob
                row = {
                    "prompt_id": [pid] * n_tok,
                    "split": [split] * n_tok,
                    "position": np.arange(n_tok, dtype=np.int32),
                    "token": token.astype(np.int32),
                    "draft_argmax": draft_argmax.astype(np.int32),
                    "target_top1": token.astype(np.int32),
                    "topk": topk,
                    "entropy": ent.astype(np.float32),
                    "tv": (1.0 - acc_exp).astype(np.float32),
                    "accept_expected": acc_exp.astype(np.float32),
                    "greedy_match": greedy,
                    "draft_token": draft_tok.astype(np.int32),
                    "accept_prob": accept_prob.astype(np.float32),
                    "verified": verified,
                }
                # Sampled-replay columns: p(X) and q(X) with min(1, q/p) = 1 - tv, so the Theorem 1
                # identity E[1 - c] = TV holds row by row; the residual draw is never X.
                target_prob = rng.uniform(0.3, 0.9, n_tok)
                row["target_prob"] = target_prob.astype(np.float32)
                row["draft_prob"] = (target_prob * acc_exp).astype(np.float32)
                row["reject_token"] = other.astype(np.int32)
                row["reject_draft_prob"] = (top1 * rng.uniform(0.05, 1.0, n_tok)).astype(np.float32)
                row["target_rank"], row["topk_ids"] = _synthetic_topk_ids(token, draft_argmax, greedy, k, vocab_size)
                hidden = None
                if hidden_size:
                    hidden = rng.standard_normal((n_tok, hidden_size)) + 3.0 * (c[:, None] * dirs[0] + u[:, None] * dirs[1])
                    row["hidden"] = hidden.astype(np.float16)
                tok_rows.append(row)
                seq_rows.append(
                    {
                        "prompt_id": [pid],
                        "split": [split],
                        "prompt_text": [f"synthetic prompt {split} {int(i)}"],
                        "prompt_ids": [rng.integers(0, vocab_size - 1, prompt_tokens).astype(np.int32).tolist()],
                        "response_ids": [token.astype(np.int32).tolist()],
                        "response_text": [" ".join(map(str, token[:8])) + " ..."],
                        "num_tokens": [n_tok],
                        "stop_reason": ["length"],
                        "prompt_truncated": [False],
                    }
                )
                if with_mixed:
                    keep = np.flatnonzero(rng.random(n_tok) >= mixing_rate)  # positions holding Y_i
                    # The mixed pass sees another context, so its features are perturbed copies.
                    mrow = {
                        "prompt_id": [pid] * len(keep),
                        "split": [split] * len(keep),
                        "draw": np.zeros(len(keep), dtype=np.int32),
                        "position": keep.astype(np.int32),
                        "draft_token": draft_tok[keep].astype(np.int32),
                        "topk": topk[keep],
                        "entropy": ent[keep].astype(np.float32),
                        "accept_prob": accept_prob[keep].astype(np.float32),
                        "accept_expected": acc_exp[keep].astype(np.float32),
                    }
                    if hidden is not None:
                        mh = hidden[keep] + 0.3 * rng.standard_normal((len(keep), hidden_size))
                        mrow["hidden"] = mh.astype(np.float16)
                    mix_rows.append(mrow)
                if with_rollouts:
                    mism = np.flatnonzero(~greedy)
                    lengths = np.minimum(rollout_length, n_tok - mism).astype(np.int32)
                    rrow = {
                        "prompt_id": [pid] * len(mism),
                        "split": [split] * len(mism),
                        "position": mism.astype(np.int32),
                        "mismatch_token": draft_argmax[mism].astype(np.int32),
                        "length": lengths,
                        "tokens": [rng.integers(0, vocab_size - 1, n).astype(np.int32).tolist() for n in lengths],
                        "topk": [np.tile(topk[m], n).tolist() for m, n in zip(mism, lengths)],
                        "entropy": [np.full(n, ent[m], dtype=np.float32).tolist() for m, n in zip(mism, lengths)],
                    }
                    if hidden_size:
                        rrow["mismatch_hidden"] = hidden[mism].astype(np.float16)
                        rrow["hidden"] = [
                            rng.standard_normal(n * hidden_size).astype(np.float16).tolist() for n in lengths
                        ]
                    roll_rows.append(rrow)
            for table, rows in (("sequences", seq_rows), ("tokens", tok_rows), ("mixed", mix_rows), ("rollouts", roll_rows)):
                if rows:
                    tables[table] = {
                        col: (np.concatenate([r[col] for r in rows]) if isinstance(rows[0][col], np.ndarray) else sum((list(r[col]) for r in rows), []))
                        for col in rows[0]
                    }
            write_shard(
                out_dir,
                shard_name(split, shard_idx),
                tables,
                k=k,
                hidden_size=hidden_size,
                meta={"prompt_ids": [f"syn-{split}-{int(i):05d}" for i in prompt_idx]},
            )
            counts["prompts"] += len(prompt_idx)
            for t, rows in (("tokens", tok_rows), ("mixed", mix_rows), ("rollouts", roll_rows)):
                counts[t] += sum(len(r["prompt_id"]) for r in rows)
        split_counts[split] = counts

    ident = {
        "name_or_path": "synthetic",
        "revision": None,
        "architecture": "Synthetic",
        "num_parameters": 0,
        "dtype": "float32",
        "hidden_size": int(hidden_size or 32),
        "num_hidden_layers": 0,
        "logits_size": vocab_size,
        "source_sha256": None,
    }
    bytes_no_hidden = 4 * (k + 12)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "specstop_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "pair": {
            "name": "synthetic",
            "draft": {**ident, "name_or_path": "synthetic-draft"},
            "target": {**ident, "name_or_path": "synthetic-target"},
            "tokenizer_hash": "synthetic0000000",
            "vocab": {"shared_vocab_size": vocab_size, "draft_logits_size": vocab_size, "target_logits_size": vocab_size},
        },
        "prompts": {
            "source": "synthetic",
            "field": None,
            "template": None,
            "chat_template": False,
            "seed": seed,
            "split_sizes": dict(n_prompts),
            "counts": dict(n_prompts),
        },
        "generation": {
            "max_new_tokens": tokens_per_prompt,
            "temperature": temperature,
            "top_k": 0,
            "top_p": 1.0,
            "seed": seed,
            "batch_size": 1,
            "max_prompt_tokens": prompt_tokens,
            "prompt_overflow": "truncate",
            "eos_token_id": SYNTHETIC_EOS,
        },
        "labels": {
            "topk_k": k,
            "hidden_states": bool(hidden_size),
            "hidden_size": int(hidden_size) if hidden_size else None,
            "hidden_layer": -1,
            "mixing": {"rate": mixing_rate, "draws": 1 if with_mixed else 0, "splits": list(n_prompts) if with_mixed else []},
            "rollouts": {"length": rollout_length, "splits": list(n_prompts) if with_rollouts else []},
            "synthetic_signal": signal,
        },
        "splits": split_counts,
        "bytes_per_token": {"with_hidden": bytes_no_hidden + 2 * int(hidden_size or 0), "without_hidden": bytes_no_hidden},
    }
    atomic_write_json(out_dir / MANIFEST, manifest)
    if bars_were_on:
        datasets.enable_progress_bars()
    return out_dir


def _synthetic_topk_ids(token, draft_argmax, greedy, k: int, vocab_size: int):
    """``(target_rank [n], topk_ids [n, k])`` int32 of synthetic token rows, without random draws (so
    every other synthetic column stays as it was): rank 0 where the draft's argmax matches, else a
    rank 1..k-1 derived from the token, or -1 (not among the top-k) for every k-th token id."""
    import numpy as np

    rank = np.where(greedy, 0, np.where(token % k == 0, -1, token % k)).astype(np.int32)
    ids = (token[:, None] + 1 + np.arange(k)[None, :]) % (vocab_size - 1)
    ids[:, 0] = draft_argmax
    rows = np.flatnonzero(rank >= 0)
    ids[rows, rank[rows]] = token[rows]
    return rank, ids.astype(np.int32)

