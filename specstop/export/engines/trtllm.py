"""TensorRT-LLM: the LLM API ``speculative_config`` (``decoding_type: Draft_Target``, ``max_draft_len`` K,
``speculative_model``), written as a ``--extra_llm_api_options`` YAML file; the batch schedule as
``draft_len_schedule``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from specstop.export.engines.base import Context, Engine, bad, is_int, side_file
from specstop.export.engines.pricing import schedule_rows
from specstop.outputs import atomic_write_text

#: trtllm-serve reads LLM API options from a YAML file (``--extra_llm_api_options``; newer releases
#: also accept ``--config``). ``Draft_Target`` is DraftTargetDecodingConfig's ``decoding_type``.
TRTLLM_DECODING_TYPE = "Draft_Target"


def trtllm_options_file(name: str) -> str:
    """The YAML file ``write_engine_settings`` writes next to trtllm.json for option ``name``."""
    return f"trtllm_{name}.yaml"


def _command(target: str, name: str, folder: str | None) -> str:
    return shlex.join(["trtllm-serve", "serve", target, "--backend", "pytorch",
                       "--extra_llm_api_options", side_file(folder, trtllm_options_file(name))])


def _option(entry: dict, ctx: Context) -> dict:
    conf = {"decoding_type": TRTLLM_DECODING_TYPE, "max_draft_len": entry["spec"]["k"], "speculative_model": ctx.draft}
    return {"llm_api_options": {"speculative_config": conf}, "command": _command(ctx.target, entry["name"], ctx.folder)}


def _schedule(sched: dict, draft: str, target: str, folder: str | None) -> dict:
    entries = sched["entries"]
    k_max = entries[0]["k"]
    # TensorRT-LLM requires schedule[smallest key] == max_draft_len and every draft length <= it.
    ks = [min(e["k"], k_max) for e in entries]
    notes = [
        "draft_len_schedule keys are upper bounds: batch sizes above the previous key up to this key use its "
        "draft length, and batch sizes above the largest key run without speculation (TensorRT-LLM's rule)",
    ]
    if ks != [e["k"] for e in entries]:
        notes.append(f"TensorRT-LLM caps every draft length at the batch-{entries[0]['batch_size']} one "
                     f"(max_draft_len {k_max}); larger tuned K were lowered to it, with that K's predicted speedup")
    if k_max == 0:
        conf = None
        notes.append(f"the schedule runs no speculation at batch size {entries[0]['batch_size']}, so none at any "
                     "batch size here: serve without speculative_config")
    else:
        conf = {"decoding_type": TRTLLM_DECODING_TYPE, "max_draft_len": k_max, "speculative_model": draft,
                "draft_len_schedule": {str(e["batch_size"]): k for e, k in zip(entries, ks)}}
    return {
        "llm_api_options": {"speculative_config": conf} if conf else {},
        "command": _command(target, "batch_schedule", folder) if conf else shlex.join(["trtllm-serve", "serve", target]),
        "by_batch_size": schedule_rows(sched, ks),
        "notes": notes,
    }


def _check_conf(conf: Any, where: str) -> None:
    """DraftTargetDecodingConfig (tensorrt_llm/llmapi/llm_args.py): max_draft_len > 0, speculative_model set,
    draft_len_schedule keys >= 1, values >= 0, schedule[smallest key] == max_draft_len, all <= it."""
    if not isinstance(conf, dict):
        raise bad("trtllm", f"{where}: speculative_config must be an object")
    if conf.get("decoding_type") != TRTLLM_DECODING_TYPE:
        raise bad("trtllm", f"{where}: decoding_type must be {TRTLLM_DECODING_TYPE!r}, got {conf.get('decoding_type')!r}")
    k = conf.get("max_draft_len")
    if not is_int(k) or k < 1:
        raise bad("trtllm", f"{where}: max_draft_len must be an integer > 0 for Draft_Target, got {k!r}")
    if not isinstance(conf.get("speculative_model"), str) or not conf["speculative_model"]:
        raise bad("trtllm", f"{where}: speculative_model must name the draft model")
    sched = conf.get("draft_len_schedule")
    if sched is None:
        return
    if not isinstance(sched, dict) or not sched:
        raise bad("trtllm", f"{where}: draft_len_schedule must be a non-empty {{batch size: draft length}} map")
    keys = []
    for b, v in sched.items():
        try:
            bi = int(b)
        except (TypeError, ValueError):
            raise bad("trtllm", f"{where}: draft_len_schedule key {b!r} is not a batch size") from None
        if bi < 1 or str(bi) != str(b).strip():
            raise bad("trtllm", f"{where}: draft_len_schedule batch size {b!r} must be an integer >= 1")
        if not is_int(v) or v < 0 or v > k:
            raise bad("trtllm", f"{where}: draft length {v!r} at batch size {bi} must be an integer in [0, max_draft_len {k}]")
        keys.append(bi)
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise bad("trtllm", f"{where}: draft_len_schedule batch sizes must ascend, got {keys}")
    if sched[next(iter(sched))] != k:
        raise bad("trtllm", f"{where}: draft_len_schedule at the smallest batch size must equal max_draft_len {k}")


def _check_option(opt: dict, where: str) -> None:
    _check_conf((opt.get("llm_api_options") or {}).get("speculative_config"), where)


def _check_schedule(sched: dict, where: str) -> None:
    if (sched.get("llm_api_options") or {}).get("speculative_config") is not None:
        _check_conf(sched["llm_api_options"]["speculative_config"], where)


def _side_files(out: Path, settings: dict) -> None:
    """trtllm-serve's LLM API YAML, one per option and one for the batch schedule."""
    import yaml

    bodies = {name: opt.get("llm_api_options") for name, opt in settings["options"].items()}
    if settings.get("batch_schedule"):
        bodies["batch_schedule"] = settings["batch_schedule"].get("llm_api_options")
    for name, body in bodies.items():
        if not body:
            continue
        conf = dict(body.get("speculative_config") or {})
        if "draft_len_schedule" in conf:  # YAML with integer keys: TensorRT-LLM's dict[int, int]
            conf["draft_len_schedule"] = {int(b): k for b, k in conf["draft_len_schedule"].items()}
        atomic_write_text(out / trtllm_options_file(name),
                          yaml.safe_dump({**body, "speculative_config": conf}, sort_keys=False))


#: Why no confidence-scheduling files are written (tensorrt_llm/llmapi/llm_args.py DSparkDecodingConfig;
#: tensorrt_llm/_torch/speculative/dspark_planner.py, dspark_sts.py, read at NVIDIA/TensorRT-LLM 7fbff6f7, 0ee1e73f).
CONFIDENCE_SCHEDULING_NOTE = (
    "not written: TensorRT-LLM's confidence scheduling (enable_confidence_scheduling) is a DSpark option "
    "(decoding_type DSpark): it trims the verify of DSpark's own drafted blocks by its confidence head, reading "
    "a whole-step cost table T(G, V) measured in the live engine and bound to its fingerprint "
    "(confidence_sps_table_path, schema_version 2) and per-position temperatures for that head "
    "(confidence_sts_path). A Draft_Target pair has no confidence head, and specstop's step costs are not those "
    "cells; what applies is speculative_config above and its draft_len_schedule"
)
ENGINE = Engine(name="trtllm", policies=("static_opt",), option=_option, check_option=_check_option,
                schedule=_schedule, check_schedule=_check_schedule, side_files=_side_files,
                extra={"confidence_scheduling": CONFIDENCE_SCHEDULING_NOTE})
