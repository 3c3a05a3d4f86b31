"""One PEARL model's side of the work: its KV cache, drafting and verification (no transport).

A :class:`ModelServer` owns one model and one KV cache (the chain decoder's cached-model wrapper).
Every request names the cache length to keep (the coordinator mirrors what each cache holds and
rolls back rejected tokens this way) and the tokens to feed after it. The worker that hosts the
server (a pinned process or a thread, :mod:`specstop.decode.pearl_workers`) only moves requests and
results; the same server runs in both.

Results are small: token ids (greedy: the draft's picks, the target's argmax per row) and, when
sampling, probability rows ``[k, V]`` (float32, after the decoding transform).
"""

from __future__ import annotations

import statistics
import time

import torch

from specstop.export.decoder import _LM
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = ["ModelServer"]


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

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ requests
    @torch.no_grad()
    def reset(self, prefix: list[int], decoding: DecodingConfig, seed: int) -> float:
        """Start a sequence: a fresh cache holding ``prefix`` (the prompt but its last token).

        Returns:
            seconds spent (the prefill).
        """
        t0 = time.perf_counter()
        self.decoding = decoding
        self.lm = _LM(self.model, static_cache=False, max_len=0, compile=False)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(int(seed))
        if prefix:
            self.lm.feed(list(prefix), keep_logits=1)
        self._sync()
        return time.perf_counter() - t0

    @torch.no_grad()
    def draft(self, keep: int, feed: list[int], n: int) -> tuple[list[int], torch.Tensor | None, float]:
        """Roll back to ``keep`` cached tokens, feed ``feed``, then draft up to ``n`` tokens.

        Greedy drafts the argmax; sampling draws y_j ~ q_j with the server's generator. Drafting stops
        after an EOS. The last drafted token is not fed (the next request feeds it if it is kept).

        Returns:
            ``(tokens, q [k, V] or None under greedy, seconds)``.
        """
        t0 = time.perf_counter()
        lm = self._rolled_back(keep)
        greedy = self.decoding.greedy
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        step = list(feed)
        for _ in range(n):
            logits = lm.feed(step, keep_logits=1)[0][-1]
            if greedy:
                y = int(logits[: self.vocab_size].argmax())
            else:
                q = logits_to_probs(logits, self.decoding, self.vocab_size)
                y = int(torch.multinomial(q.to(self.gen.device), 1, generator=self.gen))
                qs.append(q)
            tokens.append(y)
            if y in self.eos:
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
