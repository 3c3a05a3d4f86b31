"""Tuned settings for the engines people serve with: ``specstop export --for hf|vllm|llamacpp|sglang``.

The tuner's rule-based policies map onto knobs these engines already expose:

=========== ==================================================================================
engine      knobs (what each tuned policy becomes)
=========== ==================================================================================
hf          ``num_assistant_tokens`` + ``num_assistant_tokens_schedule`` (static K: constant;
            heuristic start: heuristic) and ``assistant_confidence_threshold`` (confidence tau,
            with SL_max as num_assistant_tokens); the learned predictor itself through
            ``generate(custom_generate=EXPORT)``.
vllm        ``speculative_config.num_speculative_tokens`` = static K (a fixed draft length).
llamacpp    ``--spec-type draft-simple`` with ``--spec-draft-n-max`` / ``--spec-draft-n-min`` /
            ``--spec-draft-p-min`` (older builds: ``--draft-max`` / ``--draft-min`` /
            ``--draft-p-min``): static K (p-min 0), or SL_max with the confidence threshold as p-min.
sglang      ``--speculative-algorithm STANDALONE`` with ``--speculative-num-steps`` K,
            ``--speculative-eagle-topk 1``, ``--speculative-num-draft-tokens`` K + 1.
=========== ==================================================================================

Every settings file carries the replay's predicted speedup for the policy it encodes and the
cost model (calibration) that prediction assumes, both read from ``tuned.json``: the prediction
holds only on hardware whose step costs match that cost model.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from specstop.errors import UserError
from specstop.outputs import atomic_write_text

ENGINES = ("hf", "vllm", "llamacpp", "sglang")
#: Which tuned policies each engine can express (in tuned.json names).
_SUPPORTED = {
    "hf": ("static_opt", "heuristic_opt", "confidence_opt"),
    "vllm": ("static_opt",),
    "llamacpp": ("static_opt", "confidence_opt"),
    "sglang": ("static_opt",),
}


def _policy(tuned: dict, name: str) -> dict | None:
    entry = (tuned.get("policies") or {}).get(name)
    if not entry:
        return None
    return {"name": name, "spec": entry["spec"], "validation": entry.get("validation") or {}}


def _prediction(entry: dict) -> dict:
    v = entry["validation"]
    keys = ("speedup", "latency_per_token", "tokens_per_round", "accepted_per_round", "verification_rate", "discard_rate")
    return {k: v.get(k) for k in keys if k in v}


def _hf(entry: dict) -> dict:
    spec = entry["spec"]
    kind = spec["kind"]
    if kind == "static":
        kw = {"num_assistant_tokens": spec["k"], "num_assistant_tokens_schedule": "constant",
              "assistant_confidence_threshold": 0.0}
    elif kind == "heuristic":
        kw = {"num_assistant_tokens": spec["start"], "num_assistant_tokens_schedule": "heuristic",
              "assistant_confidence_threshold": 0.0}
    else:  # confidence: stop after a drafted token whose probability is below tau, at most SL_max
        kw = {"num_assistant_tokens": spec["sl_max"], "num_assistant_tokens_schedule": "constant",
              "assistant_confidence_threshold": spec["threshold"]}
    return {"generate_kwargs": kw}


def _vllm(entry: dict, draft: str, target: str) -> dict:
    k = entry["spec"]["k"]
    conf = {"model": draft, "num_speculative_tokens": k}
    return {
        "speculative_config": conf,
        "command": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(conf))}",
    }


#: Current llama.cpp drafts with a separate draft model only when asked (``-md`` alone loads it
#: but drafts nothing: "no implementations specified for speculative decoding").
LLAMACPP_DRAFT_TYPE = ["--spec-type", "draft-simple"]


def llamacpp_flags(spec: dict, *, legacy: bool = False) -> list[str]:
    """llama.cpp draft flags for a static or confidence policy spec.

    ``legacy``: the names builds before the ``--spec-*`` rename accept (``--draft-max`` ...), which
    also need no ``--spec-type``.
    """
    if spec["kind"] == "static":
        n_max, p_min = spec["k"], 0.0
    else:
        n_max, p_min = spec["sl_max"], spec["threshold"]
    if legacy:
        return ["--draft-max", str(n_max), "--draft-min", "0", "--draft-p-min", f"{p_min:.4g}"]
    return [*LLAMACPP_DRAFT_TYPE, "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", f"{p_min:.4g}"]


def _llamacpp(entry: dict, draft: str, target: str) -> dict:
    flags = llamacpp_flags(entry["spec"])
    base = ["llama-server", "-m", target, "-md", draft, "--temp", "0"]
    return {
        "flags": flags,
        "flags_legacy": llamacpp_flags(entry["spec"], legacy=True),
        "command": shlex.join(base + flags),
        "caveat": (
            "llama.cpp ends a draft *before* a token whose probability is below --spec-draft-p-min; specstop's "
            "confidence rule drafts that token and stops after it, so with a threshold the engine drafts up to "
            "one token fewer per round than the replay assumed"
            if entry["spec"]["kind"] == "confidence" else None
        ),
    }


def _sglang(entry: dict, draft: str, target: str) -> dict:
    k = entry["spec"]["k"]
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    return {"flags": flags, "command": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, *flags])}


def gguf_source(model: str) -> str:
    """The GGUF file a model folder was converted from (``specstop fetch-pair``), else ``model`` itself.

    llama.cpp loads GGUF files only; a converted pair's folder records its source file, which
    ``fetch-pair`` keeps in the downloads cache. A folder without that record (or whose GGUF is gone)
    is returned unchanged, so the command still names the model the user gave.
    """
    from specstop.pair.convert import SOURCE_RECORD
    from specstop.paths import downloads_dir

    record = Path(model) / SOURCE_RECORD
    try:
        name = json.loads(record.read_text()).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        return model
    path = downloads_dir() / str(name)
    return str(path) if name and path.is_file() else model


def _pair_names(tuned: dict, manifest: dict | None) -> tuple[str, str]:
    pair = (manifest or {}).get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path") or "DRAFT"
    target = (pair.get("target") or {}).get("name_or_path") or "TARGET"
    return draft, target


def engine_settings(tuned: dict, engine: str, *, manifest: dict | None = None, draft: str | None = None,
                    target: str | None = None, tuned_path: str | None = None,
                    hf_export: tuple[str, str] | None = None) -> dict[str, Any]:
    """The settings file for ``engine`` from a tuned-policy dict.

    Args:
        tuned: ``tuned.json`` (``policies`` with ``spec`` + ``validation``, ``cost_model``, ``best``).
        engine: one of :data:`ENGINES`.
        manifest: the tuning dataset's manifest (names the draft and target), optional.
        draft, target: model names or files to write into commands (default: the manifest's).
        hf_export: ``(policy name, export folder)`` of a learned policy exported for HF: added as an
            option that runs through ``generate(custom_generate=folder)``.

    Returns:
        ``{"engine", "recommended", "options": {policy: settings}, "cost_model", "source", ...}``;
        ``recommended`` is the expressible policy with the highest predicted speedup.

    Raises:
        UserError: unknown engine, or the tuned file has none of the policies the engine can express.
    """
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    d_default, t_default = _pair_names(tuned, manifest)
    draft, target = draft or d_default, target or t_default
    options = {}
    for name in _SUPPORTED[engine]:
        entry = _policy(tuned, name)
        if entry is None:
            continue
        body = {
            "hf": lambda e: _hf(e),
            "vllm": lambda e: _vllm(e, draft, target),
            "llamacpp": lambda e: _llamacpp(e, gguf_source(draft), gguf_source(target)),  # llama.cpp reads GGUF
            "sglang": lambda e: _sglang(e, draft, target),
        }[engine](entry)
        options[name] = {"policy": entry["spec"], "predicted": _prediction(entry), **body}
    if engine == "hf" and hf_export is not None:
        name, folder = hf_export
        entry = _policy(tuned, name)
        if entry is not None:
            options[name] = {"policy": entry["spec"], "predicted": _prediction(entry),
                             "generate_kwargs": {"custom_generate": folder, "trust_remote_code": True}}
    if not options:
        raise UserError(
            f"the tuned file has none of the policies {engine} can express ({', '.join(_SUPPORTED[engine])}); "
            "rerun `specstop tune` with this specstop version"
        )
    recommended = max(options, key=lambda n: options[n]["predicted"].get("speedup") or 0.0)
    best = tuned.get("best")
    best_entry = _policy(tuned, best) if best else None
    return {
        "engine": engine,
        "recommended": recommended,
        "options": options,
        "best_tuned_policy": {"name": best, "predicted": _prediction(best_entry)} if best_entry else None,
        "cost_model": tuned.get("cost_model"),
        "draft": draft,
        "target": target,
        "source": {"tuned": tuned_path, "dataset": tuned.get("dataset"), "split": tuned.get("split")},
        "note": (
            "predicted = exact replay of the tuning split under cost_model; it holds where this engine's draft "
            "and verification step costs match cost_model (calibrate with `specstop calibrate-cost`)"
        ),
    }


def write_engine_settings(out: str | Path, tuned_path: str | Path, engines: list[str], *, draft: str | None = None,
                          target: str | None = None, hf_policy: str | None = None) -> dict[str, Path]:
    """Write ``OUT/<engine>.json`` for each engine. Returns ``{engine: path}``.

    ``hf_policy``: the learned policy exported into ``OUT`` for ``custom_generate`` (an hf option).
    """
    from specstop.export.export import _read_manifest, read_tuned

    tuned = read_tuned(tuned_path)
    manifest = _read_manifest(tuned.get("dataset")) if tuned.get("dataset") else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for engine in engines:
        settings = engine_settings(tuned, engine, manifest=manifest, draft=draft, target=target, tuned_path=str(tuned_path),
                                   hf_export=(hf_policy, str(out.resolve())) if hf_policy else None)
        path = out / f"{engine}.json"
        atomic_write_text(path, json.dumps(settings, indent=2) + "\n")
        paths[engine] = path
    return paths


def summary_line(settings: dict) -> str:
    """One line per engine for the CLI: the recommended settings and their predicted speedup."""
    rec = settings["options"][settings["recommended"]]
    what = rec.get("command") or json.dumps(rec.get("generate_kwargs"))
    speed = rec["predicted"].get("speedup")
    return f"{settings['engine']}: {settings['recommended']} (predicted speedup {speed:.3f}x) -> {what}" if speed else \
        f"{settings['engine']}: {settings['recommended']} -> {what}"
