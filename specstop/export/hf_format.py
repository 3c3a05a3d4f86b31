"""The Hugging Face assisted-generation settings ``specstop export --for hf`` writes: the three
draft-model generation-config fields a tuned rule-based policy sets, built from a policy spec,
checked, and read back from ``hf.json``. Applying them is :mod:`specstop.decode.hf_settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specstop.errors import UserError
from specstop.jsonio import read_json

__all__ = ["HF_SETTING_KEYS", "SCHEDULES", "check_hf_settings", "hf_settings_from_spec", "load_hf_settings"]

#: The draft-model generation-config fields a tuned rule-based policy sets.
HF_SETTING_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
#: transformers' schedules: ``heuristic`` carries the adapted length over to the next generate()
#: call on the same draft; ``heuristic_transient`` restarts every call from num_assistant_tokens.
SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def hf_settings_from_spec(spec: dict) -> dict:
    """The draft generation-config values that express a tuned static / heuristic / confidence spec.

    Args:
        spec: a ``PolicySpec.to_dict()`` of kind ``static``, ``heuristic`` or ``confidence``.

    Returns:
        ``{num_assistant_tokens, num_assistant_tokens_schedule, assistant_confidence_threshold}``.

    Raises:
        UserError: a spec kind HF's assisted generation cannot express.
    """
    kind = spec.get("kind")
    if kind == "static":
        return {"num_assistant_tokens": int(spec["k"]), "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    if kind == "heuristic":
        # The replay restarts the heuristic at `start` for every sequence; HF's "heuristic" would
        # carry the adapted length into the next generate() call, "heuristic_transient" does not.
        return {"num_assistant_tokens": int(spec["start"]), "num_assistant_tokens_schedule": "heuristic_transient",
                "assistant_confidence_threshold": 0.0}
    if kind == "confidence":
        # HF's ConfidenceCriteria: stop after a drafted token whose probability is below tau; at most SL_max.
        return {"num_assistant_tokens": int(spec["sl_max"]), "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": float(spec["threshold"])}
    raise UserError(f"policy kind {kind!r} has no Hugging Face generation-config form; use static, heuristic or "
                    "confidence (learned policies run through custom_generate)")


def check_hf_settings(settings: Any) -> dict:
    """Validate the three settings and return them as a plain dict.

    Raises:
        UserError: a missing key, a wrong type or an out-of-range value (one line, with the fix).
    """
    if not isinstance(settings, dict):
        raise UserError(f"HF settings must be a mapping with {', '.join(HF_SETTING_KEYS)}, got "
                        f"{type(settings).__name__}; pass an hf.json option's assistant_generation_config")
    missing = [k for k in HF_SETTING_KEYS if k not in settings]
    if missing:
        raise UserError(f"HF settings lack {missing[0]!r}; pass all of {', '.join(HF_SETTING_KEYS)} "
                        "(an hf.json option's assistant_generation_config has them)")
    k = settings["num_assistant_tokens"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"num_assistant_tokens must be an integer >= 1, got {k!r}; fix the settings (re-export with "
                        "`specstop export --for hf`)")
    schedule = settings["num_assistant_tokens_schedule"]
    if schedule not in SCHEDULES:
        raise UserError(f"num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}; "
                        "fix the settings (re-export with `specstop export --for hf`)")
    tau = settings["assistant_confidence_threshold"]
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= float(tau) <= 1.0:
        raise UserError(f"assistant_confidence_threshold must be a number in [0, 1], got {tau!r}; fix the settings "
                        "(0 turns the confidence stop off)")
    return {"num_assistant_tokens": int(k), "num_assistant_tokens_schedule": schedule,
            "assistant_confidence_threshold": float(tau)}


def load_hf_settings(source: str | Path | dict, option: str | None = None) -> dict:
    """The settings of one option of an ``hf.json`` written by ``specstop export --for hf``.

    Args:
        source: the path of ``hf.json``, its parsed content, or a plain settings dict.
        option: the option name (``static_opt``, ``confidence_opt`` ...); default: the recommended
            option when it is rule-based, else the rule-based option with the highest predicted speedup.

    Raises:
        UserError: an unreadable file, an unknown option, or a file without rule-based options.
    """
    if isinstance(source, (str, Path)):
        data = read_json(source, "HF settings file (`specstop export --for hf` writes hf.json)")
    else:
        data = source
    if isinstance(data, dict) and all(k in data for k in HF_SETTING_KEYS):
        return check_hf_settings({k: data[k] for k in HF_SETTING_KEYS})
    options = (data or {}).get("options") if isinstance(data, dict) else None
    if not isinstance(options, dict):
        raise UserError("HF settings source has no 'options'; pass the hf.json that `specstop export --for hf` wrote")
    rule_based = {n: o for n, o in options.items() if isinstance(o, dict) and "assistant_generation_config" in o}
    if option is None:
        if not rule_based:
            raise UserError("hf.json has no rule-based option (only learned ones, which run through custom_generate); "
                            "re-export with a tuned file that has static_opt / heuristic_opt / confidence_opt")
        rec = data.get("recommended")
        option = rec if rec in rule_based else max(
            rule_based, key=lambda n: (rule_based[n].get("predicted") or {}).get("speedup") or 0.0)
    if option not in rule_based:
        raise UserError(f"hf.json has no rule-based option {option!r}; choose from {', '.join(sorted(rule_based))}")
    return check_hf_settings(rule_based[option]["assistant_generation_config"])
