"""Tuned draft-length settings for Hugging Face assisted generation that take effect, and a read-back check.

transformers 5.x reads the assisted-generation knobs from the *draft model's* generation config,
not from ``generate()`` keyword arguments. ``AssistedCandidateGenerator.__init__``
(transformers/generation/candidate_generator.py) deep-copies ``assistant_model.generation_config``
and takes ``num_assistant_tokens`` and ``assistant_confidence_threshold`` from that copy; it then
overwrites the threshold of the per-call generation config (which is where ``generate()`` kwargs
land) with the draft's value, and ``update_candidate_strategy`` reads
``num_assistant_tokens_schedule`` from the same copy. Passing the three as ``generate()`` kwargs
therefore leaves the draft's defaults in charge (20 tokens per round, threshold 0.4).

Set on the draft, the threshold is still not the tuned one: whenever scikit-learn is installed,
``update_candidate_strategy`` re-fits it after every round from an ROC curve of the draft's token
probabilities against acceptance. transformers has no generation-config field that turns this
off; the re-fit (and the probability bookkeeping that feeds it) runs only when
``type(self) is AssistedCandidateGenerator``. :class:`TunedAssistedCandidateGenerator` is a
subclass that changes nothing else, so HF's drafting, confidence stop, schedules, verification
and sampling run unchanged with the tuned threshold held fixed. :func:`tuned_assisted_generation`
injects it the way :mod:`specstop.decode.hf_assist` injects its policy generator (by replacing
``_get_candidate_generator`` on the target instance for the duration of a block).

Usage::

    from specstop import generate_with_settings, load_hf_settings
    settings = load_hf_settings("engines/hf.json")                  # the recommended rule-based option
    out = generate_with_settings(target, draft, settings, **inputs, max_new_tokens=128)

    from specstop import read_back_hf_settings
    report = read_back_hf_settings(target, draft, input_ids, settings, max_new_tokens=64)
    assert report["ok"], report["problems"]                           # what generate() actually used
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from transformers.generation.candidate_generator import AssistedCandidateGenerator

from specstop.decode.hf_assist import candidate_generator_replaced
from specstop.errors import UserError
from specstop.export.hf_format import (
    HF_SETTING_KEYS,
    check_hf_settings,
    hf_settings_from_spec,
    load_hf_settings,
)

__all__ = [
    "HF_SETTING_KEYS",
    "TunedAssistedCandidateGenerator",
    "apply_hf_settings",
    "check_hf_settings",
    "generate_with_settings",
    "hf_settings_from_spec",
    "load_hf_settings",
    "observe_assisted_generation",
    "read_back_hf_settings",
    "tuned_assisted_generation",
]

def apply_hf_settings(draft_model, settings: dict) -> dict:
    """Set the tuned draft-length settings on ``draft_model.generation_config`` (where transformers reads them).

    Args:
        draft_model: the model passed as ``assistant_model=``.
        settings: ``{num_assistant_tokens, num_assistant_tokens_schedule, assistant_confidence_threshold}``
            (:func:`load_hf_settings`).

    Returns:
        The previous values of the three fields (pass them back to restore the draft's config).

    Raises:
        UserError: invalid settings, or a model without a generation config.
    """
    settings = check_hf_settings(settings)
    config = getattr(draft_model, "generation_config", None)
    if config is None:
        raise UserError(f"{type(draft_model).__name__} has no generation_config; pass a transformers generative "
                        "model as the draft")
    previous = {k: getattr(config, k, None) for k in HF_SETTING_KEYS}
    for key, value in settings.items():
        setattr(config, key, value)
    return previous


def _restore(draft_model, previous: dict) -> None:
    for key, value in previous.items():
        setattr(draft_model.generation_config, key, value)


class TunedAssistedCandidateGenerator(AssistedCandidateGenerator):
    """HF's assisted candidate generator with its online threshold re-tuning switched off.

    transformers gates the ROC-curve re-fit of ``assistant_confidence_threshold`` (and the
    per-token probability bookkeeping that feeds it) on ``type(self) is AssistedCandidateGenerator``;
    being a subclass is the whole change. Drafting, the confidence stop, the ``heuristic``
    schedules and verification are HF's own.
    """


@contextmanager
def tuned_assisted_generation(target) -> Iterator[dict]:
    """Within the block, plain assisted generation on ``target`` keeps the draft's threshold fixed.

    Only the generator HF builds for a same-tokenizer draft (a plain ``AssistedCandidateGenerator``)
    is replaced; prompt lookup, different-tokenizer and other generators are left as HF builds them.
    Yields a dict that receives the generator (``"generator"``).
    """
    info: dict = {}

    def make(original):
        def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                     assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
            gen = original(generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                           assistant_model, target_tokenizer, assistant_tokenizer)
            if type(gen) is AssistedCandidateGenerator:
                # Same arguments HF used: only the class differs (see TunedAssistedCandidateGenerator).
                gen = TunedAssistedCandidateGenerator(
                    input_ids=input_ids, assistant_model=assistant_model, generation_config=generation_config,
                    model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
                )
            info["generator"] = gen
            return gen

        return _get_candidate_generator

    with candidate_generator_replaced(target, make):
        yield info


def generate_with_settings(target, draft, settings: dict, *args, **generate_kwargs):
    """``target.generate(*args, assistant_model=draft, **generate_kwargs)`` with the tuned settings in effect.

    Sets ``settings`` on ``draft.generation_config`` (they stay set) and keeps HF from re-tuning the
    threshold. Returns what ``generate`` returns.
    """
    apply_hf_settings(draft, settings)
    with tuned_assisted_generation(target):
        return target.generate(*args, assistant_model=draft, **generate_kwargs)


def _threshold(gen) -> float | None:
    value = getattr(getattr(gen, "generation_config", None), "assistant_confidence_threshold", None)
    return None if value is None else float(value)


@contextmanager
def observe_assisted_generation(target) -> Iterator[dict]:
    """Record, per round, what the candidate generator that ``generate`` builds actually uses.

    Wraps whichever ``_get_candidate_generator`` is in effect (HF's, or one injected by
    :func:`tuned_assisted_generation`) and, on the generator it returns, ``get_candidates``. Nothing
    about the generation changes. Yields a dict: ``"rounds"`` (``{"cap", "threshold", "drafted"}``
    per round: the K the generator held, the confidence threshold in use, the tokens it drafted)
    and ``"generator"``.
    """
    info: dict = {"rounds": []}

    def make(original):
        def _get_candidate_generator(self, *args, **kwargs):
            gen = original(*args, **kwargs)
            inner = gen.get_candidates

            def get_candidates(input_ids, *a, **kw):
                cap = getattr(gen, "num_assistant_tokens", None)
                tau = _threshold(gen)
                out_ids, logits = inner(input_ids, *a, **kw)
                info["rounds"].append({"cap": None if cap is None else int(cap), "threshold": tau,
                                       "drafted": int(out_ids.shape[-1] - input_ids.shape[-1])})
                return out_ids, logits

            gen.get_candidates = get_candidates  # instance attribute: the class (and its type checks) stay HF's
            info["generator"] = gen
            return gen

        return _get_candidate_generator

    with candidate_generator_replaced(target, make):
        yield info


def _retuning_active(gen) -> bool:
    """Whether HF's ROC re-fit of the threshold runs for this generator (its own condition)."""
    from transformers.utils import is_sklearn_available

    cfg = getattr(gen, "assistant_generation_config", None)
    return bool(is_sklearn_available() and cfg is not None and cfg.assistant_confidence_threshold
                and type(gen) is AssistedCandidateGenerator)


def read_back_hf_settings(target, draft, input_ids, settings: dict, *, via: str = "generation_config",
                          **generate_kwargs) -> dict:
    """Run ``target.generate(input_ids, assistant_model=draft, ...)`` with ``settings`` and report what ran.

    Args:
        target, draft: the pair (draft as ``assistant_model``).
        input_ids: ``[1, L]`` prompt ids.
        settings: the tuned settings (:func:`load_hf_settings`).
        via: ``"generation_config"`` (the working route: :func:`generate_with_settings`) or
            ``"generate_kwargs"`` (the settings passed as ``generate()`` kwargs, for comparison).
        generate_kwargs: passed to ``generate`` (``max_new_tokens``, ``do_sample`` ...).

    Returns:
        ``{"via", "expected", "rounds", "drafted_per_round", "k_in_use", "threshold_in_use",
        "threshold_at_end", "retuning", "generator", "ok", "problems"}``: ``k_in_use`` is the set of
        per-round caps the generator held, ``threshold_in_use`` the set of thresholds it applied,
        ``retuning`` whether HF's online re-fit was active, ``ok`` whether all match ``settings``
        (``problems`` says what did not). The draft's generation config is restored afterwards.

    Raises:
        UserError: invalid settings or ``via``.
    """
    settings = check_hf_settings(settings)
    if via not in ("generation_config", "generate_kwargs"):
        raise UserError(f"via must be 'generation_config' or 'generate_kwargs', got {via!r}")
    previous = {k: getattr(draft.generation_config, k, None) for k in HF_SETTING_KEYS}
    try:
        if via == "generation_config":
            apply_hf_settings(draft, settings)
            with tuned_assisted_generation(target), observe_assisted_generation(target) as seen:
                target.generate(input_ids, assistant_model=draft, **generate_kwargs)
        else:
            with observe_assisted_generation(target) as seen:
                target.generate(input_ids, assistant_model=draft, **settings, **generate_kwargs)
    finally:
        _restore(draft, previous)
    gen = seen.get("generator")
    rounds = seen["rounds"]
    report = {
        "via": via,
        "expected": settings,
        "rounds": rounds,
        "drafted_per_round": [r["drafted"] for r in rounds],
        "k_in_use": sorted({r["cap"] for r in rounds if r["cap"] is not None}),
        "threshold_in_use": sorted({r["threshold"] for r in rounds if r["threshold"] is not None}),
        "threshold_at_end": _threshold(gen) if gen is not None else None,
        "retuning": _retuning_active(gen) if gen is not None else False,
        "generator": type(gen).__name__ if gen is not None else None,
    }
    report["problems"] = _problems(report, settings)
    report["ok"] = not report["problems"]
    return report


def _problems(report: dict, settings: dict) -> list[str]:
    k, schedule, tau = (settings[key] for key in HF_SETTING_KEYS)
    rounds = report["rounds"]
    out = []
    if not rounds:
        return ["no assisted-generation round ran (is max_new_tokens > 1 and assistant_model set?)"]
    if schedule == "constant" and report["k_in_use"] != [k]:
        out.append(f"num_assistant_tokens in use {report['k_in_use']} (expected {k})")
    if schedule != "constant" and rounds[0]["cap"] != k:
        out.append(f"first-round num_assistant_tokens {rounds[0]['cap']} (expected the schedule's start {k})")
    if any(r["cap"] is not None and r["drafted"] > r["cap"] for r in rounds):
        out.append("a round drafted more tokens than its num_assistant_tokens")
    used = report["threshold_in_use"] + ([report["threshold_at_end"]] if report["threshold_at_end"] is not None else [])
    if any(not math.isclose(t, tau, rel_tol=0.0, abs_tol=1e-9) for t in used):
        out.append(f"assistant_confidence_threshold in use {report['threshold_in_use']}, "
                   f"{report['threshold_at_end']} at the end (expected {tau})")
    if report["retuning"]:
        out.append("transformers re-tunes the threshold online (ROC curve) during this generation")
    return out
