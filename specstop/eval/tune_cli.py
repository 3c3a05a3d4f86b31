"""``specstop tune``: tune every policy's thresholds / lengths on a validation split.

Writes the tuned-policy file of docs/design.md::

    {"schema_version": 1, "policies": {name: {"spec": PolicySpec dict, "validation": metrics}},
     "best": name, "cost_model": CostModel dict, "dataset": path, "checkpoints": {name: path},
     "tree_policies": {"tree_opt": {"spec": {"kind": "tree", "policy": "mcsd:..."}, "validation": metrics}}}

``tree_policies`` is filled when the cost model has a measured ``tree`` section
(:mod:`specstop.eval.tree_tune`), else empty. ``batch_schedule`` (a static K and a confidence
threshold + SL_max per batch size, :mod:`specstop.eval.batch_schedule`) is written when the cost model
has a measured ``batch`` section (``calibrate-cost --batch-grid``). ``levels`` (with ``--levels``) is a
multi-level stack entry (:mod:`specstop.eval.stack_entry`, docs/schemas.md): the stack's models and its
jointly tuned rules (:mod:`specstop.measure.levels_tune`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from specstop.config_cli import setting
from specstop.config_io import check_range
from specstop.errors import UserError
from specstop.eval.cost import PRESETS, CostModel, load_cost_model
from specstop.eval.cost_check import require_usable
from specstop.eval.episodes import load_replay_data
from specstop.eval.sampled import DEFAULT_REPEATS, replayable
from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints
from specstop.eval.segments import build_layout
from specstop.eval.tune import (
    SPECDECPP_GRID,
    check_sl_max,
    max_sl_supported,
    tune_heuristic,
    tune_rules,
    tune_static,
    tune_threshold,
)
from specstop.jsonio import atomic_write_json, read_json
from specstop.policy import DEFAULT_SL_MAX, PolicySpec

log = logging.getLogger("specstop")
TUNED_SCHEMA_VERSION = 1


@dataclass
class TuneOptions:
    """How `specstop tune` searches (the part a pipeline's ``tune:`` mapping may set)."""

    split: str = setting("validation", flags=("--split",))
    """Split to tune on."""
    sl_max_grid: str = setting("4,8,12,16,20", flags=("--sl-max-grid",))
    """SL_max candidates, comma separated."""
    heuristic_starts: str = setting("1,2,3,4,5,6,8,10", flags=("--heuristic-starts",))
    """Heuristic start values to try, comma separated."""
    repeats: int = setting(DEFAULT_REPEATS, flags=("--repeats",))
    """Sampled data (T > 0): realisations of the acceptance draws to tune on."""


@dataclass
class TuneSettings(TuneOptions):
    """What `specstop tune` reads, how it prices rounds and where it writes."""

    data: str | None = setting(None, flags=("--data",))
    """Dataset folder (specstop generate output); required unless --reprice."""
    reprice: str | None = setting(None, flags=("--reprice",), metavar="TUNED")
    """Re-pick every policy of this tuned file with --cost-model, from the price-free statistics it
    carries (no dataset is read; --checkpoint and the search settings do not apply)."""
    checkpoint: list[str] = setting(default_factory=list, flags=("--checkpoint",), metavar="[NAME=]PATH",
                                    repeatable=True)
    """Predictor checkpoint, repeatable (NAME defaults to the file name)."""
    cost_model: str | None = setting(None, flags=("--cost-model",), required=True)
    """The latency model to minimise: a cost.json from `specstop calibrate-cost` (this machine), or a
    preset name (not this machine; reports say so)."""
    force_cost: bool = setting(False, flags=("--force-cost",), negatable=False)
    """Price with a measured cost table even when it fails its check (erratic or unordered K)."""
    out: str | None = setting(None, flags=("--out",), required=True)
    """Tuned-policy JSON to write."""
    levels: str | None = setting(None, flags=("--levels",), metavar="MODELS")
    """Also tune a multi-level stack jointly: the models between the dataset's draft and target, smallest
    first, as a comma list (local folders or hub ids); its best rules go into the tuned file's ``levels``
    entry (`specstop export --policy levels`)."""
    level_grid: list[str] = setting(default_factory=list, flags=("--level-grid",), metavar="RULES", repeatable=True)
    """--levels: the rules to try for one gap (a comma list), repeated once per gap, bottom first; none =
    static:1..3 and confidence 0.5 / 0.7 below, static:4..8 and confidence 0.4 / 0.6 for the target."""
    level_prompts: int = setting(8, flags=("--level-prompts",))
    """--levels: prompts of the split the stack is recorded and replayed on."""
    level_budget_s: float = setting(30.0, flags=("--level-budget-s",))
    """--levels: seconds of timing every model's forwards on this machine."""


def main(argv: list[str], stack_tuner=None) -> int:
    """``specstop tune``; ``stack_tuner``: what tunes a ``--levels`` stack (:func:`run`)."""
    from specstop.config_cli import TypedCommand

    args, _ = TypedCommand(TuneSettings, prog="specstop tune",
                           description="tune every policy's thresholds / lengths on a validation split; cost "
                                       f"model presets (not this machine): {', '.join(PRESETS)}").parse(argv)
    return run(args, stack_tuner=stack_tuner)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UserError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise UserError(f"expected positive integers, got {text!r}")
    return vals


def load_cost_model_arg(spec, *, force: bool = False, recorded_in: str | None = None) -> CostModel:
    """``--cost-model``: a preset name or a cost.json, with every problem as a one-line user error; a
    measured table that fails its check (:mod:`specstop.eval.cost_check`) is refused unless ``force``.

    ``recorded_in``: the tuned file ``spec`` was read from (no --cost-model given); errors name it.
    """
    if isinstance(spec, str) and spec not in PRESETS and Path(spec).is_file():
        doc = read_json(spec, "cost model file")
        if not isinstance(doc, dict):
            raise UserError(f"{spec}: a cost model file holds a JSON object, got {type(doc).__name__}")
    try:
        cost = load_cost_model(spec)
    except (ValueError, TypeError) as err:  # every failure here is about the given preset/file
        if recorded_in is not None:
            raise UserError(f"{recorded_in}: its cost_model cannot be used: {err}; pass --cost-model (a preset or a "
                            "cost.json from specstop calibrate-cost) to price with another") from None
        raise UserError(f"--cost-model {spec if isinstance(spec, str) else '(a mapping)'}: {err}") from None
    for problem in require_usable(cost, force=force):
        log.warning("pricing with a cost table that fails its check (--force-cost): %s", problem)
    return cost


def run(args: TuneSettings, stack_tuner=None) -> int:
    """Tune and write ``args.out``.

    ``stack_tuner(data, split, models, grids, limit=, budget_s=) -> stack entry`` tunes a ``--levels``
    stack (:func:`specstop.measure.levels_tune.tune_dataset_stack`: it times and records models, which
    this layer does not; the ``tune`` command passes it).
    """
    from specstop.outputs import check_writable

    check_range("--repeats", args.repeats, low=1)
    if args.reprice is not None:
        return run_reprice(args)
    if args.data is None:
        raise UserError("missing --data (the dataset to tune on), or give --reprice TUNED to re-price a tuned file; "
                        "see specstop tune --help")
    check_writable(args.out, "--out", kind="file")  # before the replay work, not after it
    stack = _stack_request(args)  # a bad --levels or --level-grid fails before any tuning
    if stack is not None and stack_tuner is None:
        raise UserError("--levels times and records the stack's models: run it as `specstop tune` (the command), "
                        "or pass stack_tuner=specstop.measure.levels_tune.tune_dataset_stack")
    cost = load_cost_model_arg(args.cost_model, force=args.force_cost)
    grid = _ints(args.sl_max_grid)
    tuned = tune_dataset(
        args.data,
        args.split,
        parse_checkpoint_args(args.checkpoint),
        cost,
        sl_max_grid=grid,
        heuristic_starts=_ints(args.heuristic_starts),
        repeats=args.repeats,
    )
    if stack is not None:
        tuned["levels"] = stack_tuner(args.data, args.split, *stack, limit=args.level_prompts,
                                      budget_s=args.level_budget_s)
    out = Path(args.out)
    atomic_write_json(out, tuned)  # a crash or a full disk never leaves a half-written tuned file
    for name, pol in tuned["policies"].items():
        v = pol["validation"]
        log.info(
            "%-18s %-40s latency/token %.5f  speedup %.3f",
            name,
            PolicySpec.from_dict(pol["spec"]).label,
            v["latency_per_token"],
            v["speedup"],
        )
    for name, pol in tuned.get("tree_policies", {}).items():
        v = pol["validation"]
        log.info("%-18s %-40s latency/token %.5f  speedup %.3f (%s)", name, pol["spec"]["policy"],
                 v["latency_per_token"], v["speedup"], "exact replay" if v["exact"] else "approximate replay")
    for e in tuned.get("batch_schedule", {}).get("entries", []):
        thr = e["threshold"]
        log.info("batch %-3d static K=%d (speedup %.3f)%s", e["batch_size"], e["k"], e["predicted_speedup"],
                 f"; confidence {thr['threshold']:.3f}, SL_max {thr['sl_max']} (speedup {thr['predicted_speedup']:.3f})"
                 if thr else "")
    if "levels" in tuned:
        lv = tuned["levels"]
        log.info("%-18s %-40s speedup %.3f (stack of %d models)", "levels", " / ".join(lv["policies"]),
                 lv["speedup"], len(lv["models"]) + 2)
    for name, why in tuned["skipped"].items():
        log.info("%-18s skipped: %s", name, why)
    log.info("best: %s -> %s", tuned["best"], out)
    return 0


def _stack_request(args: TuneSettings) -> tuple[list[str], list[list[str]]] | None:
    """``(models, grids)`` of ``--levels`` (None without it); ``--level-*`` settings without it are refused."""
    if args.levels is None:
        if args.level_grid:
            raise UserError("--level-grid tunes a multi-level stack: add --levels MODELS or drop --level-grid")
        return None
    from specstop.eval.stack_entry import level_grids, parse_level_models

    check_range("--level-prompts", args.level_prompts, low=1)
    check_range("--level-budget-s", args.level_budget_s, low=0)
    models = parse_level_models(args.levels)
    return models, level_grids(args.level_grid, len(models) + 1)


def run_reprice(args: TuneSettings) -> int:
    """``--reprice TUNED``: every policy re-picked from its statistics with ``--cost-model``."""
    from specstop.eval.price_free import reprice_tuned
    from specstop.eval.tuned_file import read_tuned
    from specstop.outputs import check_writable

    if args.data is not None or args.checkpoint:
        raise UserError("--reprice re-prices a tuned file's statistics and reads no data: drop --data and --checkpoint")
    tuned = read_tuned(args.reprice)
    tuned.pop("_path", None)
    check_writable(args.out, "--out", kind="file")
    cost = load_cost_model_arg(args.cost_model, force=args.force_cost)
    out, lines = reprice_tuned(tuned, cost, source=str(args.reprice))
    out["repriced_from"] = {"tuned": str(Path(args.reprice).resolve()), "cost_model": tuned.get("cost_model", {}).get("name")}
    atomic_write_json(Path(args.out), out)
    log.info("%s", cost.provenance_line())
    for line in lines:
        log.info("%s", line)
    log.info("best: %s -> %s", out["best"], args.out)
    return 0


def policy_entry(spec: PolicySpec, record: dict) -> dict:
    """A tuned.json policy entry: the spec, its validation metrics and, apart from them, the price-free
    statistics of its candidates (:mod:`specstop.eval.price_free`)."""
    record = dict(record)
    stats = record.pop("stats", None)
    return {"spec": spec.to_dict(), "validation": record, **({"stats": stats} if stats else {})}


def add_schedule_candidates(stats: dict, schedule: dict, data, layout) -> None:
    """Add the confidence thresholds the batch schedule picked to the confidence rule's statistics, so
    that re-pricing the schedule with the same table picks them again."""
    from specstop.eval.price_free import candidate
    from specstop.eval.segments import fast_replay

    have = [c["params"] for c in stats["candidates"]]
    for entry in schedule["entries"]:
        thr = entry.get("threshold")
        if not thr:
            continue
        params = {"threshold": float(thr["threshold"]), "sl_max": int(thr["sl_max"]), "rule": "below"}
        if params not in have:
            spec = PolicySpec(kind="confidence", threshold=params["threshold"], sl_max=params["sl_max"])
            stats["candidates"].append(candidate(params, fast_replay(data, spec, layout)))
            have.append(params)


def tune_dataset(
    data_dir,
    split: str,
    checkpoints: dict,
    cost,
    *,
    sl_max_grid=(4, 8, 12, 16, 20),
    heuristic_starts=(1, 2, 3, 4, 5, 6, 8, 10),
    repeats: int = DEFAULT_REPEATS,
) -> dict:
    """Tune everything on ``split`` of ``data_dir``; returns the tuned-policy dict (see module docstring)."""
    t0 = time.perf_counter()
    data = load_replay_data(data_dir, split)
    if data.temperature <= 0:
        for sl in sl_max_grid:
            try:
                check_sl_max(data, sl)
            except ValueError as err:  # the grid asks for longer rollouts than the dataset stores
                raise UserError(f"--sl-max-grid: {err}") from None
    info, skipped = score_checkpoints(data, data_dir, split, checkpoints)
    if data.temperature > 0:
        # Sampled data: tune on R realisations of the acceptance draws (mean latency), see eval.sampled.
        data = replayable(data, data_dir, split, repeats=repeats, max_steps=max(sl_max_grid))
        log.info("sampled data (T=%g): tuning on %d realisations of the acceptance draws", data.temperature, repeats)
    layout = build_layout(data)
    policies = {}
    k_max = max(sl_max_grid)
    spec, rec = tune_static(data, cost, k_max, layout=layout)
    policies["static_opt"] = policy_entry(spec, rec)
    # The heuristic keeps the default cap (20) unless the rollouts support less.
    supported = max_sl_supported(data)
    h_cap = DEFAULT_SL_MAX if supported is None else min(DEFAULT_SL_MAX, supported)
    spec, rec = tune_heuristic(data, cost, heuristic_starts, sl_max=h_cap, layout=layout)
    policies["heuristic_opt"] = policy_entry(spec, rec)
    spec, rec = tune_threshold(
        data, PolicySpec(kind="confidence", threshold=0.4), cost, sl_max_grid, layout=layout
    )
    policies["confidence_opt"] = policy_entry(spec, rec)
    # A training-free baseline with SpecDec++'s cumulative rule on the draft's own top-1: it shows how
    # much of a learned policy's gain comes from its scores rather than from the rule.
    spec, rec = tune_threshold(
        data, PolicySpec(kind="confidence", rule="cumprod", threshold=0.5), cost, sl_max_grid, layout=layout
    )
    policies["confidence_cumprod"] = policy_entry(spec, rec)
    for name, meta in info.items():
        base = PolicySpec(
            kind="predictor",
            family=meta["family"],
            rule=meta["rule"],
            reads=meta["reads"],
            extra={"scores": name, "checkpoint": name},
        )
        rules = (meta["rule"],) + tuple(r for r in ("below", "cumprod") if r != meta["rule"])
        spec, rec = tune_rules(data, base, cost, sl_max_grid, rules=rules, layout=layout,
                               paper_grid=SPECDECPP_GRID if meta["family"] == "specdecpp_resnet" else None)
        policies[name] = policy_entry(spec, rec)
    best = min(policies, key=lambda n: policies[n]["validation"]["latency_per_token"])
    # Token trees, when the cost model measured their costs. Kept apart from "policies" (chain
    # PolicySpecs that eval and export replay); `specstop export --policy tree_opt` finds them here.
    tree_policies = {}
    if getattr(cost, "tree", None):
        from specstop.eval.tree_tune import tune_tree

        try:
            tree_policies["tree_opt"] = tune_tree(data_dir, split, cost)
        except UserError as err:
            skipped["tree_opt"] = str(err)
    # A schedule per batch size (static K, threshold and SL_max), when the cost model measured batch costs.
    batch = None
    if getattr(cost, "batch", None):
        from specstop.eval.batch_schedule import batch_schedule

        batch = batch_schedule(data, cost, k_max=k_max, sl_max_grid=sl_max_grid, layout=layout)
        add_schedule_candidates(policies["confidence_opt"]["stats"], batch, data, layout)
    return {
        "schema_version": TUNED_SCHEMA_VERSION,
        "policies": policies,
        "best": best,
        "tree_policies": tree_policies,
        "cost_model": cost.to_dict(),
        # Absolute paths: the file is read from other directories (eval, export, another machine's shell).
        "dataset": str(Path(data_dir).resolve()),
        "split": split,
        "checkpoints": {n: str(Path(m["path"]).resolve()) for n, m in info.items()},
        "predictors": info,
        "skipped": skipped,
        "tokens": data.num_tokens // (getattr(data, "virtual_repeats", None) or 1),
        "prompts": getattr(data, "virtual_prompts", data.num_prompts),
        "sampled_replay": ({"repeats": data.virtual_repeats, "theorem1": data.theorem1}
                           if getattr(data, "virtual_repeats", None) else None),
        "seconds": round(time.perf_counter() - t0, 3),
        **({"batch_schedule": batch} if batch else {}),
    }
