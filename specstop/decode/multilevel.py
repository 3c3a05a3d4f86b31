"""Multi-level speculative decoding: a small draft speculates for a middle model, which speculates for the
target (ML-SpecQD's setting: the middle model is often the target itself in int4, the "self" draft).

Levels are numbered from the bottom: ``models[0]`` is the smallest draft, ``models[-1]`` the target.
``policies[i]`` decides how many tokens of ``models[i]`` are drafted for ``models[i + 1]`` in one round.
Every level above the bottom produces its tokens the way the chain decoder does
(:class:`~specstop.decode.chain.SpeculativeDecoder`, docs/design.md "Speculative decoding rounds"): the
level below drafts up to ``K_cap = min(policy cap, room - 1)`` tokens, one forward of this level's model
verifies them, the accepted prefix plus this level's own token is emitted. A middle level's tokens are
then drafts of the level above, which reads them one at a time: its policy may stop after any token,
and the rest of the middle level's block is dropped.

Why it is lossless: each level's verification is the chain's rule applied to the level below's tokens
and the distributions they were drawn from. Greedy: a middle level emits its own argmax sequence, the
target accepts the leading tokens equal to its argmax and emits its own next one. Sampling: speculative
sampling makes each middle-level token an exact draw from that level's (transformed) distribution given
its prefix, and that distribution is the row of the middle model's verification forward at the token's
position, which the level above uses as q in min(1, p/q) and in the residual. So the output follows the
target's distribution whatever the levels below propose (checked by chi-square in the tests).

Every model keeps a KV cache holding the tokens it was fed; before a feed the cache is cut back to its
longest prefix that still matches the sequence to feed (so rejections, dropped block tails and the
levels' different views of the sequence never need per-case rollback code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specstop.cache_prefix import cached_prefix
from specstop.decode.chain import _LM, DecodeResult, _Timer, eos_token_ids
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy
from specstop.pair.context import check_request, check_seed
from specstop.probs import DecodingConfig, logits_to_probs, verify_drafts

__all__ = ["MultiLevelDecoder"]


@dataclass
class _LevelStats:
    """Per level: rounds, tokens drafted for it from below and accepted, forwards and their seconds."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    seconds: float = 0.0


class _Level:
    """One model of the stack: its KV cache and the tokens that cache holds."""

    def __init__(self, model, name: str) -> None:
        self.lm = _LM(model, static_cache=False, max_len=0, compile=False)
        self.name = name
        self.cached: list[int] = []
        self.stats = _LevelStats()

    def logits(self, seq: list[int], keep: int, timer: _Timer) -> torch.Tensor:
        """``[keep, V_model]``: this model's logits after each of the last ``keep`` tokens of ``seq``.

        Feeds only what the cache lacks: the cache is cut to its longest prefix shared with ``seq``
        (leaving at least ``keep`` tokens to feed).
        """
        shared = cached_prefix(self.cached, seq, keep)
        self.lm.rollback(shared)
        t0 = timer.now()
        out, _ = self.lm.feed(seq[shared:], keep_logits=keep)
        self.stats.seconds += timer.add(self.name, t0) - t0
        self.stats.forwards += 1
        self.cached = list(seq)
        return out


class MultiLevelDecoder:
    """Speculative decoding through a stack of models, each drafting for the next (batch size 1).

    Args:
        pair: the :class:`~specstop.pair.ModelPair` whose draft is the bottom level and whose target is the
            top; its tokenizer, shared vocabulary and EOS ids are the stack's.
        middle: the models between them, bottom first (e.g. ``[quantized copy of the target]``).
        policies: one stopping policy per gap, bottom first: ``policies[0]`` stops the draft's rounds for
            ``middle[0]``, the last one stops the rounds drafted for the target. Rules (static,
            heuristic, confidence) or learned policies that read only the drafting level's
            distribution (a policy reading hidden states is refused: no level hands them up).
        decoding: the decoding transform for every level (temperature 0 = greedy).
    """

    def __init__(self, pair, middle: Sequence, policies: Sequence[StoppingPolicy | str],
                 decoding: DecodingConfig | None = None) -> None:
        models = [pair.draft, *middle, pair.target]
        if len(policies) != len(models) - 1:
            raise UserError(f"a stack of {len(models)} models needs {len(models) - 1} stopping policies, bottom "
                            f"first; got {len(policies)}")
        self.pair = pair
        self.models = models
        self.decoding = decoding or DecodingConfig()
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.policies = []
        for i, pol in enumerate(policies):
            pol = StoppingPolicy.for_pair(pol, pair if i == 0 else None)
            if i > 0 and pol.predictor is not None:  # its export names a draft: the pair's, not a middle model
                raise UserError(f"policy {pol.label} is learned: only the bottom level (the pair's draft) runs a "
                                "learned policy here; give the levels above a rule (static:K, confidence:T)")
            if pol.needs_hidden:
                raise UserError(f"policy {pol.label} reads a draft's hidden state, which the multi-level decoder "
                                "does not pass between levels: use a rule or a distribution-reading policy")
            pol.configure(self.decoding, pair.vocab_size)
            self.policies.append(pol)
        self.last_levels: list[dict] | None = None

    @property
    def label(self) -> str:
        """The policies bottom first, e.g. ``static:3 / confidence:0.6``."""
        return " / ".join(p.label for p in self.policies)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.decoding, self.vocab_size)

    def _pick(self, logits: torch.Tensor, probs: torch.Tensor | None, gen: torch.Generator | None) -> int:
        """Greedy: the argmax of the shared-vocabulary logits; else a sample of ``probs`` (their transform)."""
        if self.decoding.greedy:
            return int(logits[..., : self.vocab_size].argmax(-1))
        return int(torch.multinomial(probs.to(gen.device), 1, generator=gen))

    # ------------------------------------------------------------------ one level's tokens
    def _tokens(self, level: int, seq: list[int], cap: int, policy: StoppingPolicy | None, ctx: dict
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Up to ``cap`` tokens of ``models[level]`` after ``seq``, with the distribution each was drawn from
        (``[V]`` after the decoding transform; None when greedy and the policy does not read it).

        ``policy`` (drafting for the level above; None at the top) may stop after any token; EOS ends
        the tokens too. Each distribution is computed once, for the pick, the policy and the level above.
        """
        levels, timer, gen = ctx["levels"], ctx["timer"], ctx["gen"]
        me = levels[level]
        want_q = policy is not None and (not self.decoding.greedy or policy.reads_probs)
        tokens: list[int] = []
        qs: list[torch.Tensor | None] = []
        while len(tokens) < cap:
            here = seq + tokens
            if level == 0:
                row = me.logits(here, 1, timer)[-1]
                q = self._probs(row) if want_q else None
                block = [(self._pick(row, q, gen), row, q)]
            else:  # this level's round: its rows' distributions are computed as the tokens are read
                block = [(tok, row, None) for tok, row in zip(*self._round(level, here, cap - len(tokens), ctx))]
            for tok, row, q in block:
                if q is None and want_q:
                    q = self._probs(row)
                tokens.append(tok)
                qs.append(q)
                stop = False
                if policy is not None:
                    t0 = timer.now()
                    position = len(seq) + len(tokens) - 1 - ctx["prompt_len"]
                    stop = policy.should_stop(row, None, position=position, draft_probs=q, draft_token=tok)
                    timer.add("predictor", t0)
                if stop or tok in self.eos or len(tokens) >= cap:
                    return tokens, qs
        return tokens, qs

    def _round(self, level: int, seq: list[int], room: int, ctx: dict) -> tuple[list[int], list[torch.Tensor]]:
        """One round of ``models[level]`` drafted for by the level below: the tokens it emits (accepted
        drafts and its own token) with this level's logits for each."""
        levels, timer, gen = ctx["levels"], ctx["timer"], ctx["gen"]
        me, policy = levels[level], self.policies[level - 1]
        k_cap = min(policy.cap(), room - 1, ctx["max_draft"] if level == len(levels) - 1 else room)
        if k_cap <= 0:  # one step of this level alone: a draft could not leave room for its own token
            logits = me.logits(seq, 1, timer)
            me.stats.rounds += 1
            if level == len(levels) - 1:
                ctx["round_k"].append(0)
                ctx["round_n"].append(0)
            probs = None if self.decoding.greedy else self._probs(logits[-1])
            return [self._pick(logits[-1], probs, gen)], [logits[-1]]
        policy.reset()
        drafted, q_rows = self._tokens(level - 1, seq, k_cap, policy, ctx)
        k = len(drafted)
        logits = me.logits(seq + drafted, k + 1, timer)  # rows: this level's distributions at s .. s + k
        t0 = timer.now()
        q = None if self.decoding.greedy else torch.stack(q_rows)
        n, final = verify_drafts(logits, drafted, q, self.decoding, self.vocab_size, gen)
        timer.add("accept", t0)
        policy.end_round(k, n)
        me.stats.rounds += 1
        me.stats.drafted += k
        me.stats.accepted += n
        if level == len(levels) - 1:
            ctx["round_k"].append(k)
            ctx["round_n"].append(n)
        return drafted[:n] + [final], list(logits[: n + 1])

    # ------------------------------------------------------------------ main loop
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None, *,
                 max_draft: int | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty).
            max_new_tokens: length cap.
            seed: seeds every level's samples and acceptance draws (sampling only).
            max_draft: cap the tokens drafted for the target per round (0: the target alone).

        Returns:
            A :class:`~specstop.decode.chain.DecodeResult` whose rounds are the target's; its counters
            add ``levels``: per level (bottom first) rounds, tokens drafted for it and accepted,
            forwards and their seconds. The timings hold one phase per level (``level0``, ...,
            ``target``) beside ``prefill``, ``predictor``, ``accept`` and ``total``.
        """
        prompt_ids = check_request(self.pair, prompt_ids, max_new_tokens)
        seed = check_seed(seed)
        names = [f"level{i}" for i in range(len(self.models) - 1)] + ["target"]
        levels = [_Level(m, name) for m, name in zip(self.models, names)]
        timer = _Timer(levels[-1].lm.device)
        timer.totals.update(dict.fromkeys(names, 0.0))
        gen = None
        if not self.decoding.greedy:
            gen = torch.Generator(device=levels[0].lm.device)
            gen.manual_seed(0 if seed is None else int(seed))
        for pol in self.policies:
            pol.start_sequence()
        ctx = {"levels": levels, "timer": timer, "gen": gen, "prompt_len": len(prompt_ids), "round_k": [],
               "round_n": [], "max_draft": max_draft if max_draft is not None else max_new_tokens}
        t_start = timer.now()
        if len(prompt_ids) > 1:  # prefill all but the last prompt token, which each level feeds in its first round
            t0 = timer.now()
            for lv in levels:
                lv.lm.feed(list(prompt_ids[:-1]), keep_logits=1)
                lv.cached = list(prompt_ids[:-1])
            timer.add("prefill", t0)
        round_seconds: list[float] = []
        out: list[int] = []
        while len(out) < max_new_tokens and not (out and out[-1] in self.eos):
            t_round = timer.now()
            block, _ = self._round(len(levels) - 1, list(prompt_ids) + out, max_new_tokens - len(out), ctx)
            for i, tok in enumerate(block):
                if tok in self.eos:
                    block = block[: i + 1]
                    break
            out.extend(block)
            round_seconds.append(timer.now() - t_round)
        total = timer.now() - t_start
        top = levels[-1].stats
        self.last_levels = [{"name": lv.name, **lv.stats.__dict__} for lv in levels]
        counters = {
            "N": len(out), "N_target": top.forwards, "N_draft": top.drafted, "N_discarded": top.drafted - top.accepted,
            "rounds": top.rounds, "stop_reason": "eos" if out and out[-1] in self.eos else "length",
            "policy": self.label, "batch_size": 1, "levels": self.last_levels,
        }
        timings = dict(timer.totals)
        timings["draft"] = sum(lv.stats.seconds for lv in levels[:-1])  # every level below the target
        timings["total"] = total
        timings["round_seconds"] = round_seconds
        text = self.pair.tokenizer.decode(out, skip_special_tokens=True)
        return DecodeResult(out, text, counters, ctx["round_k"], ctx["round_n"], timings)
