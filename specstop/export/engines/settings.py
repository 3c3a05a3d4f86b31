"""One settings file per engine, built, checked and written the same way for every engine in :data:`REGISTRY`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specstop.errors import UserError
from specstop.export.engines.base import Context, Engine, bad, policy_entry, side_file
from specstop.export.engines.hf import ENGINE as HF
from specstop.export.engines.llamacpp import ENGINE as LLAMACPP
from specstop.export.engines.pricing import prediction, priced_by, stats
from specstop.export.engines.schedule import check_schedule_rows, read_batch_schedule
from specstop.export.engines.sglang import ENGINE as SGLANG
from specstop.export.engines.trtllm import ENGINE as TRTLLM
from specstop.export.engines.vllm import ENGINE as VLLM
from specstop.outputs import atomic_write_text

#: Every engine specstop writes settings for, by its ``--for`` name.
REGISTRY: dict[str, Engine] = {e.name: e for e in (HF, VLLM, LLAMACPP, SGLANG, TRTLLM)}
ENGINES = tuple(REGISTRY)
#: Engines whose settings file carries the tuned batch schedule (HF assisted generation runs batch 1 only).
SCHEDULE_ENGINES = tuple(name for name, e in REGISTRY.items() if e.schedule is not None)

__all__ = ["ENGINES", "REGISTRY", "SCHEDULE_ENGINES", "engine_schedule", "engine_settings", "side_file",
           "summary_line", "validate_engine_file", "write_engine_settings"]


def _engine(engine: str) -> Engine:
    if engine not in REGISTRY:
        raise UserError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    return REGISTRY[engine]


def engine_schedule(sched: dict, engine: str, draft: str, target: str, folder: str | None = None) -> dict:
    """The batch schedule in ``engine``'s form, with the predicted speedup per batch size (``folder``:
    where the side files go, see :func:`side_file`)."""
    body = REGISTRY[engine].schedule(sched, draft, target, folder)
    return {"cost_model": sched["cost_model"], "tuned": sched["entries"], **body}


def _pair_names(manifest: dict | None) -> tuple[str, str]:
    pair = (manifest or {}).get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path") or "DRAFT"
    target = (pair.get("target") or {}).get("name_or_path") or "TARGET"
    return draft, target


def _quant_note(cost_model: dict | None, draft_quant: str) -> dict:
    """The quantized draft the proposer options run, and whether the tuned costs were measured with it."""
    measured = ((cost_model or {}).get("machine") or {}).get("draft_quant")
    note = (f"priced with the {draft_quant} draft's own costs, as specstop's proposer timed them inside vLLM (the "
            "runner options pack the same layers into vLLM's runner, whose steps were not timed)"
            if measured == draft_quant else
            f"priced with the costs of a {measured or 'float'} draft, not the {draft_quant} one: measure with "
            f"`specstop calibrate-cost --engine vllm --draft-quant {draft_quant}` and tune again")
    return {"scheme": draft_quant, "note": note + "; acceptance replayed from the dataset's (float) draft"}


def engine_settings(tuned: dict, engine: str, *, manifest: dict | None = None, draft: str | None = None,
                    target: str | None = None, tuned_path: str | None = None,
                    hf_export: tuple[str, str] | None = None, folder: str | Path | None = None,
                    draft_quant: str | None = None) -> dict[str, Any]:
    """The settings file for ``engine`` from a tuned-policy dict.

    Args:
        tuned: ``tuned.json`` (``policies`` with ``spec`` + ``validation``, ``cost_model``, ``best``).
        engine: one of :data:`ENGINES`.
        manifest: the tuning dataset's manifest (names the draft and target), optional.
        draft, target: model names or files to write into commands (default: the manifest's).
        hf_export: ``(policy name, export folder)`` of a learned policy exported beside the file: an hf
            option that runs through ``generate(custom_generate=folder)``, and a vllm option that runs
            it inside vLLM's draft-model runner (learned predictors only).
        folder: the folder the file is written to: its usage lines and commands name the files there
            (``hf.json``, TensorRT-LLM's YAML, SGLang's tiers) by that path, so they run from any
            directory; None: bare file names.
        draft_quant: vllm only: the draft runs quantized ("int8", "int4"; vLLM's CPU build) in every option:
            rules in vLLM's runner (the heuristic in specstop's proposer), and the learned option only where its
            export was trained on that quantized draft's features.

    Returns:
        ``{"engine", "recommended", "options": {policy: settings}, "cost_model", "source", ...}``;
        ``recommended`` is the expressible policy with the highest predicted speedup.

    Raises:
        UserError: unknown engine, or the tuned file has none of the policies the engine can express.
    """
    eng = _engine(engine)
    d_default, t_default = _pair_names(manifest)
    draft, target = draft or d_default, target or t_default
    ctx = Context(draft=draft, target=target, folder=str(folder) if folder is not None else None, tuned=tuned,
                  draft_quant=draft_quant)
    options = {}
    for name in eng.policies:
        entry = policy_entry(tuned, name)
        if entry is None:
            continue
        options[name] = {"policy": entry["spec"], "predicted": prediction(entry), **eng.option(entry, ctx), **stats(entry)}
    if eng.learned is not None and hf_export is not None:
        name, export = hf_export
        entry = policy_entry(tuned, name)
        body = eng.learned(entry, export, ctx) if entry is not None else None
        if body is not None:
            options[name] = {"policy": entry["spec"], "predicted": prediction(entry), **body}
    sched = read_batch_schedule(tuned) if eng.schedule is not None else None
    if eng.reprice is not None:  # the engine's own measured costs, where it has them
        sched = eng.reprice(options, sched, ctx)
    if not options and sched is None:
        raise UserError(
            f"the tuned file has none of the policies {engine} can express ({', '.join(eng.policies)}); "
            "rerun `specstop tune` with this specstop version"
        )
    recommended = max(options, key=lambda n: options[n]["predicted"].get("speedup") or 0.0) if options else None
    if recommended is not None and (options[recommended]["predicted"].get("speedup") or 0.0) < 1.0:
        extra_none = {"no_speculation": (
            f"every option is predicted slower than {engine} without speculation under cost_model "
            f"(best: {recommended}, {options[recommended]['predicted']['speedup']:.3f}x): serve without speculation")}
        recommended = None
    else:
        extra_none = {}
    best = tuned.get("best")
    best_entry = policy_entry(tuned, best) if best else None
    extra = {}
    if sched is not None:
        extra["batch_schedule"] = engine_schedule(sched, engine, *eng.names(draft, target), folder=ctx.folder)
    extra.update(eng.extra)
    return {
        "engine": engine,
        "recommended": recommended,
        **extra_none,
        "options": options,
        **extra,
        "priced_by": priced_by(tuned.get("cost_model"), engine),
        **({"draft_quant": _quant_note(tuned.get("cost_model"), draft_quant)} if draft_quant else {}),
        "best_tuned_policy": {"name": best, "predicted": prediction(best_entry)} if best_entry else None,
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
                          target: str | None = None, hf_policy: str | None = None,
                          draft_quant: str | None = None) -> dict[str, Path]:
    """Write ``OUT/<engine>.json`` (and the files each engine reads by path) for each engine.

    ``hf_policy``: the learned policy exported into ``OUT`` (an hf option through ``custom_generate``; a
    vllm option through specstop's proposer).

    Returns:
        ``{engine: path of its settings file}``.
    """
    from specstop.export.export import _read_manifest, read_tuned

    tuned = read_tuned(tuned_path)
    manifest = _read_manifest(tuned.get("dataset")) if tuned.get("dataset") else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for engine in engines:
        settings = engine_settings(tuned, engine, manifest=manifest, draft=draft, target=target, tuned_path=str(tuned_path),
                                   hf_export=(hf_policy, str(out.resolve())) if hf_policy else None,
                                   folder=out.resolve(), draft_quant=draft_quant if engine == "vllm" else None)
        validate_engine_file(engine, settings)  # never write a file the engine's documented schema refuses
        path = out / f"{engine}.json"
        atomic_write_text(path, json.dumps(settings, indent=2) + "\n")
        paths[engine] = path
        if REGISTRY[engine].side_files is not None:
            REGISTRY[engine].side_files(out, settings)
    return paths


def summary_line(settings: dict) -> str:
    """One line per engine for the CLI: the recommended settings and their predicted speedup (and the
    batch schedule's K and predicted speedup per batch size, when the file has one)."""
    sched = settings.get("batch_schedule")
    tail = ""
    if sched:
        per_b = ", ".join(
            f"B{r['batch_size']}: K={r['k']}"
            + (f" {r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") else "")
            for r in sched["by_batch_size"])
        tail = f"; batch schedule [{per_b}]"
    if settings.get("recommended") is None:
        if settings.get("no_speculation"):
            return f"{settings['engine']}: no speculation recommended ({settings['no_speculation']}){tail}"
        return f"{settings['engine']}: batch schedule only{tail}"
    rec = settings["options"][settings["recommended"]]
    what = rec.get("command") or json.dumps(rec.get("generate_kwargs") or rec.get("assistant_generation_config"))
    speed = rec["predicted"].get("speedup")
    head = f"{settings['engine']}: {settings['recommended']} (predicted speedup {speed:.3f}x) -> {what}" if speed else \
        f"{settings['engine']}: {settings['recommended']} -> {what}"
    return head + tail


def validate_engine_file(engine: str, data: Any) -> None:
    """Check a settings file (``<engine>.json`` content) against the schema the engine documents.

    Each engine module checks its own options and schedule (see their ``_check_*``); shared here: the
    file's engine, its options each with ``predicted`` metrics, the recommended option among them, and
    for a batch schedule batch sizes ascending, K integers >= 0, predicted speedups positive.

    Raises:
        UserError: the first violation, naming the field and the fix.
    """
    eng = _engine(engine)
    if not isinstance(data, dict) or data.get("engine") != engine:
        raise bad(engine, f"not a {engine} settings file (its 'engine' is {data.get('engine') if isinstance(data, dict) else None!r})")
    options = data.get("options")
    if not isinstance(options, dict):
        raise bad(engine, "'options' must be an object")
    if data.get("recommended") is not None and data["recommended"] not in options:
        raise bad(engine, f"recommended option {data['recommended']!r} is not among the options")
    for name, opt in options.items():
        where = f"option {name}"
        if not isinstance(opt, dict) or not isinstance(opt.get("predicted"), dict):
            raise bad(engine, f"{where} lacks its 'predicted' metrics")
        eng.check_option(opt, where)
    sched = data.get("batch_schedule")
    if sched is None:
        return
    if eng.schedule is None:
        raise bad(engine, "this engine takes no batch schedule")
    check_schedule_rows(engine, sched.get("by_batch_size"))
    if eng.check_schedule is not None:
        eng.check_schedule(sched, "batch_schedule")
