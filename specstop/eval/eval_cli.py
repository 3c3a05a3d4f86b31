"""``specstop eval``: replay every policy on a test split and write report.md / report.json / PNGs.

Transfer (DISCO: MBPP -> HumanEval) is just ``--data`` pointing at another dataset than the one
``specstop tune`` used; the report says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specstop.config_io import check_range, read_json
from specstop.errors import MissingInputError, UserError
from specstop.eval.episodes import load_replay_data
from specstop.eval.report import build_report, write_report
from specstop.eval.sampled import replayable
from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints
from specstop.eval.tune_cli import load_cost_model_arg
from specstop.outputs import claim_output_dir
from specstop.pair.identity import check_same_pair
from specstop.policy import DEFAULT_SL_MAX

log = logging.getLogger("specstop")


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="dataset folder to evaluate on")
    p.add_argument("--tuned", required=True, help="tuned-policy JSON written by `specstop tune`")
    p.add_argument("--split", default="test")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--cost-model", default=None, help="preset or cost.json (default: the tuned file's)")
    p.add_argument(
        "--checkpoint", action="append", default=[], metavar="[NAME=]PATH", help="override a tuned checkpoint path, repeatable (NAME defaults to the file name)"
    )
    p.add_argument("--mc-repeats", type=int, default=16,
                   help="sampled data (T > 0): realisations of the acceptance draws replayed (default 16)")


def read_tuned(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"no tuned-policy file at {p}; run `specstop tune ... --out {p}` first")
    tuned = read_json(p, "tuned-policy file")
    if not isinstance(tuned, dict) or tuned.get("schema_version") != 1 or not isinstance(tuned.get("policies"), dict):
        raise UserError(f"{p} is not a specstop tuned-policy file (schema_version 1 with 'policies')")
    tuned["_path"] = str(p)
    return tuned


def check_tuned_pair(tuned: dict, data_dir) -> None:
    """Thresholds tuned on one pair's data say nothing about another pair's: refuse the mix."""
    from specstop.data_gen.storage import read_json_or_none, read_manifest

    tuned_on = read_json_or_none(Path(str(tuned.get("dataset") or "")) / "manifest.json") if tuned.get("dataset") else None
    check_same_pair(
        (tuned_on or {}).get("pair"), read_manifest(data_dir).get("pair"),
        what=f"{tuned.get('_path')} was tuned on {tuned.get('dataset')}, made by another model pair than {data_dir}",
        fix="evaluate on data generated with the same pair (transfer across prompt sets is fine), or tune on this pair",
    )


def run(args) -> int:
    check_range("--mc-repeats", args.mc_repeats, low=1)
    tuned = read_tuned(args.tuned)
    cost = load_cost_model_arg(args.cost_model or tuned.get("cost_model"))
    check_tuned_pair(tuned, args.data)
    data = load_replay_data(args.data, args.split)
    ckpts = {**tuned.get("checkpoints", {}), **parse_checkpoint_args(args.checkpoint)}
    info, skipped = score_checkpoints(data, args.data, args.split, ckpts)
    sl_max = max([DEFAULT_SL_MAX] + [int(p["spec"].get("sl_max") or 0) for p in tuned["policies"].values()])
    data = replayable(data, args.data, args.split, repeats=args.mc_repeats, max_steps=sl_max)
    # Predictors that could not even be tuned stay listed as skipped, with the tuner's reason.
    skipped = {**tuned.get("skipped", {}), **skipped}
    with claim_output_dir(args.out, command=f"specstop eval --out {args.out}"):
        rep = build_report(data, tuned, cost, info, skipped, out_dir=args.out)
        md, js = write_report(rep, args.out)
    log.info("report: %s, %s", md, js)
    print(md.read_text())
    return 0
