"""Lossless speculative decoding of B prompts at once: one draft forward per step and one target
forward per round for the whole batch, acceptance per sequence.

Round semantics per row are the chain decoder's (docs/design.md "Speculative decoding rounds",
:mod:`specstop.decode.chain`): ``K_cap = min(policy cap, remaining - 1)``; drafting stops when the
row's policy says stop, at ``K_cap`` or after EOS; greedy keeps the leading drafted tokens equal to
the target's argmax and emits the target's token; sampling accepts ``y_i`` while ``r_i < min(1,
p/q)``, resamples from ``norm(max(p - q, 0))`` on a rejection and samples a bonus from p when all are
accepted. So every row emits exactly what the chain decoder would emit for that prompt alone (greedy,
up to floating-point summation order in batched matrix products).

The batch's round: every row that still drafts is fed its last drafted token in one draft forward
per step; a row whose policy stopped (a static K reached, or its drafted token's draft probability
below a confidence threshold) is fed nothing and proposes nothing more, and the round's drafting ends
when every row has stopped. One target forward then verifies every row's block (rows with nothing
drafted - ``K_cap == 0`` - take a plain target step in the same forward). Rows finish independently
on EOS or ``max_new_tokens`` and leave the batch (their cache rows are dropped), so the cost of a
round is that of the rows still decoding.

KV caches (why masks and not cropping): HF's ``DynamicCache`` holds one tensor per layer for all rows,
with one shared column index. Rows accept different numbers of tokens, so after a round their valid
lengths differ. Cropping every row to the shortest and re-feeding the others' accepted tokens costs
extra forwards (and still needs padding inside a forward); instead each model keeps a per-row column
mask: a fed block is right-padded to the longest row's block, pads and rejected tokens stay in the
cache as masked columns, and each row's position ids count only its valid tokens. Masked keys get
exactly zero attention weight (the additive mask is ``finfo.min``, whose ``exp`` underflows to 0),
and keys carry their RoPE rotation from their own position id, so a row attends exactly to its own
sequence: the same computation as the row decoded alone. Trailing columns masked in every row are
cropped after each round; when the masked columns inside the cache grow past a quarter of it, each
row's valid columns are gathered to the right (left-padded, as prompts are) so attention does not
read a growing number of dead columns.

Masks are passed as 4D additive tensors ``[B, 1, n_new, past + n_new]`` with explicit position ids,
which transformers 5 hands to the ``eager`` and ``sdpa`` attention implementations as they are (the
tree decoder relies on the same). A pad query attends to itself, so no attention row is fully masked
(a fully masked row is NaN in some kernels, and a NaN value in the cache would poison every row that
multiplies it by a zero weight).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specstop.decode.chain import DecodeResult, _Timer, eos_token_ids
from specstop.decode.tree_cache import TREE_ATTENTION_IMPLS
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy
from specstop.pair.compat import cache_kwarg
from specstop.pair.context import check_request, check_seed
from specstop.probs import DecodingConfig, logits_to_probs, verify_drafts

__all__ = ["BatchDecodeResult", "BatchedSpeculativeDecoder"]

# Compact a cache when its masked columns exceed this share of it (and COMPACT_MIN columns).
COMPACT_SHARE = 0.25
COMPACT_MIN = 16


@dataclass
class BatchDecodeResult:
    """Attributes:
    token_ids: ``[B]`` lists of generated tokens per row (prompt excluded), in prompt order.
    texts: their decoded texts (special tokens skipped).
    counters: ``[B]`` per row: ``N`` emitted tokens, ``N_target`` target forwards the row took part
        in (= its rounds), ``N_draft`` drafted tokens (= draft forwards that produced one of its
        tokens), ``N_accepted``, ``N_discarded``, ``rounds``, ``stop_reason`` ("eos" | "length").
    round_lengths: ``[B]`` per row, K per round (0 for a target-only step).
    accepted_per_round: ``[B]`` per row, n per round (bonus not counted).
    batch: batch-level counters: ``batch_size``, ``rounds``, ``target_forwards``, ``draft_forwards``,
        ``round_k`` (draft forwards per round: the longest row's K), ``round_rows`` (rows decoding in
        each round), ``policy``.
    timings: seconds per phase as the chain decoder's (``prefill``, ``draft``, ``predictor``,
        ``target``, ``accept``, ``rollback``, ``total``) and ``round_seconds`` per batch round.
    """

    token_ids: list[list[int]]
    texts: list[str]
    counters: list[dict[str, Any]]
    round_lengths: list[list[int]]
    accepted_per_round: list[list[int]]
    batch: dict[str, Any]
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def decode_seconds(self) -> float:
        """Wall time of the rounds (prefill excluded): what batch throughput is measured on."""
        return float(self.timings["total"] - self.timings["prefill"])

    def row(self, b: int) -> DecodeResult:
        """Row ``b`` as the chain decoder's :class:`~specstop.decode.chain.DecodeResult` (batch timings)."""
        return DecodeResult(self.token_ids[b], self.texts[b], dict(self.counters[b]), list(self.round_lengths[b]),
                            list(self.accepted_per_round[b]), dict(self.timings))

    def to_dict(self) -> dict:
        return asdict(self)


class _BatchLM:
    """One model, its ``DynamicCache`` over B rows and a column mask per row (see the module docstring).

    Attributes:
        mask: ``[B, C]`` bool, True where column c of the cache holds one of the row's tokens.
        length: ``[B]`` valid tokens per row (the row's sequence prefix held in the cache).
    """

    def __init__(self, model, batch_size: int) -> None:
        from transformers import DynamicCache

        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in TREE_ATTENTION_IMPLS:
            raise UserError(
                f"{type(model).__name__} uses attention implementation {impl!r}, which takes no per-row 4D mask; "
                "load it with attn_implementation='sdpa' (or 'eager') for batched decoding"
            )
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = next(model.parameters()).dtype
        self.cache = DynamicCache(config=model.config)
        if any(getattr(layer, "sliding_window", None) for layer in getattr(self.cache, "layers", [])):
            raise UserError(f"{type(model).__name__} has sliding-window attention layers; batched decoding "
                            "needs full-attention KV caches (decode one prompt at a time)")
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.length = [0] * batch_size

    @torch.no_grad()
    def feed(self, blocks: list[list[int]], *, left: bool = False, hidden: bool = False, layer: int = -1,
             keep_logits: int | None = None):
        """Feed each row its block of tokens in one forward; blocks are padded to the longest.

        Args:
            blocks: ``[B]`` token lists (empty: the row is fed only pads).
            left: pad on the left (prompts) instead of the right (decoding blocks).
            hidden: also return ``hidden_states[layer]``.
            keep_logits: logits of the last this many block columns (default all; a prefill needs none
                of them, and the vocabulary projection of every prompt position is the costliest part).

        Returns:
            ``(logits [B, keep_logits, V_model], hidden [B, F, H] | None, index)`` where ``index[b]`` is
            the column of row b's last fed token inside the block (-1 when the row was fed nothing).
        """
        n_rows, width = len(blocks), max(len(b) for b in blocks)
        past = self.mask.shape[1]
        ids = torch.zeros(n_rows, width, dtype=torch.long)
        valid = torch.zeros(n_rows, width, dtype=torch.bool)
        pos = torch.zeros(n_rows, width, dtype=torch.long)
        index = []
        for b, blk in enumerate(blocks):
            n = len(blk)
            start = width - n if left else 0
            if n:
                ids[b, start : start + n] = torch.tensor(blk)
                valid[b, start : start + n] = True
                pos[b, start : start + n] = torch.arange(self.length[b], self.length[b] + n)
            pos[b, ~valid[b]] = self.length[b]  # pads: any position; nothing attends to them
            index.append(start + n - 1 if n else -1)
        valid = valid.to(self.device)
        keys_valid = torch.cat([self.mask, valid], dim=1)  # [B, past + F]
        q_col = torch.arange(past, past + width, device=self.device)
        k_col = torch.arange(past + width, device=self.device)
        allowed = (k_col[None, None, :] <= q_col[None, :, None]) & keys_valid[:, None, :]
        allowed |= k_col[None, None, :] == q_col[None, :, None]  # every query sees itself: no empty row
        attn = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        attn.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attn[:, None],
            position_ids=pos.to(self.device),
            cache_position=q_col,  # cache columns the keys land in (some 5.x releases read it)
            **cache_kwarg(self.model, self.cache),
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=width if keep_logits is None else keep_logits,
        )
        self.mask = keys_valid
        self.length = [n + len(b) for n, b in zip(self.length, blocks)]
        h = out.hidden_states[layer] if hidden else None
        return out.logits, h, index

    def rollback(self, keep: list[int]) -> None:
        """Keep the first ``keep[b]`` valid tokens of each row; mask the rest, crop dead trailing
        columns, and compact when masked columns inside the cache have piled up."""
        keep_t = torch.tensor(keep, device=self.device)
        self.mask &= self.mask.long().cumsum(1) <= keep_t[:, None]
        self.length = [min(n, k) for n, k in zip(self.length, keep)]
        cols = self.mask.any(0).nonzero()
        last = int(cols[-1]) + 1 if len(cols) else 0
        if last < self.mask.shape[1]:
            self.cache.crop(last - self.mask.shape[1])  # transformers 5: a negative count removes columns
            self.mask = self.mask[:, :last]
        dead = self.mask.shape[1] - max(self.length, default=0)
        if dead > max(COMPACT_MIN, COMPACT_SHARE * self.mask.shape[1]):
            self._compact()

    def _compact(self) -> None:
        """Gather each row's valid columns to the right end of a cache of ``max(length)`` columns."""
        width = max(self.length)
        idx = torch.zeros(len(self.length), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(self.length), width, dtype=torch.bool, device=self.device)
        for b, n in enumerate(self.length):
            if n:
                idx[b, width - n :] = self.mask[b].nonzero().squeeze(1)
                mask[b, width - n :] = True
        for lay in self.cache.layers:
            if not getattr(lay, "is_initialized", False):
                continue
            g = idx[:, None, :, None].expand(-1, lay.keys.shape[1], -1, lay.keys.shape[-1])
            lay.keys = lay.keys.gather(2, g)
            lay.values = lay.values.gather(2, g.expand(-1, -1, -1, lay.values.shape[-1]))
        self.mask = mask

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.length = [self.length[r] for r in rows]


class BatchedSpeculativeDecoder:
    """Speculative decoding of a batch of prompts with one stopping policy state per sequence.

    Args:
        pair: the draft/target :class:`~specstop.pair.ModelPair` (``eager`` or ``sdpa`` attention).
        policy: a :class:`StoppingPolicy` or its string (``static:4`` = a static K for the batch;
            ``confidence:0.4`` = per-sequence stopping on the drafted token's draft probability, capped
            at SL_max; heuristic and exported predictors also work, one state per sequence).
        decoding: the decoding transform for both models (temperature 0 = greedy).
        live_pricing: re-pick the policy's threshold, SL_max or K from its price-free statistics as the
            step costs this decoder measures move, priced as rounds of the batch's rows
            (:mod:`specstop.decode.live_pricing`; lossless, logged); False pins the policy as given.
        cost_model: the table live pricing scales (None: the export's own); its ``batch`` section, when
            measured, prices the rounds at the batch size.
    """

    def __init__(self, pair, policy: StoppingPolicy | str, decoding: DecodingConfig | None = None, *,
                 live_pricing: bool = True, cost_model=None) -> None:
        from specstop.decode.live_pricing import LivePricer

        self.pair = pair
        self.policy = StoppingPolicy.for_pair(policy, pair)
        self.decoding = decoding or DecodingConfig()
        self.policy.configure(self.decoding, pair.vocab_size)
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.live = LivePricer.for_policy(self.policy, cost_model) if live_pricing else None

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.decoding, self.vocab_size)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int | None = None, *,
                 max_draft: int | None = None) -> BatchDecodeResult:
        """Generate up to ``max_new_tokens`` tokens after each prompt.

        Args:
            prompts: ``[B]`` rendered prompts' token ids (each non-empty; lengths may differ).
            max_new_tokens: length cap per row.
            seed: seeds the draft samples, acceptance uniforms and resampling (sampling only).
            max_draft: cap every round at this many drafted tokens per row; 0 is plain batched target
                decoding through the same code path (the no-speculation baseline).

        Returns:
            :class:`BatchDecodeResult`, rows in prompt order.
        """
        if not (isinstance(prompts, (list, tuple)) or getattr(prompts, "ndim", None) == 2):
            raise UserError(f"prompts must be a list of prompts (one list of token ids per row), got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise UserError("prompts is empty: give at least one prompt (one list of token ids per row)")
        prompts = [check_request(self.pair, p, max_new_tokens, what=f"prompts[{i}]") for i, p in enumerate(prompts)]
        seed = check_seed(seed)
        pair, policy, greedy = self.pair, self.policy, self.decoding.greedy
        n_rows = len(prompts)
        draft = _BatchLM(pair.draft, n_rows)
        target = _BatchLM(pair.target, n_rows)
        timer = _Timer(target.device)
        gen = None
        if not greedy:
            gen = torch.Generator(device=draft.device)
            gen.manual_seed(0 if seed is None else int(seed))
        need_hidden = policy.needs_hidden
        policy.reset_batch(batch_size=n_rows)  # one state machine per prompt, indexed by prompt
        if self.live is not None:
            self.live.batch_size = n_rows

        seqs = [list(p) for p in prompts]
        outs: list[list[int]] = [[] for _ in range(n_rows)]
        ks: list[list[int]] = [[] for _ in range(n_rows)]
        ns: list[list[int]] = [[] for _ in range(n_rows)]
        stop_reason = ["length"] * n_rows
        rows = list(range(n_rows))  # prompt index of each live batch row
        round_k: list[int] = []
        round_rows: list[int] = []
        round_seconds: list[float] = []
        draft_forwards = target_forwards = 0
        t_start = timer.now()

        # Prefill all prompt tokens but the last, left-padded; the last is fed with the first round.
        if any(len(s) > 1 for s in seqs):
            t0 = timer.now()
            draft.feed([s[:-1] for s in seqs], left=True, keep_logits=1)
            t0 = timer.add("prefill", t0)
            target.feed([s[:-1] for s in seqs], left=True, keep_logits=1)
            timer.add("prefill", t0)

        while rows:
            t_round = t0 = timer.now()
            phases = dict(timer.totals)  # this round's seconds per phase, for live pricing
            live = len(rows)
            caps = []
            own = policy.cap_batch()
            for p in rows:
                cap = min(own[p], max_new_tokens - len(outs[p]) - 1)
                caps.append(min(cap, max_draft) if max_draft is not None else cap)
            drafting = [c > 0 for c in caps]
            starting = {p for p, d in zip(rows, drafting) if d}
            policy.reset_batch(mask=[p in starting for p in range(n_rows)])
            drafted: list[list[int]] = [[] for _ in rows]
            qs: list[list[torch.Tensor]] = [[] for _ in rows]
            blocks = [seqs[p][draft.length[b] :] if drafting[b] else [] for b, p in enumerate(rows)]
            steps = 0
            while any(drafting):
                logits, hidden, index = draft.feed(blocks, hidden=need_hidden, layer=policy.hidden_layer)
                steps += 1
                sel = torch.tensor([max(i, 0) for i in index], device=logits.device)
                last = logits[torch.arange(live, device=logits.device), sel]  # [live, V_model]
                h_last = hidden[torch.arange(live, device=hidden.device), sel] if hidden is not None else None
                q = self._probs(last) if (not greedy or policy.reads_probs) else None
                if greedy:
                    ys = last[:, : self.vocab_size].argmax(-1).tolist()
                else:
                    ys = torch.multinomial(q.to(gen.device), 1, generator=gen).squeeze(1).tolist()
                t0 = timer.add("draft", t0)
                stops = self._decide(last, h_last, q, ys, rows, drafting, [len(outs[p]) + len(d) for p, d in
                                                                        zip(rows, drafted)])
                t0 = timer.add("predictor", t0)
                blocks = [[] for _ in rows]
                for b in range(live):
                    if not drafting[b]:
                        continue
                    y = int(ys[b])
                    drafted[b].append(y)
                    if q is not None and not greedy:
                        qs[b].append(q[b])
                    if stops[b] or len(drafted[b]) == caps[b] or y in self.eos:
                        drafting[b] = False
                    else:
                        blocks[b] = [y]
            draft_forwards += steps

            # ---- verify: one target forward over every row's pending token(s) + its drafted block
            bases = [len(seqs[p]) for p in rows]
            pend = [seqs[p][target.length[b] :] for b, p in enumerate(rows)]
            logits, _, _ = target.feed([pd + d for pd, d in zip(pend, drafted)])
            target_forwards += 1
            t0 = timer.add("target", t0)
            results = []
            for b in range(live):
                k = len(drafted[b])
                rows_p = logits[b, len(pend[b]) - 1 : len(pend[b]) + k]  # p_s .. p_{s+K}
                results.append(self._accept(rows_p, drafted[b], qs[b], gen))
            t0 = timer.add("accept", t0)

            keep_target, keep_draft, finished = [], [], []
            for b, p in enumerate(rows):
                n, final = results[b]
                k = len(drafted[b])
                emitted = drafted[b][:n] + [final]
                for i, t in enumerate(emitted):
                    if t in self.eos:
                        emitted = emitted[: i + 1]
                        break
                ks[p].append(k)
                ns[p].append(n)
                seqs[p].extend(emitted)
                outs[p].extend(emitted)
                keep_target.append(len(seqs[p]) - 1)
                keep_draft.append(min(draft.length[b], bases[b] + n))
                if outs[p][-1] in self.eos:
                    stop_reason[p] = "eos"
                    finished.append(b)
                elif len(outs[p]) >= max_new_tokens:
                    finished.append(b)
            policy.end_round_batch(
                [ks[p][-1] if p in rows else 0 for p in range(n_rows)],
                [ns[p][-1] if p in rows else 0 for p in range(n_rows)],
                mask=[p in rows and ks[p][-1] > 0 for p in range(n_rows)],
            )
            target.rollback(keep_target)
            draft.rollback(keep_draft)
            if finished:
                stay = [b for b in range(live) if b not in set(finished)]
                rows = [rows[b] for b in stay]
                if rows:
                    target.select(stay)
                    draft.select(stay)
            round_k.append(steps)
            round_rows.append(live)
            round_seconds.append(timer.add("rollback", t0) - t_round)
            if self.live is not None:
                self.live.observe_phases(steps, phases, timer.totals, batch_size=live)

        total = timer.now() - t_start
        counters = [
            {"N": len(outs[p]), "N_target": len(ks[p]), "N_draft": sum(ks[p]), "N_accepted": sum(ns[p]),
             "N_discarded": sum(ks[p]) - sum(ns[p]), "rounds": len(ks[p]), "stop_reason": stop_reason[p],
             "policy": policy.label}
            for p in range(n_rows)
        ]
        batch = {"batch_size": n_rows, "rounds": len(round_k), "target_forwards": target_forwards,
                 "draft_forwards": draft_forwards, "round_k": round_k, "round_rows": round_rows,
                 "policy": policy.label}
        timings: dict[str, Any] = dict(timer.totals)
        timings["total"] = total
        timings["round_seconds"] = round_seconds
        texts = [pair.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        if self.live is not None:
            batch["live"] = self.live.record()
        return BatchDecodeResult(outs, texts, counters, ks, ns, batch, timings)

    def _decide(self, logits, hidden, q, ys, rows, drafting, positions) -> list[bool]:
        """The policy's stop decision for every drafting row (the policy's state is indexed by prompt)."""
        n_rows = len(self.policy.cap_batch())
        idx = torch.tensor(rows, device=logits.device)

        def spread(x):  # live rows -> one row per prompt (rows not live get zeros, and are inactive)
            if x is None:
                return None
            full = torch.zeros((n_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
            full[idx.to(x.device)] = x
            return full

        live = set(r for r, d in zip(rows, drafting) if d)
        pos = [0] * n_rows
        tok = [0] * n_rows
        for b, p in enumerate(rows):
            pos[p], tok[p] = positions[b], int(ys[b])
        stop = self.policy.should_stop_batch(
            spread(logits), spread(hidden), pos, active=[p in live for p in range(n_rows)],
            draft_probs=spread(q), draft_tokens=tok,
        )
        return [bool(stop[p]) for p in rows]

    def _accept(self, p_logits: torch.Tensor, drafted: list[int], qs: list[torch.Tensor],
                gen: torch.Generator | None) -> tuple[int, int]:
        """One row's verification: ``(n accepted, the target's token after them)``.

        Args:
            p_logits: ``[K + 1, V_model]`` the target's logits at the row's drafted positions and after.
            drafted: the row's K drafted tokens. qs: their draft distributions (sampling).
        """
        q = torch.stack(qs) if qs and not self.decoding.greedy else None
        return verify_drafts(p_logits, drafted, q, self.decoding, self.vocab_size, gen)
