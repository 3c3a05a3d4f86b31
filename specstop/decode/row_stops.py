"""Where each request's draft stops in a batched draft round: :class:`RowStops`.

An engine's draft runner drafts every request of a step together, one batched draft forward per
position. After each forward this class decides, per row, whether that request's draft ends there: its
policy (the one its decoding setting selects from an export's ``by_decoding`` entries), its cap, and
EOS. The runner keeps forwarding while any row drafts on, and cuts each row's draft at its stop, so
drafts of different lengths leave one round (the engine verifies each row's own length).

The rows' state machines live one round; the policy objects (one per decoding setting met) live as
long as the runner, with a live re-pricer each where the policy carries price-free statistics
(:mod:`specstop.decode.live_pricing`). Nothing here imports an engine: the runner hands in logits,
hidden states, tokens and each row's setting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from specstop.export.runtime import StoppingPolicy
from specstop.probs import DecodingConfig

__all__ = ["RowStops", "row_setting"]


def row_setting(temperature: float, top_k: int, top_p: float, vocab_size: int) -> DecodingConfig:
    """A request's decoding setting from an engine's per-row sampling arrays.

    Engines store greedy rows as temperature 0 and "no top-k" as the vocabulary size (vLLM's input
    batch does both); values come from float32 arrays, so they are rounded to 6 digits (0.7 is
    0.699999988 there) before a ``by_decoding`` entry is picked for them.
    """
    t = round(float(temperature), 6)
    if t <= 0.0:
        return DecodingConfig()
    k = int(top_k)
    return DecodingConfig(temperature=t, top_k=0 if k <= 0 or k >= vocab_size else k,
                          top_p=min(1.0, round(float(top_p), 6)))


class RowStops:
    """Per-request stops for batched draft rounds.

    Args:
        policy: the policy as loaded (an export's ``by_decoding`` entries included); each decoding
            setting met gets its own copy, configured for that setting.
        vocab_size: the shared tokenizer vocabulary (logit columns past it are padding).
        eos: token ids that end a draft once drafted.
        live_table: the cost table live re-pricing measures against (None: each policy's export's own);
            ``live=False`` pins every policy.
        log: where the one line per setting met goes (the engine's logger, so the line shows in its output).
    """

    def __init__(self, policy: StoppingPolicy, vocab_size: int | None, *, eos: Sequence[int] = (),
                 live_table=None, live: bool = True, log: Callable[[str], None] | None = None) -> None:
        self.base = policy
        self.vocab_size = vocab_size
        self.eos = torch.tensor(sorted({int(e) for e in eos}), dtype=torch.long)
        self.live_table = live_table
        self.live = live
        self._log = log or logging.getLogger("specstop").info
        self._policies: dict[DecodingConfig, StoppingPolicy] = {}
        self._pricers: dict[DecodingConfig, object] = {}
        self._groups: dict[DecodingConfig, np.ndarray] = {}
        self.caps = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.stopped = np.zeros(0, dtype=bool)
        self.positions = np.zeros(0, dtype=np.int64)
        self.room = np.zeros(0, dtype=np.int64)
        self._exact = False
        #: Counters since start: rounds, draft forwards (steps), tokens kept, rows per draft length, rows
        #: per reason their draft ended (``ends``: its cap, the room its request has left, EOS, a token past
        #: the shared vocabulary, or the policy; a row that hit its cap counts there whatever else held, then
        #: one out of room) and the policy each decoding setting runs (label).
        self.stats: dict = {"rounds": 0, "steps": 0, "drafted": 0, "lengths": {}, "ends": {}, "settings": {}}

    # ------------------------------------------------------------------ policies
    def policy_for(self, decoding: DecodingConfig) -> StoppingPolicy:
        """The policy requests at ``decoding`` run (made, configured and logged the first time it is met)."""
        policy = self._policies.get(decoding)
        if policy is not None:
            return policy
        from specstop.export.by_decoding import describe

        policy = StoppingPolicy(self.base.spec, self.base.predictor, config=self.base.config)
        policy.configure(decoding, self.vocab_size)
        self._policies[decoding] = policy
        if self.live:
            from specstop.decode.live_pricing import LivePricer

            self._pricers[decoding] = LivePricer.for_policy(policy, self.live_table)
        entry = f" (policy {policy.label}: the by_decoding entry tuned at {describe(policy.setting)})" \
            if policy.setting is not None else f" (policy {policy.label})"
        self.stats["settings"][describe(decoding.to_dict())] = policy.label
        self._log(f"specstop: requests at {describe(decoding.to_dict())} run {policy.spec.label}{entry}")
        mismatch = policy.temperature_mismatch(decoding)
        if mismatch:
            logging.getLogger("specstop").warning("%s", mismatch)
        return policy

    @property
    def needs_hidden(self) -> bool:
        return self.base.needs_hidden

    # ------------------------------------------------------------------ a round
    def begin(self, settings: Sequence[DecodingConfig], cap: int, positions: Sequence[int] | None = None,
              exact: bool = False, room: Sequence[int] | None = None) -> int:
        """Start a round of ``len(settings)`` rows.

        Args:
            settings: each row's decoding setting.
            cap: the most tokens any row may draft (the engine's K this step).
            positions: ``[B]`` 0-based response position of each row's first drafted token; an engine that
                learns them only from its first forward gives them to :meth:`place` before the first step.
            exact: every row drafts its cap (a cost sweep): the policies still decide at every step, since
                their cost is part of one, and their stops, EOS and ``room`` are ignored.
            room: ``[B]`` the most draft tokens of use to each row, as :meth:`place` takes it (None: no limit).

        Returns:
            The most draft forwards the round can take (0: no row drafts).
        """
        rows = len(settings)
        groups: dict[DecodingConfig, list[int]] = {}
        for b, s in enumerate(settings):
            groups.setdefault(s, []).append(b)
        self._groups = {s: np.asarray(idx) for s, idx in groups.items()}
        self.caps = np.full(rows, max(int(cap), 0), dtype=np.int64)
        for s, idx in self._groups.items():
            policy = self.policy_for(s)
            policy.reset_batch(batch_size=len(idx))
            self.caps[idx] = np.minimum(self.caps[idx], policy.cap_batch())
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._exact = bool(exact)
        self.room = np.full(rows, np.iinfo(np.int64).max, dtype=np.int64)
        self.place(np.zeros(rows, dtype=np.int64) if positions is None else positions, room)
        limit = np.minimum(self.caps, self.room)
        self.stopped = limit <= 0
        return int(limit.max(initial=0))

    def place(self, positions: Sequence[int], room: Sequence[int] | None = None) -> None:
        """Where each row's draft starts, and how much of it its request can still use.

        Args:
            positions: ``[B]`` 0-based response position of each row's first drafted token (learned policies
                read them).
            room: ``[B]`` the most draft tokens of use to each row (None: unchanged): a request with L tokens
                left to generate keeps at most L from the next verification, its bonus token among them, so
                L - 1 drafted tokens are all it can use. An engine that does not cut drafts at a request's
                ``max_tokens`` (vLLM's scheduler cuts at the model's length only) would draft and verify the
                rest for nothing. Ignored in an exact round.
        """
        self.positions = np.asarray(positions, dtype=np.int64).reshape(len(self.caps))
        if room is not None and not self._exact:
            self.room = np.maximum(np.asarray(room, dtype=np.int64).reshape(len(self.caps)), 0)

    def step(self, logits: torch.Tensor, hidden: torch.Tensor | None, tokens: torch.Tensor) -> bool:
        """Decide after one batched draft forward.

        Args:
            logits: ``[B, V]`` the draft's logits the step's tokens came from (q_j of every row).
            hidden: ``[B, H]`` the draft states that produced them (policies that read them), else None.
            tokens: ``[B]`` the tokens drafted at this step.

        Returns:
            True when every row has stopped: the round needs no more forwards.
        """
        active = ~self.stopped
        self.lengths[active] += 1
        self.stats["steps"] += 1
        tokens_cpu = tokens.detach().reshape(-1).cpu().long()
        # An engine may draft a padding column past the shared vocabulary (its argmax runs over the model's
        # whole logit row): the policies read q over the vocabulary, where that token has no mass, so the
        # draft ends there (the engine still verifies the token).
        outside = tokens_cpu >= self.vocab_size if self.vocab_size else torch.zeros_like(tokens_cpu, dtype=torch.bool)
        if outside.any():
            tokens_cpu = tokens_cpu.clamp(max=self.vocab_size - 1)
        # a row whose token reaches its cap stops there whatever its policy says: only the others ask it
        # (at the cap of 1 that large batch sizes run, no policy runs at all)
        ask = active & (self.lengths < np.minimum(self.caps, self.room))
        by_policy = np.zeros_like(active)
        for s, idx in self._groups.items():
            if not ask[idx].any():
                continue
            sel = torch.as_tensor(idx, device=logits.device)
            stop = self._policies[s].should_stop_batch(
                logits.index_select(0, sel), None if hidden is None else hidden.index_select(0, sel),
                self.positions[idx] + self.lengths[idx] - 1, active=ask[idx],
                draft_tokens=tokens_cpu[torch.as_tensor(idx)])
            by_policy[idx] = stop.numpy() & ask[idx]
        # Each row that ends here is counted once, under the first of these reasons that holds for it.
        ends = [("cap", active & (self.lengths >= self.caps))]
        if not self._exact:
            at_eos = torch.isin(tokens_cpu, self.eos).numpy() if len(self.eos) else np.zeros_like(active)
            ends += [("room", active & (self.lengths >= self.room)), ("eos", active & at_eos),
                     ("vocab", active & outside.numpy()), ("policy", by_policy)]
        for reason, rows in ends:
            rows = rows & ~self.stopped
            if rows.any():
                self.stopped |= rows
                self.stats["ends"][reason] = self.stats["ends"].get(reason, 0) + int(rows.sum())
        return bool(self.stopped.all())

    def cut(self, drafted: torch.Tensor) -> list[list[int]]:
        """Each row's draft: ``drafted`` ``[B, steps]`` cut at the row's stop (rows that did not draft: [])."""
        cols = drafted.shape[1] if drafted.ndim == 2 else 0
        ids = drafted.tolist() if cols else [[] for _ in range(len(self.lengths))]
        # a row that learned its room only after its first token (0: one token left to generate) keeps none
        out = [row[: int(n)] for row, n in zip(ids, np.minimum(np.minimum(self.lengths, cols), self.room))]
        self.stats["rounds"] += 1
        for d in out:
            self.stats["drafted"] += len(d)
            self.stats["lengths"][len(d)] = self.stats["lengths"].get(len(d), 0) + 1
        return out

    def observe(self, draft_s: float, target_s: float) -> None:
        """Live re-pricing: the round just cut took ``draft_s`` to draft and its rows' previous verification
        ``target_s``; each setting's pricer records it (its own longest draft as K) and may switch that
        setting's policy from the next round on."""
        rows = len(self.lengths)
        for s, idx in self._groups.items():
            pricer = self._pricers.get(s)
            k = int(self.lengths[idx].max(initial=0))
            if pricer is not None and k > 0:
                pricer.observe(k, draft_s=draft_s, decision_s=0.0, target_s=target_s, batch_size=rows)

    def live_record(self) -> dict:
        """Each setting's live re-pricing record (ratios, policy in use, switches)."""
        from specstop.export.by_decoding import describe

        return {describe(s.to_dict()): p.record() for s, p in self._pricers.items() if p is not None}
