"""Hugging Face transformers: assisted generation's draft ``generation_config`` for the rule-based policies,
``generate(custom_generate=EXPORT)`` for a learned one. Batch 1 only, so no batch schedule."""

from __future__ import annotations

from specstop.errors import UserError
from specstop.export.engines.base import Context, Engine, bad, side_file


def hf_usage(settings_file: str, option: str) -> str:
    """How an hf.json rule-based option is applied (transformers reads these from the draft's
    generation_config): one line that runs as written once ``target``, ``draft`` and ``inputs`` (the
    tokenizer's output for a prompt) are the reader's."""
    return ("from specstop import generate_with_settings, load_hf_settings; "
            f"out = generate_with_settings(target, draft, load_hf_settings({settings_file!r}, {option!r}), **inputs, "
            "max_new_tokens=128)")


def hf_policy_usage(folder: str) -> str:
    """How an hf.json learned option runs: ``generate(custom_generate=FOLDER)`` (same names as :func:`hf_usage`)."""
    return (f"out = target.generate(**inputs, assistant_model=draft, custom_generate={folder!r}, trust_remote_code=True, "
            "max_new_tokens=128)")


HF_NOTE = (
    "transformers 5.x reads num_assistant_tokens, num_assistant_tokens_schedule and assistant_confidence_threshold "
    "from assistant_model.generation_config, not from generate() kwargs; with scikit-learn installed it also re-fits "
    "the threshold online (ROC curve) unless the candidate generator is a subclass - generate_with_settings sets "
    "the fields on the draft and keeps the tuned threshold fixed; read_back_hf_settings reports what ran"
)


def _option(entry: dict, ctx: Context) -> dict:
    from specstop.export.hf_format import hf_settings_from_spec

    # Set on the draft model, not passed to generate(): see HF_NOTE.
    return {"assistant_generation_config": hf_settings_from_spec(entry["spec"]),
            "usage": hf_usage(side_file(ctx.folder, "hf.json"), entry["name"])}


def _learned(entry: dict, export: str, ctx: Context) -> dict:
    return {"generate_kwargs": {"custom_generate": export, "trust_remote_code": True}, "usage": hf_policy_usage(export)}


def _check_option(opt: dict, where: str) -> None:
    """The three generation-config fields (types, ranges, schedule names), or a ``custom_generate`` folder."""
    if "assistant_generation_config" in opt:
        from specstop.export.hf_format import check_hf_settings

        try:
            check_hf_settings(opt["assistant_generation_config"])
        except UserError as err:
            raise bad("hf", f"{where}: {err}") from None
    elif not (opt.get("generate_kwargs") or {}).get("custom_generate"):
        raise bad("hf", f"{where} has neither assistant_generation_config nor a custom_generate folder")


ENGINE = Engine(name="hf", policies=("static_opt", "heuristic_opt", "confidence_opt"), option=_option,
                check_option=_check_option, learned=_learned, extra={"note_hf": HF_NOTE})
