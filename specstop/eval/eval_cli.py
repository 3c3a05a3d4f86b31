"""``specstop eval``: replay every policy on a test split and write report.md / report.json / PNGs.

Transfer (DISCO: MBPP -> HumanEval) is just ``--data`` pointing at another dataset than the one
``specstop tune`` used; the report says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specstop.config_io import check_range
from specstop.errors import MissingInputError, UserError
from specstop.eval.cost import load_cost_model
from specstop.eval.episodes import load_replay_data
from specstop.eval.report import build_report, write_report
from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints

log = logging.getLogger("specstop")


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="dataset folder to evaluate on")
    p.add_argument("--tuned", required=True, help="tuned-policy JSON written by `specstop tune`")
    p.add_argument("--split", default="test")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--cost-model", default=None, help="preset or cost.json (default: the tuned file's)")
    p.add_argument(
        "--checkpoint", action="append", default=[], metavar="NAME=PATH", help="override a checkpoint path"
    )
    p.add_argument("--mc-repeats", type=int, default=20, help="Monte-Carlo repeats for sampled data")


def read_tuned(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"no tuned-policy file at {p}; run `specstop tune ... --out {p}` first")
    tuned = json.loads(p.read_text())
    if tuned.get("schema_version") != 1 or "policies" not in tuned:
        raise UserError(f"{p} is not a specstop tuned-policy file (schema_version 1 with 'policies')")
    tuned["_path"] = str(p)
    return tuned


def run(args) -> int:
    check_range("--mc-repeats", args.mc_repeats, low=1)
    tuned = read_tuned(args.tuned)
    cost = load_cost_model(args.cost_model or tuned["cost_model"])
    data = load_replay_data(args.data, args.split)
    ckpts = {**tuned.get("checkpoints", {}), **parse_checkpoint_args(args.checkpoint)}
    info, skipped = score_checkpoints(data, args.data, args.split, ckpts)
    # Predictors that could not even be tuned stay listed as skipped, with the tuner's reason.
    skipped = {**tuned.get("skipped", {}), **skipped}
    rep = build_report(data, tuned, cost, info, skipped, out_dir=args.out, mc_repeats=args.mc_repeats)
    md, js = write_report(rep, args.out)
    log.info("report: %s, %s", md, js)
    print(md.read_text())
    return 0
