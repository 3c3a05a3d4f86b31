"""vLLM: ``speculative_config.num_speculative_tokens`` = static K for vLLM's own draft-model proposer; the
confidence and learned policies inside that same batched runner, stopped per request by specstop
(``worker_cls``: :mod:`specstop.decode.vllm_worker`), and with a quantized draft (``--draft-quant``) every
rule there too, the draft's layers packed as vLLM loads it; the heuristic schedule through specstop's
proposer class (``method: custom_class``, :mod:`specstop.decode.vllm_proposer`); both set up by
``additional_config``; the batch schedule as
``num_speculative_tokens_per_batch_size``. Where ``calibrate-cost --engine vllm`` timed vLLM's draft-model
runner, the options vLLM runs itself are re-priced with those steps."""

from __future__ import annotations

import json
import shlex
from typing import Any

from specstop.errors import UserError
from specstop.export.engines.base import Context, Engine, bad, is_int, policy_entry
from specstop.export.engines.pricing import schedule_rows

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
#: vLLM's worker class that runs specstop's stop inside vLLM's own batched draft-model runner.
VLLM_WORKER_CLASS = "specstop.decode.vllm_worker.SpecstopWorker"
VLLM_RUNNER_NOTE = (
    "runs specstop's stop inside vLLM's own draft-model runner (worker_cls): install specstop into vLLM's "
    "environment (pip install specstop, no extras); the draft runs batched on vLLM's kernels and cache, each "
    "request's draft stops where its policy says (its own sampling setting's entry), and vLLM verifies every draft "
    "(lossless); per batch size it drafts only where its own timing of the engine's steps says drafting pays "
    "(\"speculation_gate\": false in additional_config.specstop keeps the caps alone); needs async scheduling off "
    "(the CPU build has none)"
)
#: Why a schedule's K = 0 is written as K = 1 for vLLM's own draft-model path.
DRAFT_PATH_K0_NOTE = (
    "K = 0 inside a speculative_config is not serving without speculation in vLLM's draft-model path: vLLM still "
    "runs the draft over each row's new tokens every step, to keep the draft's KV cache in step, and the target "
    "verifies nothing for that cost; so where the tuned schedule drafts nothing (and another batch size does) vLLM's "
    "draft model runs K = 1, one token from the forward that runs anyway (tuned_k 0 marks it)"
)
#: Why specstop's stop in vLLM's runner keeps a schedule's K = 0.
RUNNER_SKIPS_NOTE = (
    "where no request drafts, specstop's stop in vLLM's runner skips the draft's forward (vLLM's own proposer runs "
    "it), and the next step that drafts feeds the draft the tokens it skipped, so its cache is complete again"
)
#: How the options vLLM runs itself are priced where its draft-model runner was timed.
RUNNER_PRICED = ("vLLM's own draft-model runner, its decode step timed at each K and without speculation by "
                 "`specstop calibrate-cost --engine vllm`")


def _vllm_command(target: str, conf: dict, additional: dict | None = None, worker_cls: str | None = None) -> str:
    cmd = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(conf))}"
    if additional is not None:
        cmd += f" --additional-config {shlex.quote(json.dumps(additional))}"
    if worker_cls is not None:
        cmd += f" --worker-cls {shlex.quote(worker_cls)} --no-async-scheduling"
    return cmd


def capped_schedule(schedule: list, cap: int) -> list[list[int]]:
    """``[[lo, hi, K], ...]`` with every K at most ``cap`` (vLLM clamps larger ones, and predictions assume it)."""
    return [[int(a), int(b), min(int(k), int(cap))] for a, b, k in schedule]


def vllm_runner_config(draft: str, policy: dict | str, cap: int, *, draft_quant: str | None = None,
                       schedule: list | None = None) -> dict:
    """The engine settings that run ``policy`` (a rule's policy spec dict, a policy string or a learned
    policy's export folder) inside vLLM's own batched draft-model runner on ``draft``:
    ``{"speculative_config", "additional_config", "worker_cls", "async_scheduling"}``, each an ``LLM``
    keyword. ``cap`` (SL_max) is ``num_speculative_tokens``; ``draft_quant`` ("int8", "int4"; CPU engines):
    the runner packs the draft's layers weight-only as vLLM loads it (:mod:`specstop.decode.vllm_draft_quant`);
    ``schedule`` caps the drafts per batch size as vLLM's ``num_speculative_tokens_per_batch_size`` does for
    its own runner."""
    conf = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(cap)}
    if schedule:
        conf["num_speculative_tokens_per_batch_size"] = capped_schedule(schedule, cap)
    settings: dict = {"policy": policy}
    if draft_quant:
        settings["draft_quant"] = draft_quant
    return {"speculative_config": conf, "additional_config": {VLLM_SETTINGS_KEY: settings},
            "worker_cls": VLLM_WORKER_CLASS, "async_scheduling": False}


def _runner_option(draft: str, target: str, policy: dict | str, cap: int, draft_quant: str | None = None) -> dict:
    opt = vllm_runner_config(draft, policy, cap, draft_quant=draft_quant)
    return {**opt, "command": _vllm_command(target, opt["speculative_config"], opt["additional_config"],
                                            opt["worker_cls"]), "note": VLLM_RUNNER_NOTE}


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
        conf["num_speculative_tokens_per_batch_size"] = capped_schedule(schedule, cap)
    settings: dict = {"draft": draft, "policy": policy}
    if draft_quant:
        settings["draft_quant"] = draft_quant
    return conf, {VLLM_SETTINGS_KEY: settings}


def _option(entry: dict, ctx: Context) -> dict:
    spec = entry["spec"]
    if spec["kind"] == "static" and not ctx.draft_quant:  # vLLM's own draft-model proposer runs a fixed K
        conf = {"model": ctx.draft, "num_speculative_tokens": spec["k"]}
        return {"speculative_config": conf, "command": _vllm_command(ctx.target, conf)}
    from specstop.policy import PolicySpec

    cap = PolicySpec.from_dict(spec).cap
    # Per request, inside vLLM's own batched runner, a quantized draft too: specstop's proposer drafts one
    # request after another, and on held-out prompts it ran at 0.42-0.88x of no speculation at batch sizes 2-8
    # where the runner ran at 0.87-0.99x, and no faster at batch size 1 (docs/results/vllm_serving.md, "A tenth run").
    if spec["kind"] == "confidence" or (spec["kind"] == "static" and ctx.draft_quant):
        return _runner_option(ctx.draft, ctx.target, spec, cap, ctx.draft_quant)
    conf, additional = vllm_proposer_config(ctx.draft, spec, cap, draft_quant=ctx.draft_quant)
    return {"speculative_config": conf, "additional_config": additional,
            "command": _vllm_command(ctx.target, conf, additional), "note": VLLM_PROPOSER_NOTE}


def _learned(entry: dict, export: str, ctx: Context) -> dict | None:
    """A learned predictor inside vLLM's own draft-model runner, on the draft its features were read from: the
    float draft, or with ``--draft-quant`` an export trained on that quantized draft's data (`specstop generate
    --draft-quant`); None otherwise (the runner would refuse it)."""
    if entry["spec"]["kind"] != "predictor":
        return None
    from specstop.export.reading import export_draft_quant
    from specstop.policy import PolicySpec

    if (export_draft_quant(export) or None) != ctx.draft_quant:
        return None
    return _runner_option(ctx.draft, ctx.target, export, PolicySpec.from_dict(entry["spec"]).cap, ctx.draft_quant)


# ---------------------------------------------------------------- costs: vLLM's own draft-model runner


def _vllm_runner_costs(tuned: dict) -> tuple[dict | None, dict[int, float]]:
    """vLLM's own draft-model runner's measured steps (``fit["vllm_runner"]`` of a cost model from
    ``calibrate-cost --engine vllm``; None without) and the static replay's tokens per round by K."""
    runner = ((tuned.get("cost_model") or {}).get("fit") or {}).get("vllm_runner")
    entry = policy_entry(tuned, "static_opt")
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
    if opt is None or opt.get("worker_cls") or (opt.get("speculative_config") or {}).get("method") == "custom_class":
        return  # none, or run by specstop (a quantized draft): not vLLM's own fixed-K runner
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


def _runner_schedule(sched: dict, tuned: dict) -> dict:
    """The batch schedule as vLLM's draft-model runner should run it: at each tuned batch size where that
    runner was timed, the K best at its own steps (0 where none beats no speculation, which :func:`_schedule`
    writes as K = 1 when another batch size speculates: :data:`DRAFT_PATH_K0_NOTE`), priced by them; batch
    sizes it was not timed at keep the tuned K and price (``runner_priced`` False)."""
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


def _draft_path_k(k: int, speculates: bool) -> int:
    """The K vLLM's draft-model path runs for a schedule's K: 1 where the schedule drafts nothing but
    ``speculates`` at some other batch size (:data:`DRAFT_PATH_K0_NOTE`), else K itself."""
    return 1 if k == 0 and speculates else k


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


#: How specstop's stop in vLLM's runner is capped per batch size where that runner was timed.
RUNNER_CAPS_NOTE = (
    "above batch size 1 each batch size's drafts are capped at the fixed K that vLLM's own draft-model runner runs "
    "best there (its steps timed by `specstop calibrate-cost --engine vllm`): a batched draft round lasts as long as "
    "its longest draft, so rows past that K cost every row a draft forward (none where no K beats no speculation); "
    "at batch size 1 the policy's own SL_max"
)


#: The same where the cost model itself was timed in specstop's runner (``calibrate-cost --engine vllm``, its
#: default ``--vllm-path runner``): the tuned schedule's K at each batch size is that runner's best fixed K.
RUNNER_SWEPT_CAPS_NOTE = (
    "above batch size 1 each batch size's drafts are capped at the tuned batch schedule's K, priced by the costs "
    "`specstop calibrate-cost --engine vllm` timed in this runner (every request drafting K tokens, batched): a "
    "batched draft round lasts as long as its longest draft, so rows past that K cost every row a draft forward "
    "(none where no K beats no speculation); at batch size 1 the policy's own SL_max"
)


def swept_in_runner(tuned: dict) -> bool:
    """The tuned file's costs were timed in specstop's stop inside vLLM's batched draft runner."""
    return ((tuned.get("cost_model") or {}).get("machine") or {}).get("vllm_path") == "runner"


def _runner_caps(entries: list[dict], runner_entries: list[dict] | None, cap: int,
                 note: str = RUNNER_CAPS_NOTE) -> tuple[list[int], str | None]:
    """Per schedule entry, the cap of specstop's stop in vLLM's runner, and the note that explains it.

    Where vLLM's runner was timed (``runner_entries`` marked ``runner_priced``): SL_max at batch size 1,
    elsewhere the runner's best K there (0 where no K beats no speculation: :data:`RUNNER_SKIPS_NOTE`) and at
    most SL_max; ``note`` says how it was timed. Elsewhere SL_max where the tuned schedule speculates, 0 where
    it does not (None: no cap needed).
    """
    runner_entries = runner_entries or [{} for _ in entries]
    caps, timed = [], False
    for e, r in zip(entries, runner_entries):
        if not r.get("runner_priced"):
            caps.append(cap if e["k"] > 0 else 0)
        elif e["batch_size"] == 1:
            caps.append(cap)
        else:
            caps.append(min(cap, int(r["k"])))
            timed = True
    skips = f"; {RUNNER_SKIPS_NOTE}" if 0 in caps else ""
    if timed:
        return caps, note + skips
    if all(c == cap for c in caps):
        return caps, None
    if not any(caps):
        return caps, "drafts nothing: the tuned batch schedule speculates at no batch size (serve without speculation)"
    return caps, f"drafts its SL_max only at the batch sizes where the tuned batch schedule speculates{skips}"


def _cap_proposer_by_batch(options: dict, sched: dict, target: str, runner_sched: dict | None, tuned: dict) -> None:
    """Where the tuned batch schedule runs no speculation (K = 0 at batch size B), specstop's proposer options
    draft nothing at B either: ``num_speculative_tokens_per_batch_size`` gives them their SL_max at the
    batch sizes that speculate and 0 at the others (the proposer reads vLLM's lookup the same way). The
    stop in vLLM's runner is capped by :func:`_runner_caps`: by the runner's own best K where
    ``runner_sched`` (the schedule re-priced with vLLM's runner steps) timed it, or where ``tuned``'s cost model
    was timed in specstop's runner itself (:func:`swept_in_runner`: the schedule's own K)."""
    entries = sched["entries"]
    runner_note = RUNNER_CAPS_NOTE
    if runner_sched is None and swept_in_runner(tuned):
        # the tuned schedule was priced by the runner's own batched costs: its K is the runner's best there
        runner_sched, runner_note = {"entries": [{**e, "runner_priced": True} for e in entries]}, RUNNER_SWEPT_CAPS_NOTE
    for opt in options.values():
        conf = opt.get("speculative_config") or {}
        cap = int(conf.get("num_speculative_tokens") or 0)
        if opt.get("worker_cls"):
            caps, note = _runner_caps(entries, runner_sched and runner_sched["entries"], cap, runner_note)
        elif conf.get("method") == "custom_class" and not all(e["k"] > 0 for e in entries):
            caps = [cap if e["k"] > 0 else 0 for e in entries]
            note = ("drafts only at the batch sizes where the tuned batch schedule speculates (K = 0 elsewhere: the "
                    "draft's cost there exceeds what it saves)")
        else:
            continue
        if note is None:
            continue
        conf["num_speculative_tokens_per_batch_size"] = _vllm_ranges(
            [{**e, "k": c} for e, c in zip(entries, caps)], lambda k: k)
        opt["command"] = _vllm_command(target, conf, opt.get("additional_config"), opt.get("worker_cls"))
        opt["batch_caps_note"] = note


def _reprice(options: dict, sched: dict | None, ctx: Context) -> dict | None:
    """Options and schedule under vLLM's own measured runner steps, where they were measured; proposer
    options capped to the batch sizes the schedule speculates at, the stop in vLLM's runner to its best K."""
    if not ctx.draft_quant:
        _price_vllm_runner(options, ctx.tuned, ctx.draft, ctx.target)
    if sched is None:
        return None
    runner_sched = _runner_schedule(sched, ctx.tuned) if _runner_prices(ctx.tuned, 1) else None
    _cap_proposer_by_batch(options, sched, ctx.target, runner_sched, ctx.tuned)
    return runner_sched or sched


def _schedule(sched: dict, draft: str, target: str, folder: str | None) -> dict:
    entries = sched["entries"]
    speculates = any(e["k"] > 0 for e in entries)
    ks = [_draft_path_k(e["k"], speculates) for e in entries]
    k_max = max(ks)
    ranges = _vllm_ranges(entries, lambda k: _draft_path_k(k, speculates))
    notes = ["each range starts at a tuned batch size; batch sizes above the last range keep its K (vLLM's rule)"]
    if ks != [e["k"] for e in entries]:
        notes.append(DRAFT_PATH_K0_NOTE)
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
    priced = [e["batch_size"] for e in entries if e.get("runner_priced")]
    if priced:
        notes.append(f"K and predictions at batch sizes {', '.join(map(str, priced))}: {RUNNER_PRICED}"
                     + ("; the others: the tuned K under cost_model" if len(priced) < len(entries) else ""))
    return {"speculative_config": conf, "command": command, "by_batch_size": schedule_rows(sched, ks), "notes": notes}


# ---------------------------------------------------------------- validation


def _check_proposer(conf: dict, additional: Any, where: str) -> None:
    """specstop's proposer: vLLM's custom_class method naming :data:`VLLM_PROPOSER_CLASS`, and
    ``additional_config`` with the draft and a policy (a rule's spec, a policy string or an export folder)."""
    if conf.get("model") != VLLM_PROPOSER_CLASS:
        raise bad("vllm", f"{where}: a custom_class speculative_config must name {VLLM_PROPOSER_CLASS}, "
                  f"got {conf.get('model')!r}")
    settings = additional.get(VLLM_SETTINGS_KEY) if isinstance(additional, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("draft"), str) or not settings["draft"]:
        raise bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.draft must name the draft model")
    _check_draft_quant(settings, where)
    _check_policy_setting(conf, settings, where, ("static", "heuristic", "confidence"))


def _check_draft_quant(settings: dict, where: str) -> None:
    """``draft_quant``: absent, or one of specstop's weight-only schemes."""
    if settings.get("draft_quant") is not None:
        from specstop.pair.quantize import SCHEMES

        if settings["draft_quant"] not in SCHEMES:
            raise bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.draft_quant must be one of "
                      f"{', '.join(SCHEMES)}, got {settings['draft_quant']!r}")


def _check_runner(opt: dict, where: str) -> None:
    """specstop's stop in vLLM's draft-model runner: :data:`VLLM_WORKER_CLASS`, method draft_model, async
    scheduling off, and ``additional_config`` with a policy (a rule's spec, a policy string or an export folder)."""
    conf = opt["speculative_config"]
    if opt["worker_cls"] != VLLM_WORKER_CLASS:
        raise bad("vllm", f"{where}: worker_cls must be {VLLM_WORKER_CLASS}, got {opt['worker_cls']!r}")
    if conf.get("method") != "draft_model":
        raise bad("vllm", f"{where}: specstop's draft runner runs speculative_config method draft_model, got "
                  f"{conf.get('method')!r}")
    if opt.get("async_scheduling") is not False:
        raise bad("vllm", f"{where}: async_scheduling must be false (vLLM's async path drafts a fixed K per request)")
    additional = opt.get("additional_config")
    settings = additional.get(VLLM_SETTINGS_KEY) if isinstance(additional, dict) else None
    if not isinstance(settings, dict):
        raise bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY} must hold the policy")
    _check_draft_quant(settings, where)
    _check_policy_setting(conf, settings, where, ("static", "confidence"))


def _check_policy_setting(conf: dict, settings: dict, where: str, rules: tuple[str, ...]) -> None:
    """The ``policy`` setting: a spec of one of ``rules`` within ``num_speculative_tokens``, or a non-empty
    string (a policy string or an export folder)."""
    policy = settings.get("policy")
    if isinstance(policy, dict):
        from specstop.policy import PolicySpec

        try:
            spec = PolicySpec.from_dict(policy)
        except UserError as err:
            raise bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.policy: {err}") from None
        if spec.kind == "predictor":
            raise bad("vllm", f"{where}: a {spec.kind!r} policy is given as its export folder, not as its spec")
        if spec.kind not in rules:
            raise bad("vllm", f"{where}: this proposer does not run a {spec.kind!r} policy (it runs "
                      f"{', '.join(rules)} rules and learned policies)")
        if spec.cap > conf["num_speculative_tokens"]:
            raise bad("vllm", f"{where}: the policy drafts up to {spec.cap} tokens but num_speculative_tokens is "
                      f"{conf['num_speculative_tokens']} (vLLM's cap)")
    elif not isinstance(policy, str) or not policy:
        raise bad("vllm", f"{where}: additional_config.{VLLM_SETTINGS_KEY}.policy must be a policy spec or an "
                  "export folder")


def _check_conf(conf: Any, where: str, additional: Any = None) -> None:
    """vllm/config/speculative.py SpeculativeConfig + vllm/v1/spec_decode/dynamic/utils.py: num_speculative_tokens
    > 0; num_speculative_tokens_per_batch_size a list of inclusive [lo, hi, K], lo <= hi, positive, sorted and
    non-overlapping, the first starting at 1, K >= 0 (clamped to num_speculative_tokens). method is absent (a
    draft model) or custom_class (specstop's proposer, with its ``additional_config``)."""
    if not isinstance(conf, dict):
        raise bad("vllm", f"{where}: speculative_config must be an object")
    if not isinstance(conf.get("model"), str) or not conf["model"]:
        raise bad("vllm", f"{where}: speculative_config.model must name the draft model")
    if conf.get("method") not in (None, "draft_model", "custom_class"):
        raise bad("vllm", f"{where}: speculative_config.method must be draft_model or custom_class, got {conf['method']!r}")
    n = conf.get("num_speculative_tokens")
    if not is_int(n) or n < 1:
        raise bad("vllm", f"{where}: num_speculative_tokens must be an integer > 0, got {n!r}")
    if conf.get("method") == "custom_class":
        _check_proposer(conf, additional, where)
    ranges = conf.get("num_speculative_tokens_per_batch_size")
    if ranges is None:
        return
    if not isinstance(ranges, list) or not ranges:
        raise bad("vllm", f"{where}: num_speculative_tokens_per_batch_size must be a non-empty list of [lo, hi, K]")
    prev_hi = 0
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 3 or not all(is_int(x) for x in r):
            raise bad("vllm", f"{where}: schedule entry {r!r} is not [batch lo, batch hi, K] integers")
        lo, hi, kk = r
        if lo < 1 or lo > hi:
            raise bad("vllm", f"{where}: batch range [{lo}, {hi}] must be positive with lo <= hi")
        if lo <= prev_hi:
            raise bad("vllm", f"{where}: batch ranges must be sorted and non-overlapping ([{lo}, {hi}] after {prev_hi})")
        if kk < 0 or kk > n:
            raise bad("vllm", f"{where}: K {kk} for batch sizes [{lo}, {hi}] must be in [0, num_speculative_tokens {n}] "
                      "(vLLM clamps larger values, so the prediction would not hold)")
        prev_hi = hi
    if ranges[0][0] != 1:
        raise bad("vllm", f"{where}: the first batch range must start at 1, got {ranges[0][0]}")


def _check_option(opt: dict, where: str) -> None:
    _check_conf(opt.get("speculative_config"), where, opt.get("additional_config"))
    if opt.get("worker_cls") is not None:
        _check_runner(opt, where)


def _check_schedule(sched: dict, where: str) -> None:
    if sched.get("speculative_config") is not None:
        _check_conf(sched["speculative_config"], where)


ENGINE = Engine(name="vllm", policies=("static_opt", "heuristic_opt", "confidence_opt"), option=_option,
                check_option=_check_option, schedule=_schedule, check_schedule=_check_schedule, learned=_learned,
                reprice=_reprice)
