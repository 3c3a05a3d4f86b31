"""A lossless speculative decoder driven by any :class:`~specstop.export.runtime.StoppingPolicy`.

Batch size 1 (one prompt at a time; the runtime has a batched policy form, the decoder does not
batch sequences yet).

Round semantics are those of docs/design.md "Speculative decoding rounds", shared with the replay:

1. ``K_cap = min(policy cap, remaining - 1)``; ``K_cap == 0`` -> one target step, no draft.
2. Draft y_1, y_2, ... (greedy: argmax; sampling: y_j ~ q_j). After each token the policy decides;
   drafting also stops at ``j == K_cap`` and after an EOS token.
3. One target forward over the K drafted tokens gives p_{s}..p_{s+K}. Greedy: accept the leading
   tokens equal to the target's argmax, then emit the target's token. Sampling (Leviathan et al.,
   SpecDec++ Algorithm 1): accept y_i while r_i < min(1, p_i(y_i)/q_i(y_i)); on the first rejection
   resample from norm(max(p - q, 0)); if all K are accepted, sample a bonus token from p_{s+K}.
   Emitting EOS ends the response, so nothing after an accepted EOS is emitted.

Both models keep KV caches (HF ``DynamicCache``, or ``StaticCache`` with ``static_cache=True``),
rolled back to the accepted prefix after every round. The draft forward that yields q_j also yields
the final hidden state of y_{j-1} (``output_hidden_states=True``), which is what SpecDec++ / MCSD
hidden heads score - no second draft forward.

Counter conventions: ``N`` counts emitted tokens (so an accepted EOS that ends the response adds n,
not n + 1), ``N_target`` target forwards (excluding the prompt prefill), ``N_draft`` drafted tokens,
``N_discarded`` drafted tokens not accepted. ``accepted_per_round`` is n (without the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specstop import clock
from specstop.export.runtime import StoppingPolicy
from specstop.pair.compat import cache_kwarg
from specstop.pair.context import check_request, check_seed
from specstop.pair.static_cache import CACHE_BUCKETS, compiled_forward, rewind, static_cache_length
from specstop.probs import DecodingConfig, logits_to_probs, verify_drafts

__all__ = ["DecodeResult", "SpeculativeDecoder", "eos_token_ids"]


@dataclass
class DecodeResult:
    """Attributes:
    token_ids: the generated tokens (prompt excluded).
    text: their decoded text (special tokens skipped).
    counters: N, N_target, N_draft, N_discarded, rounds, stop_reason ("eos" | "length").
    round_lengths: K per round (0 for a target-only step).
    accepted_per_round: n per round (accepted drafted tokens, bonus not counted).
    timings: seconds per phase: ``prefill`` (both models, all prompt tokens but the last; with a
        compiled draft, the compilation its first request at a cache length pays too),
        ``draft`` (draft forwards and picks, the catch-up feed of a round's first step included),
        ``predictor`` (the policy's decision, features included), ``target`` (verification
        forwards and target-only steps), ``accept`` (comparing/sampling the verified block),
        ``rollback`` (cache rollback and bookkeeping), ``total``; ``round_seconds`` lists each
        round's wall time (draft to rollback) for round-cost checks.
    live: live re-pricing's record after this run (:meth:`LivePricer.record`: the ratios of the
        measured step costs to the table, the policy in use, every switch so far), None when the
        policy is pinned or carries no statistics.
    """

    token_ids: list[int]
    text: str
    counters: dict[str, Any]
    round_lengths: list[int]
    accepted_per_round: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    live: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def eos_token_ids(pair) -> set[int]:
    """The ids that end a response: the target's generation config's EOS list (what ``generate``
    stops on), plus the tokenizer's EOS."""
    ids: set[int] = set()
    gen_eos = getattr(pair.target.generation_config, "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
    if pair.tokenizer.eos_token_id is not None:
        ids.add(int(pair.tokenizer.eos_token_id))
    return ids


class _Timer:
    """Accumulates wall-clock per phase; synchronises CUDA so GPU work is attributed correctly."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = dict.fromkeys(("prefill", "draft", "predictor", "target", "accept", "rollback"), 0.0)

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return clock.now()

    def add(self, phase: str, t0: float) -> float:
        t1 = self.now()
        self.totals[phase] += t1 - t0
        return t1


class _LM:
    """One model plus its KV cache and the number of sequence tokens the cache holds."""

    def __init__(self, model, static_cache: bool, max_len: int, compile: bool, compiled_up_to: int = 0) -> None:
        """``compiled_up_to``: with ``compile``, feeds of at most this many tokens (a round's: 1..K+1)
        run compiled; longer ones (the prompt's prefill, one length per prompt) run eagerly, so a new
        prompt length never costs a compilation."""
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.static = static_cache
        if static_cache:
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens of the sequence held in the cache
        self.forward = self.compiled = model  # the module: its forward hooks run
        self.compiled_up_to = compiled_up_to if compile else 0
        if compile:
            # Static shapes: one graph per fed length and cache length, for the draft and the target.
            self.compiled = compiled_forward(model, 2 * (compiled_up_to + 1) * CACHE_BUCKETS + 2)

    @torch.no_grad()
    def feed(self, tokens: list[int], keep_logits: int, hidden: bool = False, layer: int = -1):
        """Feed ``tokens`` after the cached prefix.

        Returns:
            ``(logits [keep_logits, V_model], hidden [H] | None)``: hidden is ``hidden_states[layer]``
            of the last fed token (-1: the final state after the final norm, as in the dataset).
        """
        n = len(tokens)
        ids = torch.tensor([tokens], device=self.device)
        # Explicit positions: a static cache does not know its logical length after a rollback.
        pos = torch.arange(self.length, self.length + n, device=self.device)
        forward = self.compiled if n <= self.compiled_up_to else self.forward
        out = forward(
            input_ids=ids,
            **cache_kwarg(self.model, self.cache),
            use_cache=True,
            cache_position=pos,
            position_ids=pos.unsqueeze(0),
            output_hidden_states=hidden,
            logits_to_keep=keep_logits,
        )
        self.length += n
        h = out.hidden_states[layer][0, -1] if hidden else None
        return out.logits[0, -keep_logits:], h

    def rollback(self, keep: int) -> None:
        """Drop cached tokens past the first ``keep`` (rejected drafts)."""
        if keep >= self.length:
            return
        if self.static:
            rewind(self.cache, keep)
        else:
            self.cache.crop(keep - self.length)  # transformers 5: a negative count removes tokens
        self.length = keep


class SpeculativeDecoder:
    """Speculative decoding of one prompt at a time with a stopping policy.

    Args:
        pair: the draft/target :class:`~specstop.pair.ModelPair`.
        policy: any :class:`StoppingPolicy` (static, heuristic, confidence, exported predictor), or
            its string or export folder (:meth:`StoppingPolicy.for_pair`, as the batched decoder).
        decoding: the decoding transform for both models (temperature 0 = greedy).
        static_cache: use HF ``StaticCache`` (needed for ``compile``; mainly for CUDA).
        compile: ``torch.compile`` both models' forwards (CUDA; CPU works but compiles slowly).
        compile_draft: ``torch.compile`` the draft's round feeds alone (one and two tokens, over a
            ``StaticCache``); the target stays as ``static_cache`` says. On a CPU the draft's one-token
            steps are dominated by kernel launches, which the compiled graph removes
            (``benchmarks/compiled_draft_step.py`` measures whether it pays), at two graphs' compile.
        max_cache_len: static cache size (prompt + new tokens + SL_max is enough).
        live_pricing: re-pick the policy's threshold, SL_max or K from its price-free statistics as the
            step costs this decoder measures move (:mod:`specstop.decode.live_pricing`; lossless, logged).
            Applies to policies that carry statistics (exports); False pins the policy as given.
        cost_model: the table live pricing scales (a CostModel, its dict, or None: the export's own).
    """

    def __init__(
        self,
        pair,
        policy: StoppingPolicy | str,
        decoding: DecodingConfig | None = None,
        *,
        static_cache: bool = False,
        compile: bool = False,
        compile_draft: bool = False,
        max_cache_len: int = 4096,
        live_pricing: bool = True,
        cost_model=None,
    ) -> None:
        self.pair = pair
        self.policy = policy = StoppingPolicy.for_pair(policy, pair)
        self.decoding = decoding or DecodingConfig()
        self.policy.configure(self.decoding, pair.vocab_size)
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.static_cache = static_cache or compile
        self.compile = compile
        self.compile_draft = compile_draft or compile or bool(getattr(pair, "compile_draft", False))
        self._compiled_for: set[tuple[int, bool]] = set()  # (cache length, hidden states) the draft compiled for
        self.max_cache_len = max_cache_len
        self.last_state: dict[str, Any] | None = None  # caches + sequence of the last run (tests inspect it)
        from specstop.decode.live_pricing import LivePricer

        self.live = LivePricer.for_policy(policy, cost_model) if live_pricing else None
        policy.warn_temperature_mismatch(self.decoding)

    # ------------------------------------------------------------------ helpers
    def _pick(self, logits: torch.Tensor, probs: torch.Tensor | None, gen: torch.Generator | None) -> int:
        """Greedy: argmax of the shared-vocabulary logits (what HF greedy does); else a sample."""
        if self.decoding.greedy:
            return int(logits[..., : self.vocab_size].argmax(-1))
        return int(torch.multinomial(probs.to(gen.device), 1, generator=gen))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.decoding, self.vocab_size)

    # ------------------------------------------------------------------ main loop
    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None, *, max_draft: int | None = None,
        on_round: Callable[[int, float], None] | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (batch size 1).

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty).
            max_new_tokens: length cap; the response never exceeds it.
            seed: seeds the draft samples, the acceptance uniforms and the resampling (sampling only).
            max_draft: cap every round at this many drafted tokens; 0 is plain target decoding through
                the same code path (the baseline benchmarks compare against, prefill timed alike).
            on_round: called after every round with its drafted length K and its wall seconds, outside
                the round's timing (calibration times the cost table's forwards there, between rounds).
        """
        prompt_ids = check_request(self.pair, prompt_ids, max_new_tokens)
        seed = check_seed(seed)
        pair, policy, greedy = self.pair, self.policy, self.decoding.greedy
        policy.start_sequence()
        # Live pricing may raise the cap between rounds: size caches and compiled feeds for the largest.
        cap = policy.cap() if self.live is None else max(policy.cap(), self.live.max_cap())
        max_len = len(prompt_ids) + max_new_tokens + cap + 2
        if (self.static_cache or self.compile_draft) and max_len > self.max_cache_len:
            raise ValueError(f"prompt + max_new_tokens ({max_len}) exceeds max_cache_len={self.max_cache_len}")
        block = cap + 1  # the longest feed of a round: K drafted tokens after the last emitted one
        # The draft is fed one token a step, two at a round's start after every draft was accepted (the
        # last drafted token and the bonus): those two lengths compile; the prompt's prefill runs eagerly.
        cache_len = static_cache_length(max_len, self.max_cache_len)
        draft = _LM(pair.draft, self.static_cache or self.compile_draft, cache_len, self.compile_draft,
                    compiled_up_to=block if self.compile else 2)
        target = _LM(pair.target, self.static_cache, cache_len, self.compile, compiled_up_to=block)
        timer = _Timer(target.device)
        gen = None
        if not greedy:
            gen = torch.Generator(device=draft.device)
            gen.manual_seed(0 if seed is None else int(seed))
        need_q = (not greedy) or policy.reads_probs
        need_hidden = policy.needs_hidden

        seq = list(prompt_ids)
        out: list[int] = []
        rounds_k: list[int] = []
        rounds_n: list[int] = []
        round_seconds: list[float] = []
        n_target = n_draft = n_discarded = 0
        stop_reason = "length"
        t_start = timer.now()

        # Prefill everything but the last prompt token; it is fed with the first round.
        if len(seq) > 1:
            t0 = timer.now()
            draft.feed(seq[:-1], keep_logits=1)
            t0 = timer.add("prefill", t0)
            target.feed(seq[:-1], keep_logits=1)
            timer.add("prefill", t0)
        if self.compile_draft and (cache_len, need_hidden) not in self._compiled_for:
            # Compile both feed lengths now, so the first request (a benchmark's warm-up) pays for them,
            # not some later round.
            t0 = timer.now()
            for n in (2, 1):
                draft.feed(seq[-1:] * n, keep_logits=1, hidden=need_hidden, layer=policy.hidden_layer)
                draft.rollback(len(seq) - 1)
            self._compiled_for.add((cache_len, need_hidden))
            timer.add("prefill", t0)

        while len(out) < max_new_tokens:
            s = len(out)
            remaining = max_new_tokens - s
            k_cap = min(policy.cap(), remaining - 1)
            if max_draft is not None:
                k_cap = min(k_cap, max_draft)
            t_round = timer.now()
            phases = dict(timer.totals)  # this round's seconds per phase, for live pricing
            if k_cap <= 0:
                # A single target step: a draft could not be verified and still leave room for the bonus.
                logits, _ = target.feed(seq[target.length :], keep_logits=1)
                tok = self._pick(logits[-1], None if greedy else self._probs(logits[-1]), gen)
                round_seconds.append(timer.add("target", t_round) - t_round)
                self._observe(0, timer, phases)
                if on_round is not None:
                    on_round(0, round_seconds[-1])
                n_target += 1
                rounds_k.append(0)
                rounds_n.append(0)
                seq.append(tok)
                out.append(tok)
                if tok in self.eos:
                    stop_reason = "eos"
                    break
                continue

            # ---- draft
            policy.reset()
            drafted: list[int] = []
            qs: list[torch.Tensor] = []
            feed = seq[draft.length :]
            t0 = t_round
            for j in range(1, k_cap + 1):
                logits, hidden = draft.feed(feed, keep_logits=1, hidden=need_hidden, layer=policy.hidden_layer)
                logits = logits[-1]
                q = self._probs(logits) if not greedy else None  # sampling draws y_j from q_j
                y = self._pick(logits, q, gen)
                t0 = timer.add("draft", t0)
                if greedy and need_q:  # only the policy reads q_j: its cost, not the draft's
                    q = self._probs(logits)
                # hidden is e_{j-1}: the state after y_{j-1}, from the forward that produced q_j (at
                # j = 1 after the last emitted token: hidden heads skip it, with_state heads read it).
                stop = policy.should_stop(logits, hidden, position=s + j - 1, draft_probs=q, draft_token=y)
                t0 = timer.add("predictor", t0)
                drafted.append(y)
                if q is not None:
                    qs.append(q)
                if stop or j == k_cap or y in self.eos:
                    break
                feed = [y]
            k = len(drafted)

            # ---- verify
            base = len(seq)
            logits, _ = target.feed(seq[target.length :] + drafted, keep_logits=k + 1)  # rows: p_s .. p_{s+K}
            t0 = timer.add("target", t0)
            n, final = verify_drafts(logits, drafted, None if greedy else torch.stack(qs), self.decoding,
                                     self.vocab_size, gen)
            t0 = timer.add("accept", t0)

            emitted = drafted[:n] + [final]
            for i, t in enumerate(emitted):
                if t in self.eos:
                    emitted = emitted[: i + 1]
                    break
            n_target += 1
            n_draft += k
            n_discarded += k - n
            rounds_k.append(k)
            rounds_n.append(n)
            policy.end_round(k, n)
            seq.extend(emitted)
            out.extend(emitted)
            # Roll back: the target keeps everything but the new last token; the draft keeps the
            # accepted drafted tokens it was fed (y_K never was).
            target.rollback(len(seq) - 1)
            draft.rollback(min(draft.length, base + n))
            round_seconds.append(timer.add("rollback", t0) - t_round)
            self._observe(k, timer, phases)
            if on_round is not None:
                on_round(k, round_seconds[-1])
            if out and out[-1] in self.eos:
                stop_reason = "eos"
                break

        total = timer.now() - t_start
        self.last_state = {"seq": seq, "draft": draft, "target": target}
        counters = {
            "N": len(out),
            "N_target": n_target,
            "N_draft": n_draft,
            "N_discarded": n_discarded,
            "rounds": len(rounds_k),
            "stop_reason": stop_reason,
            "policy": policy.label,
            "batch_size": 1,
        }
        timings: dict[str, Any] = dict(timer.totals)
        timings["total"] = total
        timings["round_seconds"] = round_seconds
        text = pair.tokenizer.decode(out, skip_special_tokens=True)
        return DecodeResult(out, text, counters, rounds_k, rounds_n, timings,
                            self.live.record() if self.live is not None else None)

    def _observe(self, k: int, timer: _Timer, before: dict[str, float]) -> None:
        """Give live pricing one round's seconds (its draft, decision and target phases)."""
        if self.live is not None:
            self.live.observe_phases(k, before, timer.totals)
