"""SGLang: ``--speculative-algorithm STANDALONE`` (a separate draft model) with ``--speculative-num-steps`` K,
``--speculative-eagle-topk 1`` and ``--speculative-num-draft-tokens`` K + 1; the batch schedule as
adaptive-speculation tiers (``--speculative-adaptive-config``, a JSON file written beside the settings)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from specstop.errors import UserError
from specstop.export.engines.base import Context, Engine, bad, flag_value, side_file
from specstop.export.engines.pricing import schedule_rows
from specstop.outputs import atomic_write_text

#: The import path SGLang code names to construct this policy.
POLICY_CLASS = "specstop.decode.sglang_policy.SpecstopAdaptivePolicy"
TIERS_FIX = "write the tiers with `specstop export --for sglang` from a tuned file with a batch schedule"


def read_tiers(data: Any, where: str = "adaptive tiers") -> dict[int, int]:
    """The tuned K per tier from SGLang's adaptive-config form.

    Args:
        data: ``{"B": {"candidate_steps": [K]}, ...}`` - batch sizes as digit strings ascending from "1",
            each with one step count K >= 0 (0: no drafting at those batch sizes).
        where: names the file or field in errors.

    Returns:
        ``{B: K}`` with batch sizes ascending.

    Raises:
        UserError: a key that is not a batch size, keys not ascending from 1, or a tier without exactly
            one integer step count >= 0.
    """
    if not isinstance(data, dict) or not data:
        raise UserError(f"{where}: must map batch sizes to {{candidate_steps: [K]}}; {TIERS_FIX}")
    tiers: dict[int, int] = {}
    for key, tier in data.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) < 1:
            raise UserError(f"{where}: tier key {key!r} must be a batch size written as digits; {TIERS_FIX}")
        cand = tier.get("candidate_steps") if isinstance(tier, dict) else None
        # One candidate pins the tuned K: SGLang's EMA policy would move among several by acceptance,
        # which is not what the schedule was tuned for.
        if not isinstance(cand, list) or len(cand) != 1 or not isinstance(cand[0], int) \
                or isinstance(cand[0], bool) or cand[0] < 0:
            raise UserError(f"{where}: tier {key} candidate_steps must be a non-empty list holding one integer "
                            f">= 0 (the tuned K), got {cand!r}; {TIERS_FIX}")
        tiers[int(key)] = cand[0]
    keys = list(tiers)
    if keys != sorted(keys) or keys[0] != 1:
        raise UserError(f"{where}: tier batch sizes must ascend from 1, got {keys}; {TIERS_FIX}")
    return tiers

#: Where ``write_engine_settings`` puts SGLang's adaptive-speculation tiers (a JSON file it reads by path).
SGLANG_ADAPTIVE_FILE = "sglang_adaptive.json"
#: Which SGLang workers can run the policy: those that build an ``AdaptiveController`` (python/sglang/srt/
#: speculative/adaptive_runtime_state.py; adaptive_spec_params.py ``adaptive_unsupported_reason``;
#: standalone_worker.py), at the revisions read.
POLICY_APPLIES_TO = (
    "workers that build SGLang's AdaptiveController and take an injected policy (sgl-project/sglang#37274): a "
    "plugin algorithm registered with SpeculativeAlgorithm.register; SGLang's EAGLE/EAGLE3 workers build theirs with "
    "its own EMA policy (fed these tiers by --speculative-adaptive-config). The STANDALONE worker (a separate draft "
    "model, as tuned here) has no adaptive controller, so there the static --speculative-num-steps runs"
)


def _launch(target: str, flags: list[str]) -> str:
    return shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, *flags])


def _draft_flags(draft: str, k: int) -> list[str]:
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def _option(entry: dict, ctx: Context) -> dict:
    flags = _draft_flags(ctx.draft, entry["spec"]["k"])
    return {"flags": flags, "command": _launch(ctx.target, flags)}


def _schedule(sched: dict, draft: str, target: str, folder: str | None) -> dict:
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
        return {"adaptive_config": None, "flags": [], "command": _launch(target, []),
                "by_batch_size": schedule_rows(sched, ks), "notes": notes}
    tiers_path = side_file(folder, SGLANG_ADAPTIVE_FILE)
    flags = [*_draft_flags(draft, start), "--speculative-adaptive", "--speculative-adaptive-config", tiers_path]
    return {"adaptive_config": tiers, "flags": flags, "command": _launch(target, flags),
            "policy": _policy(tiers_path), "by_batch_size": schedule_rows(sched, ks), "notes": notes}


def _policy(tiers_path: str) -> dict:
    """How SGLang code runs the same tiers as specstop's ``AdaptiveSpecPolicy`` (an injected policy keeps the
    tuned K per batch size; SGLang's own EMA policy moves among candidates by acceptance)."""
    return {
        "class": POLICY_CLASS,
        "tiers": tiers_path,
        "usage": ("from specstop.decode.sglang_policy import SpecstopAdaptivePolicy; "
                  f"policy = SpecstopAdaptivePolicy.from_file({tiers_path!r}, "
                  "initial_steps=worker.speculative_num_steps); controller = AdaptiveController(worker, policy)"),
        "applies_to": POLICY_APPLIES_TO,
    }


def _check(flags: Any, adaptive: Any, where: str) -> None:
    """sglang server args + python/sglang/srt/speculative/adaptive_spec_params.py: integer-string batch-size
    keys, each with a non-empty candidate_steps list of integers >= 0; --speculative-num-steps among them."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise bad("sglang", f"{where}: flags must be a list of strings")
    if flag_value(flags, "--speculative-algorithm", "sglang", where) != "STANDALONE":
        raise bad("sglang", f"{where}: --speculative-algorithm must be STANDALONE for a separate draft model")
    flag_value(flags, "--speculative-draft-model-path", "sglang", where)
    try:
        steps, topk, ntok = (int(flag_value(flags, f, "sglang", where)) for f in (
            "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"))
    except ValueError:
        raise bad("sglang", f"{where}: step/topk/draft-token flags must be integers") from None
    if steps < 1 or topk != 1 or ntok != steps + 1:
        raise bad("sglang", f"{where}: need --speculative-num-steps >= 1, --speculative-eagle-topk 1 and "
                  f"--speculative-num-draft-tokens = steps + 1, got {steps}, {topk}, {ntok}")
    if adaptive is None:
        return
    if "--speculative-adaptive" not in flags:
        raise bad("sglang", f"{where}: an adaptive config needs --speculative-adaptive")
    try:  # the policy's own reader: the tiers it would run
        union = set(read_tiers(adaptive, f"{where} adaptive_config").values())
    except UserError as err:
        raise bad("sglang", str(err).split("; ")[0]) from None
    if steps not in union:
        raise bad("sglang", f"{where}: --speculative-num-steps {steps} is not among the tiers' candidate_steps "
                  f"{sorted(union)} (SGLang refuses that)")


def _check_option(opt: dict, where: str) -> None:
    _check(opt.get("flags"), None, where)


def _check_schedule(sched: dict, where: str) -> None:
    if sched.get("adaptive_config") is not None:
        _check(sched.get("flags"), sched["adaptive_config"], where)
    policy = sched.get("policy")
    if policy is not None:
        if not isinstance(policy, dict) or policy.get("class") != POLICY_CLASS:
            raise bad("sglang", f"{where}: policy.class must be {POLICY_CLASS}")
        if not isinstance(policy.get("tiers"), str) or not policy["tiers"].endswith(SGLANG_ADAPTIVE_FILE):
            raise bad("sglang", f"{where}: policy.tiers must name the {SGLANG_ADAPTIVE_FILE} written beside it")
        if sched.get("adaptive_config") is None:
            raise bad("sglang", f"{where}: a policy needs the adaptive_config tiers it runs")


def _side_files(out: Path, settings: dict) -> None:
    """The adaptive tiers, which SGLang reads by path."""
    if (settings.get("batch_schedule") or {}).get("adaptive_config"):
        atomic_write_text(out / SGLANG_ADAPTIVE_FILE, json.dumps(settings["batch_schedule"]["adaptive_config"], indent=2) + "\n")


ENGINE = Engine(name="sglang", policies=("static_opt",), option=_option, check_option=_check_option,
                schedule=_schedule, check_schedule=_check_schedule, side_files=_side_files)
