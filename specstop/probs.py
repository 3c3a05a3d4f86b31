"""Distribution math shared by data generation, the decoder and the runtime.

One place defines how logits become the distributions that speculative decoding compares, so
that labels (data_gen), features seen at decode time (runtime/decoder) and replay all agree.
Only torch is imported here: the export runtime depends on this module.

Conventions:
    * Logits are sliced to the shared vocabulary ``vocab_size`` (the tokenizer length) before
      anything else. Padded embedding rows (Qwen's 151,936 logits for 151,665 tokens) are
      dropped, so neither model can ever propose or be compared on a token the tokenizer lacks.
    * All softmax / entropy / TV math runs in float32 even when the models run in bf16/fp16
      (the MCSD authors hit NaN softmax in bf16).
    * Temperature ``T == 0`` means greedy decoding. The *decoding* rule is then argmax, but the
      *distributions* we featurize and label (top-k, entropy, TV, acceptance probability) are the
      untempered softmax (T = 1, no top-k/top-p): a one-hot distribution carries no signal. This
      matches DISCO (greedy decoding, TV labels on the raw distributions) and HF's
      ``assistant_confidence_threshold`` (which reads the softmax of the greedy scores).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specstop.errors import UserError

__all__ = [
    "DecodingConfig",
    "accept_probability",
    "entropy",
    "logits_to_probs",
    "residual_distribution",
    "top_k_probs",
    "top_k_probs_and_ids",
    "tv_distance",
    "verify_drafts",
]


@dataclass(frozen=True)
class DecodingConfig:
    """The decoding transform applied to both models' logits.

    Attributes:
        temperature: 0 for greedy; otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0 disables).
        top_p: nucleus sampling mass (1.0 disables).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        from specstop.config_io import check_decoding

        check_decoding(self.temperature, self.top_k, self.top_p)  # NaN, inf and 1e308 included

    @classmethod
    def from_generation(cls, generation: dict | None, where: str = "") -> DecodingConfig:
        """The setting a dataset manifest's ``generation`` record (or any ``{temperature, top_k, top_p}``
        mapping) describes; missing or null values: greedy, no top-k, no top-p.

        The values are checked as written, before any conversion: ``"0.7"`` or ``[1]`` for a temperature and
        ``2.5`` or ``"5"`` for a top-k are refused rather than parsed or truncated.

        Args:
            generation: the mapping (other keys, such as ``max_new_tokens``, are ignored).
            where: what holds it (``config.json: by_decoding[1].decoding``), prefixed to an error.

        Raises:
            UserError: ``generation`` is not a mapping, or a value is not a valid setting; one line naming it.
        """
        from specstop.config_io import check_decoding, short

        if generation is not None and not isinstance(generation, dict):
            raise UserError(f"{where or 'decoding setting'} must be a mapping of temperature, top_k and top_p, "
                            f"got {short(generation)}")
        g = {k: v for k, v in (generation or {}).items() if v is not None}
        t, k, p = g.get("temperature", 0.0), g.get("top_k", 0), g.get("top_p", 1.0)
        check_decoding(t, k, p, prefix=f"{where}." if where else "")
        return cls(temperature=float(t), top_k=int(k), top_p=float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def logits_to_probs(logits: torch.Tensor, decoding: DecodingConfig, vocab_size: int | None = None) -> torch.Tensor:
    """Turn raw logits into the distribution speculative decoding uses.

    Args:
        logits: ``[..., V_model]`` raw logits in any dtype.
        decoding: the decoding transform. For greedy (T = 0) the untempered softmax is returned.
        vocab_size: the shared tokenizer vocabulary; logits beyond it are dropped.

    Returns:
        ``[..., V]`` float32 probabilities summing to one over the shared vocabulary.
    """
    if vocab_size is not None:
        if logits.shape[-1] < vocab_size:
            raise UserError(
                f"model emits {logits.shape[-1]} logits but the shared tokenizer has {vocab_size} tokens; "
                "the model's output layer is smaller than its tokenizer - is this the right tokenizer?"
            )
        logits = logits[..., :vocab_size]
    if decoding.greedy:
        # One pass: softmax casts to float32 itself (no separate [.., V] float32 copy).
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    logits = logits.float()
    if not decoding.greedy:
        logits = logits / decoding.temperature
        if decoding.top_k > 0 and decoding.top_k < logits.shape[-1]:
            kth = torch.topk(logits, decoding.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if decoding.top_p < 1.0:
            sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Remove a token once the mass *before* it already reaches top_p; this always keeps
            # the most likely token (same rule as transformers' TopPLogitsWarper).
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            remove_sorted = mass_before >= decoding.top_p
            remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
            logits = logits.masked_fill(remove, float("-inf"))
    return torch.softmax(logits, dim=-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats. ``[..., V] -> [...]`` (0 * log 0 counts as 0)."""
    return torch.special.entr(probs.float()).sum(-1)  # entr(x) = -x log x, entr(0) = 0: one pass


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total-variation distance ``0.5 * sum |p - q|``. ``[..., V] x [..., V] -> [...]``.

    ``1 - TV(p, q)`` is the probability that speculative sampling accepts a fresh draft token
    ``Y ~ q``: ``E_q[min(1, p/q)] = sum_v min(p_v, q_v) = 1 - TV``.
    """
    return 0.5 * (p.float() - q.float()).abs().sum(-1)


def top_k_probs(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest probabilities, sorted descending. ``[..., V] -> [..., k]``."""
    if k > probs.shape[-1]:
        raise UserError(f"top-k feature size k={k} exceeds the vocabulary ({probs.shape[-1]})")
    return torch.topk(probs.float(), k, dim=-1).values


def top_k_probs_and_ids(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_probs` and the token ids they belong to, from one ``topk`` (ties ordered alike).

    Returns:
        ``(values [..., k] float32, ids [..., k] int64)``, values sorted descending.
    """
    if k > probs.shape[-1]:
        raise UserError(f"top-k feature size k={k} exceeds the vocabulary ({probs.shape[-1]})")
    top = torch.topk(probs.float(), k, dim=-1)
    return top.values, top.indices


def accept_probability(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Speculative sampling acceptance probability ``min(1, p(y) / q(y))`` of draft tokens.

    Args:
        p: ``[..., V]`` target distribution.
        q: ``[..., V]`` draft distribution the tokens were drawn from.
        tokens: ``[...]`` draft token ids.

    Returns:
        ``[...]`` float32 acceptance probabilities. A token with ``q(y) == 0`` (cannot have been
        drawn from q) gets 0 acceptance unless p(y) > 0 too, in which case it is accepted (1).
    """
    idx = tokens.long().unsqueeze(-1)
    py = p.float().gather(-1, idx).squeeze(-1)
    qy = q.float().gather(-1, idx).squeeze(-1)
    ratio = torch.where(qy > 0, py / qy.clamp_min(1e-30), (py > 0).float())
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``: where speculative sampling resamples after a rejection.

    ``[..., V] x [..., V] -> [..., V]``. If ``p == q`` exactly (no rejection possible) the residual
    is empty; we fall back to ``p`` so the result is always a distribution.
    """
    r = (p.float() - q.float()).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p.float())


def verify_drafts(target_logits: torch.Tensor, drafted: list[int], draft_probs: torch.Tensor | None,
                  decoding: DecodingConfig, vocab_size: int | None, gen: torch.Generator | None) -> tuple[int, int]:
    """One chain round's verification: how many drafted tokens the target accepts, and its own next token.

    Greedy: the leading drafted tokens equal to the target's argmax, then the argmax after them.
    Sampling (Leviathan et al.; SpecDec++ Algorithm 1): accept y_i while r_i < min(1, p_i(y_i) / q_i(y_i)),
    then sample from norm(max(p_n - q_n, 0)) at the first rejection, or from p_K when all K are accepted.
    The K uniforms are drawn first, then the one sample (every decoder consumes ``gen`` in this order).

    Args:
        target_logits: ``[K + 1, V_model]`` the target's logits at the K drafted positions and after them.
        drafted: the K drafted tokens.
        draft_probs: ``[K, V]`` the transformed distributions they were drawn from (sampling; None greedy).
        decoding: the decoding transform (temperature 0 = greedy).
        vocab_size: the shared vocabulary (logits beyond it are dropped).
        gen: the sampling generator (None greedy).

    Returns:
        ``(n accepted, the target's token)``.
    """
    k = len(drafted)
    if decoding.greedy:
        mine = target_logits[:, :vocab_size].argmax(-1).tolist()
        n = 0
        while n < k and drafted[n] == mine[n]:
            n += 1
        return n, mine[n]
    p = logits_to_probs(target_logits, decoding, vocab_size)
    n = 0
    if k:
        q = draft_probs.to(p.device)
        acc = accept_probability(p[:k], q, torch.tensor(drafted, device=p.device))
        r = torch.rand(k, generator=gen, device=gen.device).to(p.device)
        while n < k and bool(r[n] < acc[n]):
            n += 1
    dist = residual_distribution(p[n], q[n]) if n < k else p[k]
    return n, int(torch.multinomial(dist.to(gen.device), 1, generator=gen))
