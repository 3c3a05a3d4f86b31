"""Drive Hugging Face assisted generation (``target.generate(assistant_model=draft)``) with a StoppingPolicy.

The public entry point is transformers' own ``custom_generate``: every export folder (and Hub repo)
holds ``custom_generate/generate.py``, so::

    target.generate(**inputs, assistant_model=draft, custom_generate=EXPORT_DIR_OR_REPO,
                    trust_remote_code=True, max_new_tokens=128)

runs :func:`generate_with_policy` with that export's policy. :func:`use_policy` and
:func:`assisted_generate` remain for callers that hold a :class:`StoppingPolicy` object.

Stopping criteria passed to ``generate()`` reach only the target loop, and the stock
``AssistedCandidateGenerator`` drafts through ``assistant.generate``, which exposes neither the
per-step hidden state nor a per-step hook. So :class:`PolicyCandidateGenerator` subclasses
``AssistedCandidateGenerator`` and drafts with its own loop over the assistant's forward (one
forward per drafted token, KV cache kept across rounds and cropped to the accepted prefix). That
forward returns q_j and, with ``output_hidden_states=True``, the final hidden state of y_{j-1}, so
SpecDec++ / MCSD hidden heads get their input without a second draft forward. Verification,
acceptance, speculative sampling and EOS handling stay HF's own.

Injection: :func:`use_policy` temporarily replaces the target's ``_get_candidate_generator``
(the method ``_assisted_decoding`` calls to build its candidate generator) on that model instance;
:func:`assisted_generate` wraps ``target.generate`` in it.

Supported transformers versions: 5.x (tested with 5.23 and 5.24). The hook relies on
``GenerationMixin._get_candidate_generator(generation_config, input_ids, inputs_tensor,
logits_processor, model_kwargs, assistant_model, target_tokenizer, assistant_tokenizer)`` and the
``AssistedCandidateGenerator`` attributes ``main_model_max_length``, ``logits_processor``,
``generation_config``; both exist since 4.45 but 4.x is not tested (``DynamicCache.crop`` took a
positive length there). Same-tokenizer pairs and decoder-only models only; batch size 1 (as HF's
assisted generation itself).
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from specstop.errors import UserError
from specstop.export.runtime import DraftMismatchError, StoppingPolicy, check_policy_inputs, identity_matches
from specstop.pair.compat import cache_kwarg
from specstop.pair.fast_paths import contiguous_output_head
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = [
    "PolicyCandidateGenerator", "assistant_identity", "assisted_generate", "check_assistant",
    "decoding_from_generation_config", "generate_with_policy", "use_policy",
]


def decoding_from_generation_config(generation_config) -> DecodingConfig:
    """The specstop decoding transform equivalent to a generation config (greedy unless do_sample).

    Raises:
        UserError: a value the one rule for a decoding setting refuses (``top_k=2.5``, ``temperature="hot"``:
            transformers accepts both), naming it, rather than a truncated top-k or a raw ValueError.
    """
    if not generation_config.do_sample:
        return DecodingConfig()
    g = generation_config
    return DecodingConfig.from_generation(
        {"temperature": g.temperature or 1.0, "top_k": g.top_k or 0, "top_p": g.top_p or 1.0}, "generation_config"
    )


class PolicyCandidateGenerator(AssistedCandidateGenerator):
    """Candidate generator whose draft length is decided by a :class:`StoppingPolicy`.

    Args (beyond ``AssistedCandidateGenerator``'s):
        policy: the stopping policy (reset per round, ``end_round`` after verification).
        vocab_size: the shared tokenizer vocabulary (features use logits sliced to it).
    """

    def __init__(self, *args, policy: StoppingPolicy, vocab_size: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from transformers import DynamicCache, LogitsProcessorList

        # The parent filters the processors into a plain list; make it callable again.
        self.logits_processor = LogitsProcessorList(self.logits_processor)
        self.policy = policy
        self.policy.start_sequence()  # HF builds one candidate generator per generate() call
        # Our drafting loop keeps one logit row of a multi-token catch-up feed; without this a CPU
        # copies the whole output head per call (see specstop.pair.fast_paths). Exact: same logits.
        contiguous_output_head(self.assistant_model)
        self.policy.configure(decoding_from_generation_config(self.generation_config), vocab_size)
        self.do_sample = bool(self.generation_config.do_sample)
        eos = self.generation_config.eos_token_id
        self.eos = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
        self.cache = DynamicCache(config=self.assistant_model.config)
        self.cached: list[int] = []  # token ids whose keys/values the draft cache holds
        self.last_k = 0
        self.round_lengths: list[int] = []
        self.timings = {"draft": 0.0, "predictor": 0.0}

    def _rollback(self, seq: list[int]) -> None:
        # Keep the longest cached prefix that is still part of the sequence, and leave >= 1 token to feed.
        common = 0
        for a, b in zip(self.cached, seq):
            if a != b:
                break
            common += 1
        keep = min(common, len(seq) - 1)
        if keep < len(self.cached):
            self.cache.crop(keep - len(self.cached))  # transformers 5: negative = tokens to remove
            self.cached = self.cached[:keep]

    @torch.no_grad()
    def _forward(self, tokens: list[int], hidden: bool):
        device = self.assistant_model.device
        start = len(self.cached)
        pos = torch.arange(start, start + len(tokens), device=device)
        out = self.assistant_model(
            input_ids=torch.tensor([tokens], device=device),
            **cache_kwarg(self.assistant_model, self.cache),
            use_cache=True,
            cache_position=pos,
            position_ids=pos.unsqueeze(0),
            output_hidden_states=hidden,
            logits_to_keep=1,
        )
        self.cached.extend(tokens)
        h = out.hidden_states[self.policy.hidden_layer][0, -1] if hidden else None
        return out.logits[0, -1].float(), h

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """``input_ids [1, L]`` -> ``(candidates [1, L + K], candidate_logits [1, K, V_model] | None)``."""
        input_ids = input_ids.to(self.assistant_model.device)
        if input_ids.shape[0] != 1:
            raise UserError("policy-driven assisted generation supports batch size 1 only (as HF assisted generation)")
        cur_len = input_ids.shape[-1]
        k_cap = min(self.policy.cap(), self.main_model_max_length - cur_len - 1)
        self.last_k = 0
        if k_cap <= 0:
            return input_ids, None
        seq = input_ids[0].tolist()
        self._rollback(seq)
        policy = self.policy
        policy.reset()
        response_start = int(getattr(self, "_prompt_len", cur_len))
        need_hidden = policy.needs_hidden
        drafted: list[int] = []
        scores: list[torch.Tensor] = []
        running = input_ids
        feed = seq[len(self.cached) :]
        for j in range(1, k_cap + 1):
            t0 = time.perf_counter()
            raw, hidden = self._forward(feed, need_hidden)
            # HF's processors (temperature/top-k/top-p/suppression) act on the draft logits too: the
            # candidate logits must be the distribution the token was drawn from (HF samples q from them).
            proc = self.logits_processor(running, raw.unsqueeze(0))[0] if self.logits_processor else raw
            if self.do_sample:
                y = int(torch.multinomial(torch.softmax(proc, -1), 1))
            else:
                y = int(proc.argmax(-1))
            t1 = time.perf_counter()
            self.timings["draft"] += t1 - t0
            q = logits_to_probs(raw, policy.decoding, policy.vocab_size) if policy.reads_probs else None
            stop = policy.should_stop(raw, hidden, position=cur_len - response_start + j - 1, draft_probs=q,
                                      draft_token=y)
            self.timings["predictor"] += time.perf_counter() - t1
            drafted.append(y)
            scores.append(proc)
            running = torch.cat([running, running.new_tensor([[y]])], dim=-1)
            if stop or j == k_cap or y in self.eos:
                break
            feed = [y]
        self.last_k = len(drafted)
        self.round_lengths.append(self.last_k)
        return running, torch.stack(scores).unsqueeze(0)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        # HF's schedules and its online confidence re-tuning are replaced by the policy's own rule.
        self.policy.end_round(self.last_k, int(num_matches))


@contextmanager
def use_policy(target, policy: StoppingPolicy, vocab_size: int | None = None, *,
               allow_draft_mismatch: bool = False) -> Iterator[dict]:
    """Within the block, ``target.generate(..., assistant_model=draft)`` drafts with ``policy``.

    The first ``generate`` call checks that ``assistant_model`` is the draft the policy was exported
    for (:func:`check_assistant`), as the runtime does; ``allow_draft_mismatch=True`` skips that.
    Yields a dict that receives the candidate generator (``"generator"``) for counters/timings.
    """
    info: dict = {}
    checked: set[int] = set()  # drafts already checked in this block (fingerprinting reads weights)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if assistant_model is None or (target_tokenizer is not None and assistant_tokenizer is not None):
            raise UserError("specstop policies drive assisted generation with a same-tokenizer assistant_model only")
        if id(assistant_model) not in checked:
            check_assistant(policy, assistant_model, allow_draft_mismatch=allow_draft_mismatch)
            checked.add(id(assistant_model))
        gen = PolicyCandidateGenerator(
            input_ids=input_ids,
            assistant_model=assistant_model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            policy=policy,
            vocab_size=vocab_size,
        )
        gen._prompt_len = input_ids.shape[-1]
        info["generator"] = gen
        return gen

    with candidate_generator_replaced(target, lambda _original: _get_candidate_generator):
        yield info


@contextmanager
def candidate_generator_replaced(target, make) -> Iterator[None]:
    """Within the block, ``target._get_candidate_generator`` is ``make(original)`` bound to ``target``.

    ``original`` is the factory in effect before (an earlier replacement on the instance, or
    transformers' own method), so replacements nest; on exit the instance is as it was.
    """
    had = "_get_candidate_generator" in vars(target)
    old = vars(target).get("_get_candidate_generator")
    original = target._get_candidate_generator  # bound: the instance's replacement or the class method
    target._get_candidate_generator = types.MethodType(make(original), target)
    try:
        yield
    finally:
        if had:
            target._get_candidate_generator = old
        else:
            del target._get_candidate_generator


def assisted_generate(target, draft, policy: StoppingPolicy, input_ids: torch.Tensor, *, vocab_size: int | None = None,
                      allow_draft_mismatch: bool = False, **generate_kwargs):
    """``target.generate(input_ids, assistant_model=draft, **generate_kwargs)`` with ``policy`` deciding
    the draft lengths. Returns what ``generate`` returns."""
    with use_policy(target, policy, vocab_size=vocab_size, allow_draft_mismatch=allow_draft_mismatch):
        return target.generate(input_ids, assistant_model=draft, **generate_kwargs)


def generate_with_policy(model, *args, policy, assistant_model=None, vocab_size: int | None = None,
                         allow_draft_mismatch: bool = False, **generate_kwargs):
    """The body of an export's ``custom_generate/generate.py``: assisted generation driven by ``policy``.

    Args:
        model: the target model (transformers passes it as ``model``).
        policy: a :class:`StoppingPolicy`, an export folder or a hub id.
        assistant_model: the draft model the policy was trained for (required).
        vocab_size: the shared tokenizer vocabulary (default: the one the export records).
        allow_draft_mismatch: load a policy recorded for another draft (its decisions are then
            meaningless; see ``StoppingPolicy.from_pretrained``).
        generate_kwargs: everything else ``generate`` was called with.

    Returns:
        What ``model.generate`` returns.
    """
    if assistant_model is None:
        raise UserError(
            "a specstop stopping policy drives assisted generation: pass the draft model it was trained for as "
            "assistant_model=... together with custom_generate=..."
        )
    if not isinstance(policy, StoppingPolicy):
        # The draft check runs once, in use_policy, for folders and loaded policies alike.
        policy = StoppingPolicy.from_pretrained(policy, device=assistant_model.device)
    with use_policy(model, policy, vocab_size=vocab_size or policy.vocab_size, allow_draft_mismatch=allow_draft_mismatch):
        return model.generate(*args, assistant_model=assistant_model, **generate_kwargs)


#: What identifies a draft on the HF path: not its name (a hub id and a local copy of it are the
#: same model), but its architecture, sizes and weights fingerprint - the fields the runtime's
#: ``identity_matches`` compares.
_IDENTITY_KEYS = ("architecture", "hidden_size", "num_hidden_layers", "num_parameters", "weights_sha256")


def assistant_identity(model) -> dict:
    """The identity of an ``assistant_model`` that an export's recorded draft is compared with.

    The weights fingerprint is the one ``specstop`` records for a pair loaded from files: of the
    model's weight files when ``model.name_or_path`` is a local folder or a cached hub id (the way
    ``from_pretrained`` loads), else of its tensors in memory. Each kind is only compared with its
    own kind (:func:`specstop.export.runtime.identity_matches`).
    """
    from specstop.pair.loader import model_identity
    from specstop.pair.sources import weights_folder

    name = str(getattr(model, "name_or_path", "") or "")
    folder = weights_folder(name) if name else None
    ident = model_identity(model, "", weights_path=folder).to_dict()
    return {k: ident[k] for k in _IDENTITY_KEYS}


def check_assistant(policy: StoppingPolicy, assistant_model, *, allow_draft_mismatch: bool = False) -> None:
    """Refuse an ``assistant_model`` other than the draft the policy's export records.

    The same comparison as ``StoppingPolicy.from_pretrained(draft_identity=...)`` (architecture,
    sizes, and the weights fingerprint, which catches a same-shaped draft with other weights).
    Policies without a recorded pair (``static:4``, ``confidence:0.4``) accept any draft.

    Raises:
        DraftMismatchError: another draft, unless ``allow_draft_mismatch``.
        UserError: a predictor that reads hidden states of another width (even with
            ``allow_draft_mismatch``: that cannot run).
    """
    pair = (policy.config or {}).get("pair") or {}
    if pair.get("draft") and not allow_draft_mismatch:
        ok, why = identity_matches({"draft": assistant_identity(assistant_model)}, pair)
        if not ok:
            raise DraftMismatchError(
                f"assistant_model is not the draft this policy was exported for ({why}); pass that draft as "
                "assistant_model=..., or allow_draft_mismatch=True to run the policy on this one anyway"
            )
    text_cfg = assistant_model.config.get_text_config() if hasattr(assistant_model.config, "get_text_config") \
        else assistant_model.config
    check_policy_inputs(policy, getattr(text_cfg, "hidden_size", None), "the policy")
