"""Tuned settings for the engines people serve with: ``specstop export --for hf|vllm|llamacpp|sglang|trtllm``.

The tuner's rule-based policies map onto knobs these engines already expose:

=========== ==================================================================================
engine      knobs (what each tuned policy becomes)
=========== ==================================================================================
hf          the draft model's ``generation_config``: ``num_assistant_tokens`` +
            ``num_assistant_tokens_schedule`` (static K: constant; heuristic start:
            heuristic_transient) and ``assistant_confidence_threshold`` (confidence tau, with SL_max
            as num_assistant_tokens), applied by :mod:`specstop.decode.hf_settings`; the learned
            predictor itself through ``generate(custom_generate=EXPORT)``.
vllm        ``speculative_config.num_speculative_tokens`` = static K (a fixed draft length, vLLM's own
            draft-model proposer); heuristic, confidence and learned policies through specstop's
            proposer class (``method: custom_class``, :mod:`specstop.decode.vllm_proposer`), set up
            by ``additional_config``.
llamacpp    ``--spec-type draft-simple`` with ``--spec-draft-n-max`` / ``--spec-draft-n-min`` /
            ``--spec-draft-p-min`` (older builds: ``--draft-max`` / ``--draft-min`` /
            ``--draft-p-min``): static K (p-min 0), or SL_max with the confidence threshold as p-min.
sglang      ``--speculative-algorithm STANDALONE`` with ``--speculative-num-steps`` K,
            ``--speculative-eagle-topk 1``, ``--speculative-num-draft-tokens`` K + 1.
trtllm      LLM API ``speculative_config`` (``decoding_type: Draft_Target``, ``max_draft_len`` K,
            ``speculative_model``), written as a ``--extra_llm_api_options`` YAML file.
=========== ==================================================================================

When ``tuned.json`` holds a ``batch_schedule`` (K, or threshold and SL_max, per batch size), each
file also gets ``batch_schedule`` in that engine's own form, with the predicted speedup per batch
size: TensorRT-LLM ``draft_len_schedule``, vLLM ``num_speculative_tokens_per_batch_size``, SGLang
adaptive-speculation tiers (``--speculative-adaptive-config``), llama.cpp one setting per
``--parallel`` (it has no schedule). :func:`validate_engine_file` checks a written file against
the schema each engine documents.

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
from specstop.pair.convert import gguf_source

ENGINES = ("hf", "vllm", "llamacpp", "sglang", "trtllm")
#: Which tuned policies each engine can express (in tuned.json names).
_SUPPORTED = {
    "hf": ("static_opt", "heuristic_opt", "confidence_opt"),
    "vllm": ("static_opt", "heuristic_opt", "confidence_opt"),
    "llamacpp": ("static_opt", "confidence_opt"),
    "sglang": ("static_opt",),
    "trtllm": ("static_opt",),
}
#: Engines whose settings file carries the tuned batch schedule (HF assisted generation runs batch 1 only).
SCHEDULE_ENGINES = ("vllm", "llamacpp", "sglang", "trtllm")
BATCH_SCHEDULE_FORMAT = 1


def _policy(tuned: dict, name: str) -> dict | None:
    entry = (tuned.get("policies") or {}).get(name)
    if not entry:
        return None
    return {"name": name, "spec": entry["spec"], "validation": entry.get("validation") or {}}


def _prediction(entry: dict) -> dict:
    v = entry["validation"]
    keys = ("speedup", "latency_per_token", "tokens_per_round", "accepted_per_round", "verification_rate", "discard_rate")
    return {k: v.get(k) for k in keys if k in v}


def _stats(entry: dict) -> dict:
    """An option's price-free statistics (:mod:`specstop.eval.price_free`): what the replay counted for
    the policy's candidates, so another cost table - this engine's own - re-prices it with no data."""
    return {"stats": entry["stats"]} if entry.get("stats") else {}


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


def _hf(entry: dict, settings_file: str) -> dict:
    from specstop.export.hf_format import hf_settings_from_spec

    # Set on the draft model, not passed to generate(): see HF_NOTE.
    return {"assistant_generation_config": hf_settings_from_spec(entry["spec"]),
            "usage": hf_usage(settings_file, entry["name"])}


#: vLLM loads this class as its proposer (``speculative_config = {"method": "custom_class", "model": ...}``):
#: drafts from the draft model, each stopped where a specstop policy says.
VLLM_PROPOSER_CLASS = "specstop.decode.vllm_proposer.SpecstopProposer"
#: The ``additional_config`` key that holds that proposer's settings: ``{"draft": DRAFT, "policy": POLICY}``.
VLLM_SETTINGS_KEY = "specstop"
VLLM_PROPOSER_NOTE = (
    "runs specstop's proposer inside vLLM (speculative_config method custom_class): install specstop into vLLM's "
    "environment (pip install specstop, no extras); it drafts with the draft model through transformers, one request "
    "after another, and vLLM verifies every draft (lossless)"
)


def _vllm_command(target: str, conf: dict, additional: dict | None = None) -> str:
    cmd = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(conf))}"
    if additional is not None:
        cmd += f" --additional-config {shlex.quote(json.dumps(additional))}"
    return cmd


def vllm_proposer_config(draft: str, policy: dict | str, cap: int, *, draft_quant: str | None = None,
                         schedule: list | None = None) -> tuple[dict, dict]:
    """``(speculative_config, additional_config)`` that run :data:`VLLM_PROPOSER_CLASS` with ``policy`` (a rule's
    policy spec dict, or a learned policy's export folder) on ``draft``; ``cap`` (SL_max) is vLLM's
    ``num_speculative_tokens``, the most any draft may hold. ``draft_quant`` ("int8", "int4"): the
    proposer quantizes the draft's weights when it loads it (``specstop.pair.quantize``). ``schedule``:
    ``[[lo, hi, K], ...]``, vLLM's ``num_speculative_tokens_per_batch_size``, a cap on each draft by the
    number of requests in the step (K = 0: no drafts at those batch sizes)."""
    conf = {"method": "custom_class", "model": VLLM_PROPOSER_CLASS, "num_speculative_tokens": int(cap)}
    if schedule:
        conf["num_speculative_tokens_per_batch_size"] = [[int(a), int(b), min(int(k), int(cap))] for a, b, k in schedule]
    settings: dict = {"draft": draft, "policy": policy}
    if draft_quant:
        settings["draft_quant"] = draft_quant
    return conf, {VLLM_SETTINGS_KEY: settings}


def _vllm(entry: dict, draft: str, target: str, draft_quant: str | None = None) -> dict:
    spec = entry["spec"]
    if spec["kind"] == "static" and not draft_quant:  # vLLM's own draft-model proposer runs a fixed K
        conf = {"model": draft, "num_speculative_tokens": spec["k"]}
        return {"speculative_config": conf, "command": _vllm_command(target, conf)}
    from specstop.policy import PolicySpec

    conf, additional = vllm_proposer_config(draft, spec, PolicySpec.from_dict(spec).cap, draft_quant=draft_quant)
    return {"speculative_config": conf, "additional_config": additional,
            "command": _vllm_command(target, conf, additional), "note": VLLM_PROPOSER_NOTE}


def _vllm_runner_costs(tuned: dict) -> tuple[dict | None, dict[int, float]]:
    """vLLM's own draft-model runner's measured steps (``fit["vllm_runner"]`` of a cost model from
    ``calibrate-cost --engine vllm``; None without) and the static replay's tokens per round by K."""
    runner = ((tuned.get("cost_model") or {}).get("fit") or {}).get("vllm_runner")
    entry = _policy(tuned, "static_opt")
    if not runner or entry is None:
        return None, {}
    valid = entry["validation"]
    per_k = {int(r["k"]): r.get("tokens_per_round") for r in (valid.get("search") or {}).get("per_k", [])}
    tuned_k = int(entry["spec"]["k"])
    per_k[tuned_k] = per_k.get(tuned_k) or valid.get("tokens_per_round")
    return runner, {k: v for k, v in sorted(per_k.items()) if v}


def _runner_prices(tuned: dict, batch_size: int) -> dict[int, float]:
    """{K: predicted speedup} of vLLM's draft-model runner at ``batch_size`` rows, every K it was timed at."""
    from specstop.eval.cost import runner_speedup

    runner, per_k = _vllm_runner_costs(tuned)
    return {k: speed for k, tpr in per_k.items() if (speed := runner_speedup(runner, k, tpr, batch_size))}


def _price_vllm_runner(options: dict, tuned: dict, draft: str, target: str) -> None:
    """vLLM runs a static option with its own draft-model runner, not specstop's proposer. Where
    ``calibrate-cost --engine vllm`` timed that runner (``fit["vllm_runner"]``), every K the tuning
    replayed is repriced with the runner's own decode steps at batch size 1, static_opt runs the K that
    is best there, and ``predicted_by_k`` lists the price of each K."""
    opt = options.get("static_opt")
    if opt is None or (opt.get("speculative_config") or {}).get("method") == "custom_class":
        return  # none, or run through specstop's proposer (a quantized draft)
    by_k = _runner_prices(tuned, 1)
    if not by_k:
        return
    best, tuned_k = max(by_k, key=by_k.__getitem__), int(opt["policy"]["k"])
    conf = {"model": draft, "num_speculative_tokens": best}
    opt.update(speculative_config=conf, command=_vllm_command(target, conf), policy={**opt["policy"], "k": best})
    opt["predicted"] = {"speedup": by_k[best], "tokens_per_round": _vllm_runner_costs(tuned)[1][best],
                        "priced_by": RUNNER_PRICED}
    opt["predicted_by_k"] = {str(k): v for k, v in by_k.items()}
    if best != tuned_k:
        opt["k_note"] = (f"K = {best}: the best fixed K for vLLM's own draft-model runner at its measured steps "
                         f"(tune's K = {tuned_k} was priced for specstop's proposer)")


#: How the options vLLM runs itself are priced where its draft-model runner was timed.
RUNNER_PRICED = ("vLLM's own draft-model runner, its decode step timed at each K and without speculation by "
                 "`specstop calibrate-cost --engine vllm`")


def _runner_schedule(sched: dict, tuned: dict) -> dict:
    """The batch schedule as vLLM's draft-model runner should run it: at each tuned batch size where that
    runner was timed, the K best at its own steps (0 where none beats no speculation), priced by them;
    batch sizes it was not timed at keep the tuned K and price (``runner_priced`` False)."""
    entries = []
    for e in sched["entries"]:
        by_k = _runner_prices(tuned, e["batch_size"])
        if not by_k:
            entries.append({**e, "runner_priced": False})
            continue
        best = max(by_k, key=by_k.__getitem__)
        k, speed = (best, by_k[best]) if by_k[best] > 1.0 else (0, 1.0)
        entries.append({**e, "k": k, "predicted_speedup": speed, "runner_priced": True,
                        "predicted_speedup_by_k": {"0": 1.0, **{str(kk): v for kk, v in by_k.items()}}})
    return {**sched, "entries": entries}


def _vllm_learned(entry: dict, draft: str, target: str, export: str) -> dict:
    from specstop.policy import PolicySpec

    conf, additional = vllm_proposer_config(draft, export, PolicySpec.from_dict(entry["spec"]).cap)
    return {"speculative_config": conf, "additional_config": additional,
            "command": _vllm_command(target, conf, additional), "note": VLLM_PROPOSER_NOTE}


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


def llamacpp_rule_prediction(tuned: dict, spec: dict) -> dict | None:
    """A threshold policy's prediction under llama.cpp's own p_min rule: the replay of the tuning split in
    which a draft ends *before* the token that fails the threshold (its draft step still paid), priced by
    the tuned file's cost model. None when the tuning dataset is not at hand (the file then keeps the
    tuned prediction of specstop's rule, and a caveat says how llama.cpp differs)."""
    from specstop.errors import MissingInputError
    from specstop.eval.cost import load_cost_model
    from specstop.eval.episodes import load_replay_data
    from specstop.eval.replay import replay
    from specstop.policy import PolicySpec

    dataset, split = tuned.get("dataset"), tuned.get("split") or "validation"
    if not dataset or not tuned.get("cost_model") or not Path(dataset).is_dir():
        return None
    try:
        data = load_replay_data(dataset, split)
    except (MissingInputError, OSError, KeyError, ValueError):
        return None
    policy = PolicySpec.from_dict(spec)
    metrics = replay(data, policy, drop_failing=True).metrics(load_cost_model(tuned["cost_model"]).for_policy(policy))
    return _prediction({"validation": metrics})


def _llamacpp(entry: dict, draft: str, target: str, tuned: dict) -> dict:
    flags = llamacpp_flags(entry["spec"])
    base = ["llama-server", "-m", target, "-md", draft, "--temp", "0"]
    out = {"flags": flags, "flags_legacy": llamacpp_flags(entry["spec"], legacy=True),
           "command": shlex.join(base + flags), "caveat": None}
    if entry["spec"]["kind"] != "confidence":
        return out
    own = llamacpp_rule_prediction(tuned, entry["spec"])
    if own is None:
        out["caveat"] = ("llama.cpp ends a draft *before* a token whose probability is below --spec-draft-p-min; "
                         "specstop's confidence rule drafts that token and stops after it, so with a threshold the "
                         "engine drafts up to one token fewer per round than the replay assumed (the tuning dataset "
                         "was not at hand to replay llama.cpp's rule)")
        return out
    out["predicted"] = own
    out["predicted_specstop_rule"] = _prediction(entry)
    out["caveat"] = ("predicted under llama.cpp's rule: a draft ends *before* a token whose probability is below "
                     "--spec-draft-p-min, its draft step paid (the tuning split replayed that way); specstop's "
                     "confidence rule, which proposes that token and stops after it, is predicted_specstop_rule")
    return out


#: trtllm-serve reads LLM API options from a YAML file (``--extra_llm_api_options``; newer releases
#: also accept ``--config``). ``Draft_Target`` is DraftTargetDecodingConfig's ``decoding_type``.
TRTLLM_DECODING_TYPE = "Draft_Target"


def side_file(folder: str | None, name: str) -> str:
    """A file written beside the settings file, as commands name it: its path in ``folder`` (so a copied
    command runs from any directory), or the bare name when the folder is not known."""
    return str(Path(folder) / name) if folder else name


def trtllm_options_file(name: str) -> str:
    """The YAML file ``write_engine_settings`` writes next to trtllm.json for option ``name``."""
    return f"trtllm_{name}.yaml"


def _trtllm_command(target: str, name: str, folder: str | None) -> str:
    return shlex.join(["trtllm-serve", "serve", target, "--backend", "pytorch",
                       "--extra_llm_api_options", side_file(folder, trtllm_options_file(name))])


def _trtllm(entry: dict, draft: str, target: str, folder: str | None) -> dict:
    k = entry["spec"]["k"]
    conf = {"decoding_type": TRTLLM_DECODING_TYPE, "max_draft_len": k, "speculative_model": draft}
    return {"llm_api_options": {"speculative_config": conf}, "command": _trtllm_command(target, entry["name"], folder)}


def _sglang(entry: dict, draft: str, target: str) -> dict:
    k = entry["spec"]["k"]
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    return {"flags": flags, "command": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, *flags])}


# ------------------------------------------------------------------------------------------------
# Batch schedules: tuned.json "batch_schedule" -> each engine's own per-batch-size form
# ------------------------------------------------------------------------------------------------

_FIX_SCHEDULE = "rerun `specstop tune` to rewrite tuned.json's batch_schedule"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN != NaN


def read_batch_schedule(tuned: dict) -> dict | None:
    """The validated ``batch_schedule`` of a tuned file, or None when it has none.

    Returns:
        ``{"cost_model", "entries": [{"batch_size", "k", "predicted_speedup", "predicted_speedup_by_k",
        "threshold"}, ...]}`` with batch sizes ascending.

    Raises:
        UserError: an unknown format, or an entry with a missing or ill-typed field.
    """
    sched = tuned.get("batch_schedule")
    if sched is None:
        return None
    where = "tuned.json batch_schedule"
    if not isinstance(sched, dict) or sched.get("format") != BATCH_SCHEDULE_FORMAT:
        got = sched.get("format") if isinstance(sched, dict) else type(sched).__name__
        raise UserError(f"{where}: format {got!r} is not {BATCH_SCHEDULE_FORMAT}; {_FIX_SCHEDULE} with this specstop")
    entries = sched.get("entries")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: 'entries' must be a non-empty list; {_FIX_SCHEDULE}")
    out, prev = [], 0
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise UserError(f"{where}: entry {i} is not an object; {_FIX_SCHEDULE}")
        b, k = e.get("batch_size"), e.get("k")
        if not _is_int(b) or b < 1:
            raise UserError(f"{where}: entry {i} batch_size {b!r} is not a positive integer; {_FIX_SCHEDULE}")
        if b <= prev:
            raise UserError(f"{where}: batch sizes must ascend, got {b} after {prev}; {_FIX_SCHEDULE}")
        if not _is_int(k) or k < 0:
            raise UserError(f"{where}: batch size {b} has k {k!r}, not an integer >= 0; {_FIX_SCHEDULE}")
        speed = e.get("predicted_speedup")
        if speed is not None and (not _is_num(speed) or speed <= 0):
            raise UserError(f"{where}: batch size {b} predicted_speedup {speed!r} is not a positive number; {_FIX_SCHEDULE}")
        by_k = e.get("predicted_speedup_by_k") or {}
        if not isinstance(by_k, dict):
            raise UserError(f"{where}: batch size {b} predicted_speedup_by_k must map K to a speedup; {_FIX_SCHEDULE}")
        thr = e.get("threshold")
        if thr is not None:
            if not isinstance(thr, dict) or not _is_num(thr.get("threshold")) or not 0.0 <= thr["threshold"] <= 1.0 \
                    or not _is_int(thr.get("sl_max")) or thr["sl_max"] < 1:
                raise UserError(f"{where}: batch size {b} threshold must be null or {{threshold in [0, 1], sl_max >= 1, "
                                f"predicted_speedup}}, got {thr!r}; {_FIX_SCHEDULE}")
        out.append({"batch_size": b, "k": k, "predicted_speedup": speed,
                    "predicted_speedup_by_k": {str(kk): v for kk, v in by_k.items()}, "threshold": thr})
        prev = b
    return {"cost_model": sched.get("cost_model"), "entries": out}


def _speedup_at(entry: dict, k: int) -> float | None:
    """The predicted speedup of running K = ``k`` at this entry's batch size (None when not priced)."""
    if k == entry["k"]:
        return entry["predicted_speedup"]
    return entry["predicted_speedup_by_k"].get(str(k))


def _schedule_rows(sched: dict, ks: list[int]) -> list[dict]:
    """Per batch size: the K the engine runs and its predicted speedup (the tuned one unless K was changed)."""
    rows = []
    for e, k in zip(sched["entries"], ks):
        row = {"batch_size": e["batch_size"], "k": k, "predicted_speedup": _speedup_at(e, k)}
        if k != e["k"]:
            row["tuned_k"] = e["k"]
        rows.append(row)
    return rows


def _schedule_trtllm(sched: dict, draft: str, target: str, folder: str | None) -> dict:
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
        "command": _trtllm_command(target, "batch_schedule", folder) if conf else shlex.join(["trtllm-serve", "serve", target]),
        "by_batch_size": _schedule_rows(sched, ks),
        "notes": notes,
    }


def _vllm_ranges(entries: list[dict], k_of) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` of schedule entries, K = ``k_of(entry K)``. Ranges start at
    each tuned batch size and run to the next one; vLLM's lookup gives batch sizes above the last range
    the last K and requires the first range to start at 1."""
    ranges = []
    for i, e in enumerate(entries):
        lo = 1 if i == 0 else e["batch_size"]
        hi = entries[i + 1]["batch_size"] - 1 if i + 1 < len(entries) else e["batch_size"]
        ranges.append([lo, hi, k_of(e["k"])])
    return ranges


def _cap_proposer_by_batch(options: dict, sched: dict, target: str) -> None:
    """Where the tuned batch schedule runs no speculation (K = 0 at batch size B), specstop's proposer options
    draft nothing at B either: ``num_speculative_tokens_per_batch_size`` gives them their SL_max at the
    batch sizes that speculate and 0 at the others (the proposer reads vLLM's lookup the same way)."""
    entries = sched["entries"]
    if all(e["k"] > 0 for e in entries):
        return
    for opt in options.values():
        conf = opt.get("speculative_config") or {}
        if conf.get("method") != "custom_class":
            continue
        cap = int(conf["num_speculative_tokens"])
        conf["num_speculative_tokens_per_batch_size"] = _vllm_ranges(entries, lambda k, cap=cap: cap if k > 0 else 0)
        opt["command"] = _vllm_command(target, conf, opt.get("additional_config"))
        opt["batch_caps_note"] = ("drafts only at the batch sizes where the tuned batch schedule speculates "
                                  "(K = 0 elsewhere: the draft's cost there exceeds what it saves)")


def _schedule_vllm(sched: dict, draft: str, target: str, folder: str | None) -> dict:
    entries = sched["entries"]
    ks = [e["k"] for e in entries]
    k_max = max(ks)
    ranges = _vllm_ranges(entries, lambda k: k)
    notes = ["each range starts at a tuned batch size; batch sizes above the last range keep its K (vLLM's rule)"]
    if entries[0]["batch_size"] > 1:
        notes.append(f"batch sizes below {entries[0]['batch_size']} were not tuned; they use its K")
    if k_max == 0:
        conf = None
        notes.append("the schedule runs no speculation at any batch size: serve without --speculative-config")
        command = shlex.join(["vllm", "serve", target])
    else:
        # num_speculative_tokens is the startup maximum (buffer sizing); the schedule picks K per step.
        conf = {"model": draft, "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": ranges}
        command = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(conf))}"
    return {"speculative_config": conf, "command": command, "by_batch_size": _schedule_rows(sched, ks), "notes": notes}


#: Where ``write_engine_settings`` puts SGLang's adaptive-speculation tiers (a JSON file it reads by path).
SGLANG_ADAPTIVE_FILE = "sglang_adaptive.json"


def _schedule_sglang(sched: dict, draft: str, target: str, folder: str | None) -> dict:
    entries = sched["entries"]
    ks = [e["k"] for e in entries]
    # One candidate per tier pins the step count there: the EMA controller can only pick among
    # candidate_steps. Tier keys are lower bounds; the first must cover batch size 1.
    tiers = {str(1 if i == 0 else e["batch_size"]): {"candidate_steps": [e["k"]]} for i, e in enumerate(entries)}
    start = ks[0] if ks[0] > 0 else max(ks)
    notes = [
        "tier keys are lower bounds (a batch uses the tier with the largest key <= its size); one candidate step "
        "per tier holds the tuned K there, and 0 turns drafting off",
        "SGLang's adaptive controller documents support for EAGLE/EAGLE3 (topk 1); for a STANDALONE draft model "
        "builds without that support log a warning and run the static --speculative-num-steps (the batch-size-1 K)",
    ]
    if start == 0:
        notes.append("the schedule runs no speculation at any batch size: serve without --speculative-algorithm")
        return {"adaptive_config": None, "flags": [], "command": shlex.join(
            ["python", "-m", "sglang.launch_server", "--model-path", target]),
            "by_batch_size": _schedule_rows(sched, ks), "notes": notes}
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", str(start), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(start + 1),
             "--speculative-adaptive", "--speculative-adaptive-config", side_file(folder, SGLANG_ADAPTIVE_FILE)]
    return {"adaptive_config": tiers, "flags": flags,
            "command": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, *flags]),
            "by_batch_size": _schedule_rows(sched, ks), "notes": notes}


def _schedule_llamacpp(sched: dict, draft: str, target: str, folder: str | None) -> dict:
    rows = []
    for e in sched["entries"]:
        thr = e["threshold"]
        base = ["llama-server", "-m", target, "--temp", "0", "--parallel", str(e["batch_size"])]
        if thr is not None:
            spec = {"kind": "confidence", "threshold": thr["threshold"], "sl_max": thr["sl_max"]}
            speed = thr.get("predicted_speedup")
        elif e["k"] > 0:
            spec, speed = {"kind": "static", "k": e["k"]}, e["predicted_speedup"]
        else:
            spec, speed = None, e["predicted_speedup"]
        flags = (["-md", draft, *llamacpp_flags(spec)]) if spec else []
        n_max = spec.get("sl_max", spec.get("k")) if spec else 0  # the draft cap llama.cpp runs (k: --spec-draft-n-max)
        rows.append({"batch_size": e["batch_size"], "k": n_max, "policy": spec, "predicted_speedup": speed,
                     "flags": flags, "command": shlex.join(base + flags)})
    return {
        "by_batch_size": rows,
        "notes": [
            "llama.cpp has no per-batch-size schedule: a server takes one setting for all its --parallel slots; "
            "use the row whose batch size is the --parallel you serve with",
            "rows with a threshold use it as --spec-draft-p-min and SL_max as --spec-draft-n-max (llama.cpp stops "
            "before the low-confidence token; see the options' caveat); rows with K = 0 run without a draft model",
        ],
    }


_SCHEDULE_BUILDERS = {"trtllm": _schedule_trtllm, "vllm": _schedule_vllm, "sglang": _schedule_sglang,
                      "llamacpp": _schedule_llamacpp}


def engine_schedule(sched: dict, engine: str, draft: str, target: str, folder: str | None = None) -> dict:
    """The batch schedule in ``engine``'s form, with the predicted speedup per batch size (``folder``:
    where the side files go, see :func:`side_file`)."""
    body = _SCHEDULE_BUILDERS[engine](sched, draft, target, folder)
    return {"cost_model": sched["cost_model"], "tuned": sched["entries"], **body}


def _pair_names(tuned: dict, manifest: dict | None) -> tuple[str, str]:
    pair = (manifest or {}).get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path") or "DRAFT"
    target = (pair.get("target") or {}).get("name_or_path") or "TARGET"
    return draft, target


def _quant_note(cost_model: dict | None, draft_quant: str) -> dict:
    """The quantized draft the proposer options run, and whether the tuned costs were measured with it."""
    measured = ((cost_model or {}).get("machine") or {}).get("draft_quant")
    note = (f"priced with the {draft_quant} draft's own costs" if measured == draft_quant else
            f"priced with the costs of a {measured or 'float'} draft, not the {draft_quant} one: measure with "
            f"`specstop calibrate-cost --engine vllm --draft-quant {draft_quant}` and tune again")
    return {"scheme": draft_quant, "note": note + "; acceptance replayed from the dataset's (float) draft"}


def priced_by(cost_model: dict | None, engine: str) -> str:
    """One line: whose step costs priced the predictions of ``engine``'s file (the engine's own, measured in
    it by ``specstop calibrate-cost --engine``, or specstop's decoders' and so only an estimate for it)."""
    cost = cost_model or {}
    measured_in = ((cost.get("machine") or {}).get("engine") or "").split(" ")[0]
    name = cost.get("name") or "?"
    if measured_in and measured_in == engine:
        return f"{engine}'s own costs, measured inside {(cost.get('machine') or {}).get('engine')} (cost model {name})"
    if measured_in:
        return (f"{measured_in}'s costs (cost model {name}), not {engine}'s: an estimate for {engine}")
    if cost.get("provenance") == "measured":
        return (f"specstop's transformers decoders' costs on this machine (cost model {name}), not {engine}'s: an "
                f"estimate for {engine}" + ("; `specstop calibrate-cost --engine vllm` measures vLLM's own"
                                            if engine == "vllm" else ""))
    return f"the preset cost model {name} (not measured): an estimate"


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
            it through specstop's proposer (learned predictors only).
        folder: the folder the file is written to: its usage lines and commands name the files there
            (``hf.json``, TensorRT-LLM's YAML, SGLang's tiers) by that path, so they run from any
            directory; None: bare file names.
        draft_quant: vllm only: specstop's proposer runs the draft quantized ("int8", "int4") in the rule
            options; learned options are left out (their features come from the float draft).

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
    folder = str(folder) if folder is not None else None
    options = {}
    for name in _SUPPORTED[engine]:
        entry = _policy(tuned, name)
        if entry is None:
            continue
        body = {
            "hf": lambda e: _hf(e, side_file(folder, "hf.json")),
            "vllm": lambda e: _vllm(e, draft, target, draft_quant),
            "llamacpp": lambda e: _llamacpp(e, gguf_source(draft), gguf_source(target), tuned),  # llama.cpp reads GGUF
            "sglang": lambda e: _sglang(e, draft, target),
            "trtllm": lambda e: _trtllm(e, draft, target, folder),
        }[engine](entry)
        options[name] = {"policy": entry["spec"], "predicted": _prediction(entry), **body, **_stats(entry)}
    if engine in ("hf", "vllm") and hf_export is not None:
        name, export = hf_export
        entry = _policy(tuned, name)
        if entry is not None and engine == "hf":
            options[name] = {"policy": entry["spec"], "predicted": _prediction(entry),
                             "generate_kwargs": {"custom_generate": export, "trust_remote_code": True},
                             "usage": hf_policy_usage(export)}
        elif entry is not None and entry["spec"]["kind"] == "predictor" and not draft_quant:  # vLLM: through our proposer
            options[name] = {"policy": entry["spec"], "predicted": _prediction(entry),
                             **_vllm_learned(entry, draft, target, export)}
    if engine == "vllm" and not draft_quant:
        _price_vllm_runner(options, tuned, draft, target)
    sched = read_batch_schedule(tuned) if engine in SCHEDULE_ENGINES else None
    if engine == "vllm" and sched is not None:
        _cap_proposer_by_batch(options, sched, target)
    if not options and sched is None:
        raise UserError(
            f"the tuned file has none of the policies {engine} can express ({', '.join(_SUPPORTED[engine])}); "
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
    best_entry = _policy(tuned, best) if best else None
    extra = {}
    if sched is not None:
        names = (gguf_source(draft), gguf_source(target)) if engine == "llamacpp" else (draft, target)
        if engine == "vllm" and _runner_prices(tuned, 1):  # vLLM's runner runs it: its own steps price it
            sched = _runner_schedule(sched, tuned)
        extra["batch_schedule"] = engine_schedule(sched, engine, *names, folder=folder)
        priced = [e["batch_size"] for e in sched["entries"] if e.get("runner_priced")]
        if priced:
            extra["batch_schedule"]["notes"].append(
                f"K and predictions at batch sizes {', '.join(map(str, priced))}: {RUNNER_PRICED}"
                + ("; the others: the tuned K under cost_model" if len(priced) < len(sched["entries"]) else ""))
    if engine == "hf":
        extra["note_hf"] = HF_NOTE
    return {
        "engine": engine,
        "recommended": recommended,
        **extra_none,
        "options": options,
        **extra,
        "priced_by": priced_by(tuned.get("cost_model"), engine),
        **({"draft_quant": _quant_note(tuned.get("cost_model"), draft_quant)} if draft_quant else {}),
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
                          target: str | None = None, hf_policy: str | None = None,
                          draft_quant: str | None = None) -> dict[str, Path]:
    """Write ``OUT/<engine>.json`` for each engine. Returns ``{engine: path}``.

    ``hf_policy``: the learned policy exported into ``OUT`` (an hf option through ``custom_generate``; a
    vllm option through specstop's proposer).
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
        _write_side_files(out, engine, settings)
    return paths


def _write_side_files(out: Path, engine: str, settings: dict) -> None:
    """The files an engine reads by path: trtllm-serve's LLM API YAML, SGLang's adaptive tiers."""
    import yaml

    if engine == "trtllm":
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
    if engine == "sglang" and (settings.get("batch_schedule") or {}).get("adaptive_config"):
        atomic_write_text(out / SGLANG_ADAPTIVE_FILE, json.dumps(settings["batch_schedule"]["adaptive_config"], indent=2) + "\n")


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


# ------------------------------------------------------------------------------------------------
# Checking a settings file against what each engine documents
# ------------------------------------------------------------------------------------------------


def _bad(engine: str, what: str) -> UserError:
    return UserError(f"{engine} settings: {what}; re-export with `specstop export --for {engine}` (do not edit by hand)")


def _check_trtllm_conf(conf: Any, where: str) -> None:
    """DraftTargetDecodingConfig (tensorrt_llm/llmapi/llm_args.py): max_draft_len > 0, speculative_model set,
    draft_len_schedule keys >= 1, values >= 0, schedule[smallest key] == max_draft_len, all <= it."""
    if not isinstance(conf, dict):
        raise _bad("trtllm", f"{where}: speculative_config must be an object")
    if conf.get("decoding_type") != TRTLLM_DECODING_TYPE:
        raise _bad("trtllm", f"{where}: decoding_type must be {TRTLLM_DECODING_TYPE!r}, got {conf.get('decoding_type')!r}")
    k = conf.get("max_draft_len")
    if not _is_int(k) or k < 1:
        raise _bad("trtllm", f"{where}: max_draft_len must be an integer > 0 for Draft_Target, got {k!r}")
    if not isinstance(conf.get("speculative_model"), str) or not conf["speculative_model"]:
        raise _bad("trtllm", f"{where}: speculative_model must name the draft model")
    sched = conf.get("draft_len_schedule")
    if sched is None:
        return
    if not isinstance(sched, dict) or not sched:
        raise _bad("trtllm", f"{where}: draft_len_schedule must be a non-empty {{batch size: draft length}} map")
    keys = []
    for b, v in sched.items():
        try:
            bi = int(b)
        except (TypeError, ValueError):
            raise _bad("trtllm", f"{where}: draft_len_schedule key {b!r} is not a batch size") from None
        if bi < 1 or str(bi) != str(b).strip():
            raise _bad("trtllm", f"{where}: draft_len_schedule batch size {b!r} must be an integer >= 1")
        if not _is_int(v) or v < 0 or v > k:
            raise _bad("trtllm", f"{where}: draft length {v!r} at batch size {bi} must be an integer in [0, max_draft_len {k}]")
        keys.append(bi)
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise _bad("trtllm", f"{where}: draft_len_schedule batch sizes must ascend, got {keys}")
    if sched[next(iter(sched))] != k:
        raise _bad("trtllm", f"{where}: draft_len_schedule at the smallest batch size must equal max_draft_len {k}")


def _check_vllm_proposer(conf: dict, additional: Any, where: str) -> None:
    """specstop's proposer: vLLM's custom_class method naming :data:`VLLM_PROPOSER_CLASS`, and
    ``additional_config`` with the draft and a policy (a rule's spec, a policy string or an export folder)."""
    if conf.get("model") != VLLM_PROPOSER_CLASS:
        raise _bad("vllm", f"{where}: a custom_class speculative_config must name {VLLM_PROPOSER_CLASS}, "
                   f"got {conf.get('model')!r}")
    settings = additional.get(VLLM_SETTINGS_KEY) if isinstance(additional, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("draft"), str) or not settings["draft"]:
        raise _bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.draft must name the draft model")
    if settings.get("draft_quant") is not None:
        from specstop.pair.quantize import SCHEMES

        if settings["draft_quant"] not in SCHEMES:
            raise _bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.draft_quant must be one of "
                       f"{', '.join(SCHEMES)}, got {settings['draft_quant']!r}")
    policy = settings.get("policy")
    if isinstance(policy, dict):
        from specstop.policy import PolicySpec

        try:
            spec = PolicySpec.from_dict(policy)
        except UserError as err:
            raise _bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.policy: {err}") from None
        if spec.kind not in ("static", "heuristic", "confidence"):
            raise _bad("vllm", f"{where}: a {spec.kind!r} policy is given as its export folder, not as its spec")
        if spec.cap > conf["num_speculative_tokens"]:
            raise _bad("vllm", f"{where}: the policy drafts up to {spec.cap} tokens but num_speculative_tokens is "
                       f"{conf['num_speculative_tokens']} (vLLM's cap)")
    elif not isinstance(policy, str) or not policy:
        raise _bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.policy must be a policy spec or an "
                   "export folder")


def _check_vllm_conf(conf: Any, where: str, additional: Any = None) -> None:
    """vllm/config/speculative.py SpeculativeConfig + vllm/v1/spec_decode/dynamic/utils.py: num_speculative_tokens
    > 0; num_speculative_tokens_per_batch_size a list of inclusive [lo, hi, K], lo <= hi, positive, sorted and
    non-overlapping, the first starting at 1, K >= 0 (clamped to num_speculative_tokens). method is absent (a
    draft model) or custom_class (specstop's proposer, with its ``additional_config``)."""
    if not isinstance(conf, dict):
        raise _bad("vllm", f"{where}: speculative_config must be an object")
    if not isinstance(conf.get("model"), str) or not conf["model"]:
        raise _bad("vllm", f"{where}: speculative_config.model must name the draft model")
    if conf.get("method") not in (None, "draft_model", "custom_class"):
        raise _bad("vllm", f"{where}: speculative_config.method must be draft_model or custom_class, got {conf['method']!r}")
    n = conf.get("num_speculative_tokens")
    if not _is_int(n) or n < 1:
        raise _bad("vllm", f"{where}: num_speculative_tokens must be an integer > 0, got {n!r}")
    if conf.get("method") == "custom_class":
        _check_vllm_proposer(conf, additional, where)
    ranges = conf.get("num_speculative_tokens_per_batch_size")
    if ranges is None:
        return
    if not isinstance(ranges, list) or not ranges:
        raise _bad("vllm", f"{where}: num_speculative_tokens_per_batch_size must be a non-empty list of [lo, hi, K]")
    prev_hi = 0
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 3 or not all(_is_int(x) for x in r):
            raise _bad("vllm", f"{where}: schedule entry {r!r} is not [batch lo, batch hi, K] integers")
        lo, hi, kk = r
        if lo < 1 or lo > hi:
            raise _bad("vllm", f"{where}: batch range [{lo}, {hi}] must be positive with lo <= hi")
        if lo <= prev_hi:
            raise _bad("vllm", f"{where}: batch ranges must be sorted and non-overlapping ([{lo}, {hi}] after {prev_hi})")
        if kk < 0 or kk > n:
            raise _bad("vllm", f"{where}: K {kk} for batch sizes [{lo}, {hi}] must be in [0, num_speculative_tokens {n}] "
                       "(vLLM clamps larger values, so the prediction would not hold)")
        prev_hi = hi
    if ranges[0][0] != 1:
        raise _bad("vllm", f"{where}: the first batch range must start at 1, got {ranges[0][0]}")


def _check_sglang(flags: Any, adaptive: Any, where: str) -> None:
    """sglang server args + python/sglang/srt/speculative/adaptive_spec_params.py: integer-string batch-size
    keys, each with a non-empty candidate_steps list of integers >= 0; --speculative-num-steps among them."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise _bad("sglang", f"{where}: flags must be a list of strings")

    def value(flag):
        if flag not in flags or flags.index(flag) + 1 >= len(flags):
            raise _bad("sglang", f"{where}: {flag} is missing")
        return flags[flags.index(flag) + 1]

    if value("--speculative-algorithm") != "STANDALONE":
        raise _bad("sglang", f"{where}: --speculative-algorithm must be STANDALONE for a separate draft model")
    value("--speculative-draft-model-path")
    try:
        steps, topk, ntok = (int(value(f)) for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                     "--speculative-num-draft-tokens"))
    except ValueError:
        raise _bad("sglang", f"{where}: step/topk/draft-token flags must be integers") from None
    if steps < 1 or topk != 1 or ntok != steps + 1:
        raise _bad("sglang", f"{where}: need --speculative-num-steps >= 1, --speculative-eagle-topk 1 and "
                   f"--speculative-num-draft-tokens = steps + 1, got {steps}, {topk}, {ntok}")
    if adaptive is None:
        return
    if "--speculative-adaptive" not in flags:
        raise _bad("sglang", f"{where}: an adaptive config needs --speculative-adaptive")
    if not isinstance(adaptive, dict) or not adaptive:
        raise _bad("sglang", f"{where}: the adaptive config must map batch sizes to {{candidate_steps: [...]}}")
    keys, union = [], set()
    for key, tier in adaptive.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) < 1:
            raise _bad("sglang", f"{where}: adaptive tier key {key!r} must be a batch size written as digits")
        cand = tier.get("candidate_steps") if isinstance(tier, dict) else None
        if not isinstance(cand, list) or not cand or not all(_is_int(c) and c >= 0 for c in cand):
            raise _bad("sglang", f"{where}: tier {key} candidate_steps must be a non-empty list of integers >= 0")
        keys.append(int(key))
        union.update(cand)
    if keys != sorted(keys) or keys[0] != 1:
        raise _bad("sglang", f"{where}: adaptive tier batch sizes must ascend from 1, got {keys}")
    if steps not in union:
        raise _bad("sglang", f"{where}: --speculative-num-steps {steps} is not among the tiers' candidate_steps "
                   f"{sorted(union)} (SGLang refuses that)")


def _check_llamacpp_flags(flags: Any, where: str) -> None:
    """llama.cpp common/arg.cpp: --spec-draft-n-max N (>= 1), --spec-draft-n-min 0, --spec-draft-p-min P in [0, 1]."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise _bad("llamacpp", f"{where}: flags must be a list of strings")
    if not flags:
        return
    try:
        n_max = int(flags[flags.index("--spec-draft-n-max") + 1])
        p_min = float(flags[flags.index("--spec-draft-p-min") + 1])
        n_min = int(flags[flags.index("--spec-draft-n-min") + 1])
    except (ValueError, IndexError):
        raise _bad("llamacpp", f"{where}: --spec-draft-n-max/-n-min/-p-min need numeric values") from None
    if n_max < 1 or n_min != 0 or not 0.0 <= p_min <= 1.0:
        raise _bad("llamacpp", f"{where}: need --spec-draft-n-max >= 1, --spec-draft-n-min 0, --spec-draft-p-min in "
                   f"[0, 1], got {n_max}, {n_min}, {p_min}")


def _check_schedule_rows(engine: str, rows: Any) -> None:
    if not isinstance(rows, list) or not rows:
        raise _bad(engine, "batch_schedule.by_batch_size must be a non-empty list")
    prev = 0
    for r in rows:
        b, k, speed = r.get("batch_size"), r.get("k"), r.get("predicted_speedup")
        if not _is_int(b) or b <= prev:
            raise _bad(engine, f"batch_schedule batch sizes must be integers ascending from >= 1, got {b!r} after {prev}")
        if not _is_int(k) or k < 0:
            raise _bad(engine, f"batch_schedule K at batch size {b} must be an integer >= 0, got {k!r}")
        if speed is not None and (not _is_num(speed) or speed <= 0):
            raise _bad(engine, f"batch_schedule predicted speedup at batch size {b} must be positive, got {speed!r}")
        prev = b


def validate_engine_file(engine: str, data: Any) -> None:
    """Check a settings file (``<engine>.json`` content) against the schema the engine documents.

    Checks, per engine: HF - the three generation-config fields (types, ranges, schedule names) or
    a ``custom_generate`` folder; vLLM - ``speculative_config`` and ``num_speculative_tokens_per_batch_size``, and
    for specstop's proposer its ``additional_config``;
    TensorRT-LLM - the ``Draft_Target`` speculative config and ``draft_len_schedule``; SGLang - the
    STANDALONE flags and the adaptive tiers; llama.cpp - the draft flags. For a batch schedule:
    batch sizes ascending, K integers >= 0, predicted speedups positive.

    Raises:
        UserError: the first violation, naming the field and the fix.
    """
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if not isinstance(data, dict) or data.get("engine") != engine:
        raise _bad(engine, f"not a {engine} settings file (its 'engine' is {data.get('engine') if isinstance(data, dict) else None!r})")
    options = data.get("options")
    if not isinstance(options, dict):
        raise _bad(engine, "'options' must be an object")
    if data.get("recommended") is not None and data["recommended"] not in options:
        raise _bad(engine, f"recommended option {data['recommended']!r} is not among the options")
    for name, opt in options.items():
        where = f"option {name}"
        if not isinstance(opt, dict) or not isinstance(opt.get("predicted"), dict):
            raise _bad(engine, f"{where} lacks its 'predicted' metrics")
        if engine == "hf":
            if "assistant_generation_config" in opt:
                from specstop.export.hf_format import check_hf_settings

                try:
                    check_hf_settings(opt["assistant_generation_config"])
                except UserError as err:
                    raise _bad(engine, f"{where}: {err}") from None
            elif not (opt.get("generate_kwargs") or {}).get("custom_generate"):
                raise _bad(engine, f"{where} has neither assistant_generation_config nor a custom_generate folder")
        elif engine == "vllm":
            _check_vllm_conf(opt.get("speculative_config"), where, opt.get("additional_config"))
        elif engine == "trtllm":
            _check_trtllm_conf((opt.get("llm_api_options") or {}).get("speculative_config"), where)
        elif engine == "sglang":
            _check_sglang(opt.get("flags"), None, where)
        elif engine == "llamacpp":
            _check_llamacpp_flags(opt.get("flags"), where)
    sched = data.get("batch_schedule")
    if sched is None:
        return
    if engine not in SCHEDULE_ENGINES:
        raise _bad(engine, "this engine takes no batch schedule")
    _check_schedule_rows(engine, sched.get("by_batch_size"))
    where = "batch_schedule"
    if engine == "vllm" and sched.get("speculative_config") is not None:
        _check_vllm_conf(sched["speculative_config"], where)
    elif engine == "trtllm" and (sched.get("llm_api_options") or {}).get("speculative_config") is not None:
        _check_trtllm_conf(sched["llm_api_options"]["speculative_config"], where)
    elif engine == "sglang" and sched.get("adaptive_config") is not None:
        _check_sglang(sched.get("flags"), sched["adaptive_config"], where)
    elif engine == "llamacpp":
        for row in sched["by_batch_size"]:
            _check_llamacpp_flags(row.get("flags"), f"{where} batch size {row['batch_size']}")
