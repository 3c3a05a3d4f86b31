"""PEARL (Liu et al., "Parallel Speculative Decoding with Adaptive Draft Length", Algorithms 1-2):
the draft and the target run at the same time, each in its own worker
(:mod:`specstop.decode.pearl_workers`), and this coordinator switches between two kinds of phase.
Each phase submits one request to each busy worker and waits for both.

* **pre-verify** at prefix x (s tokens emitted): the draft drafts g = min(gamma, remaining - 1)
  tokens y_1..y_g after x while the target runs one pass over x, giving p(. | x), which verifies
  y_1 alone. Rejected: emit the target's token (greedy: its argmax; sampling: a draw from
  norm(max(p - q, 0))) and stay in pre-verify; y_2..y_g are dropped. Accepted: emit y_1 and go to
  post-verify with the block y_2..y_g.
* **post-verify** with an unverified block b_1..b_m after x: the target runs one pass over the
  block (and the last token of x), giving m + 1 rows, while the draft - assuming the whole block is
  accepted - drafts the next window z_1..z_h, h = min(gamma, remaining after the block - 1).
  Row i verifies b_i, row m verifies z_1. All accepted: emit the block and z_1, stay in
  post-verify with the block z_2..z_h. Otherwise emit the accepted part plus the target's token
  at the first rejection (residual) - or, with no z drafted, a sample from row m - and return to
  pre-verify; the parallel drafts are dropped.

This is the round model of :mod:`specstop.eval.pearl` (which prices the same phases) and of the
authors' code. Acceptance is the chain decoder's: greedy keeps a token equal to the target's
argmax (the output is the target's greedy output); sampling accepts y with probability
min(1, p(y)/q(y)) with q the distribution y was drawn from, and resamples from the residual on
rejection, so every emitted token is distributed as the target's p. Emitting EOS ends the response;
drafting stops after a drafted EOS.

With a stopping policy (``PearlSpec(stop=...)``: ``confidence:TAU``, ``static:K``, an export folder),
every window - a pre-verify draft, a post-verify parallel draft, a draft-only phase - is drafted
token by token until its budget is used or the policy says stop; the rest of the budget is not
drafted and the target verifies what was. The policy runs in the draft's worker, asked after each
token with the chain decoder's inputs (q_j, the draft's hidden state, y_j's response position); it
only decides how many tokens are proposed, never whether one is accepted, so the output is unchanged
(greedy) or still distributed as the target's (sampling).

The adaptive draft length is the effect of the two strategies: a block keeps growing by gamma per
phase while everything is accepted, and costs a single target pass when its first token fails.
Ablations (the paper's Table 3): without pre-verify, a phase from a fresh prefix is a plain drafting
phase (the target idles) and the block is then verified whole; without post-verify, the draft idles
while the target verifies, and every verification ends in pre-verify.

Counters follow the chain decoder: ``N`` emitted tokens, ``N_target`` target passes (prompt
prefill excluded), ``N_draft`` drafted tokens (parallel drafts that were dropped included),
``N_discarded`` drafted tokens not emitted, ``rounds`` phases (``pre_verify_phases``,
``post_verify_phases``, ``draft_only_phases``, ``target_only_phases``). Per phase,
``round_lengths`` is the number of drafted tokens the target checked and ``accepted_per_round``
how many it accepted. Timings: ``prefill`` (both models in parallel), ``draft`` and ``target``
(each worker's own busy seconds; they overlap), ``accept`` (verification in the coordinator),
``sync`` (phase wall time beyond the busier worker: transport and waiting), ``total``, and
``round_seconds`` (each phase's wall time), plus ``draft_idle`` / ``target_idle``. With a stopping
policy, ``stopped_windows`` counts the windows it ended before their budget (``draft`` includes its
time).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from specstop.decode.chain import DecodeResult, eos_token_ids
from specstop.decode.pearl_server import load_stop_policy
from specstop.decode.pearl_spec import PearlSpec
from specstop.decode.pearl_workers import PearlWorkers
from specstop.pair.context import check_request, check_seed
from specstop.probs import DecodingConfig, accept_probability, residual_distribution

__all__ = ["PearlDecoder", "measured_gamma"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def measured_gamma(workers: PearlWorkers, context: int = 64, reps: int = 5) -> tuple[int, str]:
    """PEARL's window round(t_target / t_draft) from one-token steps timed in the workers, each on its
    own cores, one model at a time. Returns ``(gamma, one line saying how it was found)``."""
    workers.start()
    times = {}
    for w in (workers.draft, workers.target):
        w.submit("step_seconds", context, 1, reps)
        times[w.name] = w.result()
    gamma = max(1, int(round(times["target"] / max(times["draft"], 1e-9))))
    line = (f"PEARL window gamma={gamma} from a quick measurement on the workers' cores: target step "
            f"{times['target'] * 1e3:.1f} ms / draft step {times['draft'] * 1e3:.1f} ms")
    return gamma, line


class _Mirror:
    """What one worker's KV cache holds, so each request can say how much of it to keep."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def plan(self, full: list[int], min_feed: int) -> tuple[int, list[int]]:
        """``(keep, feed)`` so that the cache ends up holding ``full`` with ``min_feed`` tokens fed."""
        keep = min(_common_prefix(self.tokens, full), len(full) - min_feed)
        return keep, full[keep:]


class PearlDecoder:
    """PEARL decoding of one prompt at a time with the draft and the target running in parallel.

    Use it as a context manager (or call :meth:`close`): the workers start on the first
    :meth:`generate` and stay up for the next prompts.

    Args:
        pair: the draft/target :class:`~specstop.pair.ModelPair`.
        spec: window and strategies (:class:`~specstop.decode.pearl_spec.PearlSpec`); a spec without
            gamma gets one from :func:`measured_gamma` when the workers start.
        decoding: the decoding transform for both models (temperature 0 = greedy).
        workers: a running :class:`PearlWorkers` to share (not closed by this decoder); default: own
            workers built from ``cores`` and ``backend``.
        cores: ``(draft cores, target cores)`` for the process workers.
        backend: ``auto`` | ``processes`` | ``threads`` (see :class:`PearlWorkers`).
        allow_draft_mismatch: load a ``spec.stop`` export made for another draft or tokenizer.

    Raises:
        UserError: a ``spec.stop`` that is malformed, a heuristic schedule, or an export made for
            another draft (checked here, before any worker starts).
    """

    def __init__(
        self,
        pair,
        spec: PearlSpec | None = None,
        decoding: DecodingConfig | None = None,
        *,
        workers: PearlWorkers | None = None,
        cores: tuple[list[int], list[int]] | None = None,
        backend: str = "auto",
        allow_draft_mismatch: bool = False,
    ) -> None:
        self.pair = pair
        self.spec = spec or PearlSpec()
        self.decoding = decoding or DecodingConfig()
        self.stop_policy = None
        self._stop_arg = None  # what the draft's worker loads the stopping policy from
        self._stop_loaded_by = None  # the draft worker that has loaded it (a restarted one has not)
        if self.spec.stop is not None:
            self._set_stop(self.spec.stop, allow_draft_mismatch)
        self.vocab_size = pair.vocab_size
        self.eos = eos_token_ids(pair)
        self.owns_workers = workers is None
        self.workers = workers if workers is not None else PearlWorkers(pair, cores, backend)
        self.gamma_source = "given" if self.spec.gamma is not None else None

    def _set_stop(self, stop, allow_draft_mismatch: bool) -> None:
        """Check the stopping policy against the pair here; the draft's worker loads it again from
        ``self._stop_arg`` (an absolute folder path, the policy text or the rule's spec)."""
        identity = getattr(self.pair, "draft_identity", None)  # None for hand-built pairs: nothing to check
        self.stop_policy = load_stop_policy(
            stop, draft_identity=identity, tokenizer_hash=getattr(self.pair, "tokenizer_hash", None),
            allow_draft_mismatch=allow_draft_mismatch, hidden_size=getattr(identity, "hidden_size", None),
        )
        is_folder = isinstance(stop, (str, Path)) and Path(stop).is_dir()
        self._stop_arg = str(Path(stop).resolve()) if is_folder else (str(stop) if isinstance(stop, Path) else stop)
        # The label names the entry the draft's worker runs (it configures its own copy the same way).
        self.stop_policy.configure(self.decoding, getattr(self.pair, "vocab_size", None))
        self.stop_policy.warn_temperature_mismatch(self.decoding, "PEARL's stop")

    @property
    def label(self) -> str:
        if self.stop_policy is None:
            return self.spec.label
        # The loaded policy's name (an export's tuned name) rather than the folder path given.
        bare = self.spec.with_stop(None).label
        head, _, ablations = bare.partition(" ")
        return f"{head}+{self.stop_policy.label}" + (f" {ablations}" if ablations else "")

    def start(self) -> PearlDecoder:
        """Start the workers, settle gamma and load the stopping policy in the draft's worker (idempotent)."""
        try:
            self.workers.start()
            if self.spec.gamma is None:
                gamma, self.gamma_source = measured_gamma(self.workers)
                self.spec = self.spec.with_gamma(gamma)
            if not self.decoding.greedy:
                self.workers.ensure_rows(self.spec.gamma + 1)
            if self._stop_arg is not None and self._stop_loaded_by is not self.workers.draft:
                # Loaded now (once per worker), so no prompt's decoding pays for it.
                self.workers.draft.submit("load_stop", self._stop_arg)
                self.workers.draft.result()
                self._stop_loaded_by = self.workers.draft
        except BaseException:
            self.workers.close()
            raise
        return self

    def close(self) -> None:
        if self.owns_workers:
            self.workers.close()

    def __enter__(self) -> PearlDecoder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ acceptance
    def _check(self, tokens: list[int], ids: list[int], p: torch.Tensor | None, q: list[torch.Tensor],
               gen: torch.Generator | None, bonus: bool) -> tuple[int, int | None]:
        """Verify ``tokens`` against the target rows (row i checks tokens[i]).

        Returns:
            ``(n accepted, the target's token)``: the correction at the first rejection, else the bonus
            from row n when ``bonus``, else None.
        """
        n = 0
        if self.decoding.greedy:
            while n < len(tokens) and tokens[n] == ids[n]:
                n += 1
            return n, (ids[n] if n < len(tokens) or bonus else None)
        while n < len(tokens):
            acc = accept_probability(p[n], q[n], torch.tensor(tokens[n]))
            if not bool(torch.rand((), generator=gen) < acc):
                dist = residual_distribution(p[n], q[n])
                return n, int(torch.multinomial(dist, 1, generator=gen))
            n += 1
        return n, (int(torch.multinomial(p[n], 1, generator=gen)) if bonus else None)

    # ------------------------------------------------------------------ main loop
    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None, *, max_draft: int | None = None
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (batch size 1).

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty).
            max_new_tokens: length cap; the response never exceeds it.
            seed: seeds the draft's samples (in its worker), the acceptance uniforms and the
                target's samples (sampling only).
            max_draft: cap the window at this many tokens; 0 is plain target decoding through the
                same workers (the baseline benchmarks compare against).

        Raises:
            WorkerError: a worker failed or died; both workers are shut down (the next call restarts
                them). A KeyboardInterrupt shuts them down as well.
        """
        prompt_ids = check_request(self.pair, prompt_ids, max_new_tokens)
        seed = check_seed(seed)
        try:
            self.start()
            return self._generate(list(prompt_ids), max_new_tokens, seed, max_draft)
        except BaseException:
            # A worker error, Ctrl-C or a bug: never leave processes or shared files behind.
            self.workers.close()
            raise

    def _generate(self, prompt: list[int], max_new: int, seed: int | None, max_draft: int | None) -> DecodeResult:
        greedy = self.decoding.greedy
        gamma = self.spec.gamma if max_draft is None else min(self.spec.gamma, max_draft)
        pre_verify, post_verify = self.spec.pre_verify, self.spec.post_verify
        draft, target = self.workers.draft, self.workers.target
        seed = 0 if seed is None else int(seed)
        gen = None if greedy else torch.Generator().manual_seed(seed)

        t_start = time.perf_counter()
        prefix = prompt[:-1]  # the last prompt token is fed with the first phase
        draft.submit("reset", prefix, self.decoding, seed + 1, self._stop_arg)
        target.submit("reset", prefix, self.decoding, seed + 2)
        prefill = max(draft.result(), target.result())
        prefill_wall = time.perf_counter() - t_start
        mirror_d, mirror_t = _Mirror(prefix), _Mirror(prefix)

        out: list[int] = []
        mode = "pre"
        block: list[int] = []  # unverified drafted tokens after prompt + out (post-verify)
        block_q: list[torch.Tensor] = []
        counts = dict.fromkeys(("pre_verify_phases", "post_verify_phases", "draft_only_phases", "target_only_phases"), 0)
        rounds_k: list[int] = []
        rounds_n: list[int] = []
        round_seconds: list[float] = []
        busy = {"draft": 0.0, "target": 0.0, "accept": 0.0, "sync": 0.0, "draft_idle": 0.0, "target_idle": 0.0}
        n_target = n_draft = stopped_windows = 0
        stop_reason = "length"

        while len(out) < max_new:
            seq = prompt + out
            s = len(out)
            t_phase = time.perf_counter()
            d_req = t_req = None
            if mode == "pre":
                g = min(gamma, max_new - s - 1)
                if g > 0:
                    d_req = (seq, g, s)  # (sequence, window budget, response position of its first token)
                if g <= 0 or pre_verify:
                    t_req = (seq, 1)
                kind = "pre_verify_phases" if d_req and t_req else ("draft_only_phases" if d_req else "target_only_phases")
            else:
                full = seq + block
                # The next window, drafted while the target verifies (post-verify), assuming all of the
                # block is accepted; none after a drafted EOS or past the length cap.
                h = 0 if (block and block[-1] in self.eos) or not post_verify else min(gamma, max_new - (s + len(block)) - 1)
                if h > 0:
                    d_req = (full, h, s + len(block))
                t_req = (full, len(block) + 1)
                kind = "post_verify_phases"
            counts[kind] += 1

            # ---- both workers at once
            if d_req:
                keep, feed = mirror_d.plan(d_req[0], 1)
                draft.submit("draft", keep, feed, d_req[1], d_req[2])
            if t_req:
                t_keep, t_feed = mirror_t.plan(t_req[0], t_req[1])
                target.submit("verify", t_keep, t_feed, t_req[1])
            drafted, dq, d_sec = draft.result() if d_req else ([], None, 0.0)
            ids, p, t_sec = target.result() if t_req else ([], None, 0.0)
            t_done = time.perf_counter()
            if d_req:
                mirror_d.tokens = d_req[0] + drafted[:-1]  # the last drafted token is never fed
                n_draft += len(drafted)
                # Short of its budget without an EOS: the stopping policy ended the window.
                stopped_windows += len(drafted) < d_req[1] and drafted[-1] not in self.eos
            if t_req:
                mirror_t.tokens = list(t_req[0])
                n_target += 1
            q_rows = list(dq) if dq is not None else [None] * len(drafted)

            # ---- decide
            emitted: list[int] = []
            if mode == "pre" and not t_req:  # draft-only phase (no pre-verify): verify it all next phase
                block, block_q, mode = drafted, q_rows, "post"
                checked = accepted = 0
            elif mode == "pre" and not d_req:  # a single target step: no room left for a draft
                _, tok = self._check([], ids, p, [], gen, bonus=True)
                emitted, checked, accepted = [tok], 0, 0
            elif mode == "pre":
                n, tok = self._check(drafted[:1], ids, p, q_rows[:1], gen, bonus=False)
                checked, accepted = 1, n
                if n:
                    emitted = drafted[:1]
                    block, block_q, mode = drafted[1:], q_rows[1:], "post"
                else:
                    emitted = [tok]
            else:
                tokens = block + drafted[:1]
                n, tok = self._check(tokens, ids, p, block_q + q_rows[:1], gen, bonus=not drafted)
                checked, accepted = len(tokens), n
                if drafted and n == len(tokens):
                    emitted = tokens
                    block, block_q = drafted[1:], q_rows[1:]
                else:
                    emitted = tokens[:n] + [tok]
                    block, block_q, mode = [], [], "pre"
            t_accept = time.perf_counter()

            for i, t in enumerate(emitted):
                if t in self.eos:
                    emitted = emitted[: i + 1]
                    stop_reason = "eos"
                    break
            out.extend(emitted)
            if mode == "pre":
                block, block_q = [], []
            rounds_k.append(checked)
            rounds_n.append(accepted)
            busy["draft"] += d_sec
            busy["target"] += t_sec
            busy["accept"] += t_accept - t_done
            wall = t_done - t_phase
            busy["sync"] += max(0.0, wall - max(d_sec, t_sec))
            busy["draft_idle"] += max(0.0, wall - d_sec)
            busy["target_idle"] += max(0.0, wall - t_sec)
            round_seconds.append(t_accept - t_phase)
            if stop_reason == "eos":
                break

        total = time.perf_counter() - t_start
        accepted_total = sum(rounds_n)
        counters: dict[str, Any] = {
            "N": len(out),
            "N_target": n_target,
            "N_draft": n_draft,
            "N_discarded": n_draft - accepted_total,
            "rounds": len(rounds_k),
            **counts,
            "stop_reason": stop_reason,
            "policy": self.label if max_draft is None else f"{self.label} (max_draft={max_draft})",
            "gamma": gamma,
            "stopped_windows": stopped_windows,
            "batch_size": 1,
            "workers": self.workers.describe(),
        }
        timings: dict[str, Any] = {"prefill": prefill_wall, "prefill_busy": prefill, **busy, "total": total,
                                   "round_seconds": round_seconds}
        text = self.pair.tokenizer.decode(out, skip_special_tokens=True)
        return DecodeResult(out, text, counters, rounds_k, rounds_n, timings)
