"""``specstop eval``: replay every policy on a test split and write report.md / report.json / PNGs.

Transfer (DISCO: MBPP -> HumanEval) is just ``--data`` pointing at another dataset than the one
``specstop tune`` used; the report says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specstop.config_cli import setting
from specstop.config_io import check_range
from specstop.errors import UserError
from specstop.eval.episodes import load_replay_data
from specstop.eval.report import build_report, write_report
from specstop.eval.sampled import replayable
from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints
from specstop.eval.tune_cli import load_cost_model_arg
from specstop.eval.tuned_file import read_tuned
from specstop.outputs import claim_output_dir
from specstop.pair.identity import check_same_pair
from specstop.policy import DEFAULT_SL_MAX

log = logging.getLogger("specstop")


@dataclass
class EvalOptions:
    """How `specstop eval` replays (the part a pipeline's ``eval:`` mapping may set)."""

    split: str = setting("test", flags=("--split",))
    """Split to replay."""
    mc_repeats: int = setting(16, flags=("--mc-repeats",))
    """Sampled data (T > 0): realisations of the acceptance draws replayed."""


@dataclass
class EvalSettings(EvalOptions):
    """What `specstop eval` reads and where it writes its report."""

    data: str | None = setting(None, flags=("--data",), required=True)
    """Dataset folder to evaluate on."""
    tuned: str | None = setting(None, flags=("--tuned",), required=True)
    """Tuned-policy JSON written by `specstop tune`."""
    out: str | None = setting(None, flags=("--out",), required=True)
    """Report folder."""
    cost_model: str | None = setting(None, flags=("--cost-model",))
    """Preset or cost.json; null = the tuned file's."""
    force_cost: bool = setting(False, flags=("--force-cost",), negatable=False)
    """Price with a measured cost table even when it fails its check (erratic or unordered K)."""
    checkpoint: list[str] = setting(default_factory=list, flags=("--checkpoint",), metavar="[NAME=]PATH",
                                    repeatable=True)
    """Override a tuned checkpoint path, repeatable (NAME defaults to the file name)."""
    overwrite: bool = setting(False, flags=("--overwrite",), negatable=False)
    """Replace an earlier report in --out (report.md, report.json and its figures)."""


def main(argv: list[str]) -> int:
    from specstop.config_cli import TypedCommand

    args, _ = TypedCommand(EvalSettings, prog="specstop eval",
                           description="replay every policy on a test split and write the report").parse(argv)
    return run(args)


def check_tuned_pair(tuned: dict, data_dir) -> None:
    """Thresholds tuned on one pair's data say nothing about another pair's: refuse the mix."""
    from specstop.data_gen.storage import read_manifest
    from specstop.jsonio import read_json_or_none

    tuned_on = read_json_or_none(Path(str(tuned.get("dataset") or "")) / "manifest.json") if tuned.get("dataset") else None
    check_same_pair(
        (tuned_on or {}).get("pair"), read_manifest(data_dir).get("pair"),
        what=f"{tuned.get('_path')} was tuned on {tuned.get('dataset')}, made by another model pair than {data_dir}",
        fix="evaluate on data generated with the same pair (transfer across prompt sets is fine), or tune on this pair",
    )


REPORT_FILES = ("report.md", "report.json", "pareto.png", "oracle_sl_hist.png", "oracle_sl_by_index.png")


def _report_files(out: Path) -> list[Path]:
    """Files in ``out`` that writing a report would replace."""
    if not out.is_dir():
        return []
    return [p for p in sorted(out.iterdir()) if p.name in REPORT_FILES
            or (p.name.startswith("calibration") and p.suffix == ".png")]


def _is_own_report(out: Path) -> bool:
    try:
        doc = json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "rows" in doc and "schema_version" in doc


def check_report_target(out: Path, overwrite: bool) -> None:
    """Refuse, before any replay, an ``--out`` whose report files would be overwritten.

    Raises:
        UserError: an earlier report without ``--overwrite``, or files of the same names that are
            not a specstop report (never replaced, even with ``--overwrite``).
    """
    from specstop.outputs import check_writable

    existing = _report_files(out)
    if existing and not overwrite:
        raise UserError(
            f"--out {out} already holds {existing[0].name}; pass --overwrite to replace the earlier report, "
            "or choose another --out"
        )
    if existing and not _is_own_report(out):
        raise UserError(
            f"--out {out} holds {existing[0].name}, which is not part of a specstop report (no report.json written "
            "by specstop eval); it is never replaced: choose another --out"
        )
    check_writable(out, "--out")


def _write_staged(rep_builder, out: Path) -> Path:
    """Write the report into a hidden folder inside ``out`` and move each file into place only when
    all are written: a failed write (a full disk) leaves the earlier report or nothing, never half."""
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".report-tmp-", dir=out))
    try:
        md, _js = rep_builder(stage)
        for f in sorted(stage.iterdir(), key=lambda p: p.name == "report.md"):  # report.md last
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out / md.name


def run(args: EvalSettings) -> int:
    check_range("--mc-repeats", args.mc_repeats, low=1)
    check_report_target(Path(args.out), args.overwrite)
    tuned = read_tuned(args.tuned)
    cost = load_cost_model_arg(args.cost_model or tuned.get("cost_model"), force=args.force_cost,
                               recorded_in=None if args.cost_model else tuned["_path"])
    check_tuned_pair(tuned, args.data)
    data = load_replay_data(args.data, args.split)
    given = parse_checkpoint_args(args.checkpoint)
    ckpts = {**tuned.get("checkpoints", {}), **given}
    info, skipped = score_checkpoints(data, args.data, args.split, ckpts, recorded_in=tuned["_path"],
                                      recorded=set(ckpts) - set(given))
    sl_max = max([DEFAULT_SL_MAX] + [int(p["spec"].get("sl_max") or 0) for p in tuned["policies"].values()])
    data = replayable(data, args.data, args.split, repeats=args.mc_repeats, max_steps=sl_max)
    # Predictors that could not even be tuned stay listed as skipped, with the tuner's reason.
    skipped = {**tuned.get("skipped", {}), **skipped}


    def build(stage: Path):
        return write_report(build_report(data, tuned, cost, info, skipped, out_dir=stage), stage)

    with claim_output_dir(args.out, command=f"specstop eval --out {args.out}"):
        md = _write_staged(build, Path(args.out))
    log.info("report: %s", md)
    print(md.read_text())
    return 0
