"""llama.cpp: ``--spec-type draft-simple`` with ``--spec-draft-n-max`` / ``--spec-draft-n-min`` /
``--spec-draft-p-min`` (older builds: ``--draft-max`` / ``--draft-min`` / ``--draft-p-min``): static K (p-min 0),
or SL_max with the confidence threshold as p-min. It has no batch schedule: one setting per ``--parallel``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from specstop.export.engines.base import Context, Engine, bad
from specstop.export.engines.pricing import prediction
from specstop.pair.convert import gguf_source

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
    return prediction({"validation": metrics})


def _names(draft: str, target: str) -> tuple[str, str]:
    return gguf_source(draft), gguf_source(target)  # llama.cpp reads GGUF


def _option(entry: dict, ctx: Context) -> dict:
    draft, target = _names(ctx.draft, ctx.target)
    flags = llamacpp_flags(entry["spec"])
    base = ["llama-server", "-m", target, "-md", draft, "--temp", "0"]
    out = {"flags": flags, "flags_legacy": llamacpp_flags(entry["spec"], legacy=True),
           "command": shlex.join(base + flags), "caveat": None}
    if entry["spec"]["kind"] != "confidence":
        return out
    own = llamacpp_rule_prediction(ctx.tuned, entry["spec"])
    if own is None:
        out["caveat"] = ("llama.cpp ends a draft *before* a token whose probability is below --spec-draft-p-min; "
                         "specstop's confidence rule drafts that token and stops after it, so with a threshold the "
                         "engine drafts up to one token fewer per round than the replay assumed (the tuning dataset "
                         "was not at hand to replay llama.cpp's rule)")
        return out
    out["predicted"] = own
    out["predicted_specstop_rule"] = prediction(entry)
    out["caveat"] = ("predicted under llama.cpp's rule: a draft ends *before* a token whose probability is below "
                     "--spec-draft-p-min, its draft step paid (the tuning split replayed that way); specstop's "
                     "confidence rule, which proposes that token and stops after it, is predicted_specstop_rule")
    return out


def _schedule(sched: dict, draft: str, target: str, folder: str | None) -> dict:
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


def _check_flags(flags: Any, where: str) -> None:
    """llama.cpp common/arg.cpp: --spec-draft-n-max N (>= 1), --spec-draft-n-min 0, --spec-draft-p-min P in [0, 1]."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise bad("llamacpp", f"{where}: flags must be a list of strings")
    if not flags:
        return
    try:
        n_max = int(flags[flags.index("--spec-draft-n-max") + 1])
        p_min = float(flags[flags.index("--spec-draft-p-min") + 1])
        n_min = int(flags[flags.index("--spec-draft-n-min") + 1])
    except (ValueError, IndexError):
        raise bad("llamacpp", f"{where}: --spec-draft-n-max/-n-min/-p-min need numeric values") from None
    if n_max < 1 or n_min != 0 or not 0.0 <= p_min <= 1.0:
        raise bad("llamacpp", f"{where}: need --spec-draft-n-max >= 1, --spec-draft-n-min 0, --spec-draft-p-min in "
                  f"[0, 1], got {n_max}, {n_min}, {p_min}")


def _check_option(opt: dict, where: str) -> None:
    _check_flags(opt.get("flags"), where)


def _check_schedule(sched: dict, where: str) -> None:
    for row in sched["by_batch_size"]:
        _check_flags(row.get("flags"), f"{where} batch size {row['batch_size']}")


ENGINE = Engine(name="llamacpp", policies=("static_opt", "confidence_opt"), option=_option,
                check_option=_check_option, schedule=_schedule, check_schedule=_check_schedule, names=_names)
