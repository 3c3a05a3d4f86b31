"""One PEARL model's side of the work: its KV cache, drafting and verification (no transport).

A :class:`ModelServer` owns one model and one KV cache (the chain decoder's cached-model wrapper).
Every request names the cache length to keep (the coordinator mirrors what each cache holds and
rolls back rejected tokens this way) and the tokens to feed after it. The worker that hosts the
server (a pinned process or a thread, :mod:`specstop.decode.pearl_workers`) only moves requests and
results; the same server runs in both.

Results are small: token ids (greedy: the draft's picks, the target's argmax per row) and, when
sampling, probability rows ``[k, V]`` (float32, after the decoding transform).

A stopping policy (:class:`~specstop.export.runtime.StoppingPolicy`) can end the draft's windows
early. It is loaded where the draft runs, from what crosses a process boundary cheaply - a policy
string, an export folder's path or a rule's :class:`~specstop.policy.PolicySpec` - and asked after
every drafted token exactly as the chain decoder asks it: q_j (the draft's distribution after the
decoding transform), the draft's hidden state from the forward that produced q_j, and y_j's
response position.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specstop.decode.chain import _LM
from specstop.errors import UserError
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = ["ModelServer", "load_stop_policy"]

_STOP_FORMS = "confidence:TAU, static:K or an export folder"


def load_stop_policy(stop, *, device="cpu", draft_identity=None, tokenizer_hash=None,
                     allow_draft_mismatch: bool = False, hidden_size: int | None = None):
    """The :class:`~specstop.export.runtime.StoppingPolicy` that ends PEARL windows early.

    Args:
        stop: a policy string (``confidence:0.6``, ``static:3``; parsed by
            :meth:`StoppingPolicy.load`), an export folder, or a rule's :class:`~specstop.policy.PolicySpec`.
        device: where the predictor runs (next to the draft).
        draft_identity, tokenizer_hash, allow_draft_mismatch: the export's draft check
            (:meth:`StoppingPolicy.from_pretrained`).
        hidden_size: the draft's hidden size; a predictor reading states of another size is refused.

    Raises:
        UserError: a malformed policy, a learned policy given as a spec, a heuristic schedule (it
            adapts from per-round verification, which PEARL's windows do not map onto), or an export
            made for another draft.
    """
    from specstop.export.runtime import StoppingPolicy, check_policy_inputs
    from specstop.policy import PolicySpec

    if isinstance(stop, PolicySpec):
        if stop.kind == "predictor":
            raise UserError(f"stop policy {stop.label} is a learned predictor: give its export folder instead of its spec")
        policy = StoppingPolicy.from_spec(stop, device=device)
    else:
        policy = StoppingPolicy.load(
            str(stop), draft_identity=draft_identity, tokenizer_hash=tokenizer_hash,
            allow_draft_mismatch=allow_draft_mismatch, device=device,
        )
    if policy.spec.kind == "heuristic":
        raise UserError(
            f"stop policy {policy.label} grows and shrinks its length from each round's verification, which "
            f"PEARL's overlapping windows do not have; use {_STOP_FORMS}"
        )
    check_policy_inputs(policy, hidden_size, f"stop policy {stop}")
    return policy


def _stop_key(stop) -> str:
    """A cache key for a stop policy argument (strings and folders as given, specs by their fields)."""
    if isinstance(stop, (str, Path)):
        return f"text:{stop}"
    return "spec:" + json.dumps(stop.to_dict(), sort_keys=True, default=str)


class ModelServer:
    """One model plus its KV cache, serving PEARL's draft and verify requests.

    Args:
        model: the causal LM (eval mode).
        vocab_size: the shared vocabulary (logits beyond it are dropped).
        eos: ids that end a response (drafting stops after one).
    """

    def __init__(self, model, vocab_size: int, eos: set[int]) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eos = set(eos)
        self.lm: _LM | None = None
        self.decoding = DecodingConfig()
        self.gen: torch.Generator | None = None
        self.stop = None  # the current sequence's stopping policy (None: whole windows)
        self._stops: dict = {}  # loaded stop policies, kept for the next sequences

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ requests
    def load_stop(self, stop) -> str:
        """Load a stopping policy for later sequences (checked against the pair by the coordinator).

        Args:
            stop: a policy string, an export folder or a rule's ``PolicySpec``.

        Returns:
            the policy's label.
        """
        key = _stop_key(stop)
        if key not in self._stops:
            # allow_draft_mismatch: the coordinator already checked this export against the pair's
            # draft and tokenizer, which this side does not know.
            self._stops[key] = load_stop_policy(stop, device=self.device, allow_draft_mismatch=True)
        return self._stops[key].label

    @torch.no_grad()
    def reset(self, prefix: list[int], decoding: DecodingConfig, seed: int, stop=None) -> float:
        """Start a sequence: a fresh cache holding ``prefix`` (the prompt but its last token).

        Args:
            prefix: the prompt's ids but the last.
            decoding: the decoding transform.
            seed: seeds this server's sampling generator.
            stop: the stopping policy that ends this sequence's draft windows early (see
                :meth:`load_stop`), or None.

        Returns:
            seconds spent (the prefill).
        """
        t0 = time.perf_counter()
        self.decoding = decoding
        self.stop = None
        if stop is not None:
            self.load_stop(stop)
            self.stop = self._stops[_stop_key(stop)]
            self.stop.configure(decoding, self.vocab_size)
            self.stop.start_sequence()
        self.lm = _LM(self.model, static_cache=False, max_len=0, compile=False)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(int(seed))
        if prefix:
            self.lm.feed(list(prefix), keep_logits=1)
        self._sync()
        return time.perf_counter() - t0

    @torch.no_grad()
    def draft(self, keep: int, feed: list[int], n: int, position: int = 0) -> tuple[list[int], torch.Tensor | None, float]:
        """Roll back to ``keep`` cached tokens, feed ``feed``, then draft up to ``n`` tokens (one window).

        Greedy drafts the argmax; sampling draws y_j ~ q_j with the server's generator. Drafting stops
        after an EOS, and early when the sequence's stopping policy says stop after y_j. The last
        drafted token is not fed (the next request feeds it if it is kept).

        Args:
            keep: cached tokens to keep.
            feed: tokens to feed after them (at least one).
            n: the window's budget.
            position: the 0-based response position of the first drafted token (the policy reads it).

        Returns:
            ``(tokens, q [k, V] or None under greedy, seconds)``; seconds include the policy's.
        """
        t0 = time.perf_counter()
        lm = self._rolled_back(keep)
        greedy = self.decoding.greedy
        stop = self.stop
        need_hidden = stop is not None and stop.needs_hidden
        layer = stop.hidden_layer if stop is not None else -1
        probs_for_stop = stop is not None and stop.reads_probs
        if stop is not None:
            stop.reset()
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        step = list(feed)
        for j in range(1, n + 1):
            logits, hidden = lm.feed(step, keep_logits=1, hidden=need_hidden, layer=layer)
            logits = logits[-1]
            if greedy:
                y = int(logits[: self.vocab_size].argmax())
                q = logits_to_probs(logits, self.decoding, self.vocab_size) if probs_for_stop else None
            else:
                q = logits_to_probs(logits, self.decoding, self.vocab_size)
                y = int(torch.multinomial(q.to(self.gen.device), 1, generator=self.gen))
                qs.append(q)
            tokens.append(y)
            if y in self.eos or j == n:
                break
            # hidden is the state that produced q_j (after y_{j-1}; at j = 1 after the window's last
            # fed token), as in the chain decoder: hidden heads score it as token j - 1, dist heads
            # with_state read it beside q_j.
            if stop is not None and stop.should_stop(logits, hidden, position=position + j - 1, draft_probs=q,
                                                     draft_token=y):
                break
            step = [y]
        rows = torch.stack(qs) if qs else None
        self._sync()
        return tokens, rows, time.perf_counter() - t0

    @torch.no_grad()
    def verify(self, keep: int, feed: list[int], rows: int) -> tuple[list[int], torch.Tensor | None, float]:
        """Roll back to ``keep`` cached tokens and feed ``feed`` in one forward.

        Args:
            keep: cached tokens to keep.
            feed: tokens to feed after them (at least ``rows``).
            rows: how many of the last positions' distributions to return.

        Returns:
            ``(argmax ids [rows], p [rows, V] or None under greedy, seconds)``: row i is the
            distribution of the token after ``feed[len(feed) - rows + i]``.
        """
        t0 = time.perf_counter()
        lm = self._rolled_back(keep)
        logits = lm.feed(list(feed), keep_logits=rows)[0]
        ids = logits[:, : self.vocab_size].argmax(-1).tolist()
        probs = None if self.decoding.greedy else logits_to_probs(logits, self.decoding, self.vocab_size)
        self._sync()
        return ids, probs, time.perf_counter() - t0

    @torch.no_grad()
    def step_seconds(self, context: int, tokens: int, reps: int) -> float:
        """Median seconds of one forward over ``tokens`` tokens after ``context`` cached ones, on a
        scratch cache (the decoding cache is untouched). Token ids are arbitrary: cost does not
        depend on them."""
        lm = _LM(self.model, static_cache=False, max_len=0, compile=False)
        ids = [i % self.vocab_size for i in range(context + tokens)]
        lm.feed(ids[:context], keep_logits=1)
        times = []
        for i in range(reps + 1):  # the first call warms up
            self._sync()
            t0 = time.perf_counter()
            lm.feed(ids[context:], keep_logits=tokens)
            self._sync()
            if i:
                times.append(time.perf_counter() - t0)
            lm.rollback(context)
        return statistics.median(times)

    # ------------------------------------------------------------------ helpers
    def _rolled_back(self, keep: int) -> _LM:
        if self.lm is None:
            raise RuntimeError("request before reset(): start a sequence first")
        if keep > self.lm.length:
            raise RuntimeError(f"cannot keep {keep} cached tokens, the cache holds {self.lm.length}")
        self.lm.rollback(keep)
        return self.lm
