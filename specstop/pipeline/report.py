"""The pipeline's report.md / report.json: headline replay table, online check, metrics, stages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specstop.jsonio import atomic_write_json
from specstop.pipeline.stages import StageRunner


def headline_table(report: dict) -> str:
    """Speedup of each policy over target only and over Static SL-opt, from eval's report.json."""
    rows = report.get("rows") or {}
    lines = ["| policy | latency/token (s) | speedup vs target | vs Static SL-opt |", "|---|---:|---:|---:|"]
    for row in rows.values():
        lat, sp, imp = row.get("latency_per_token"), row.get("speedup"), row.get("improvement_over_static_opt")
        if lat is None or sp is None:
            continue
        vs = "" if imp is None else f"{100 * imp:+.1f}%"
        lines.append(f"| {row.get('label')} | {lat:.4f} | {sp:.3f}x | {vs} |")
    for name, why in (report.get("skipped") or {}).items():
        lines.append(f"| {name} | skipped: {why} | | |")
    return "\n".join(lines)


def provenance_line(report: dict) -> str:
    """The eval report's cost model in one line (says so when it is a preset, not this machine)."""
    from specstop.eval.cost import CostModel

    c = report.get("cost_model")
    return CostModel.from_dict(c).provenance_line() if c else "No eval report yet."


def family_metrics_table(train_metrics: dict) -> str:
    """One row per trained family: its label, the rows it was scored on and the validation metrics."""
    cols = ("auroc", "ap", "f1", "ece", "kl")
    lines = ["| family | label | table (rows) | monitor (best) | " + " | ".join(c.upper() for c in cols) + " |",
             "|---|---|---|---|" + "---:|" * len(cols)]
    for fam, m in train_metrics.items():
        m = m or {}
        v = m.get("validation") or {}
        best = m.get("best_score")
        lines.append(
            f"| {fam} | {m.get('label', '-')} | {v.get('table', '-')} ({v.get('rows', '-')}) | "
            f"{m.get('monitor', '-')} ({'-' if best is None else f'{best:.4f}'}) | "
            + " | ".join("-" if v.get(c) is None else f"{v[c]:.4f}" for c in cols) + " |"
        )
    return "\n".join(lines)


def by_decoding_table(export_dir: Path) -> str | None:
    """The exported policy per decoding setting with the validation speedup its tune reported (None when
    the export has one setting)."""
    from specstop.export.by_decoding import describe
    from specstop.policy import PolicySpec

    path = Path(export_dir) / "config.json"
    entries = (json.loads(path.read_text()).get("by_decoding") or []) if path.is_file() else []
    if not entries:
        return None
    lines = ["| decoding | policy (SL_max) | validation speedup (replay) | tuned file |", "|---|---|---:|---|"]
    for e in entries:
        spec = PolicySpec.from_dict(e["policy"])
        sp = e.get("speedup")
        lines.append(f"| {describe(e['decoding'])} | {spec.label} ({spec.sl_max}) | "
                     f"{'-' if sp is None else f'{sp:.3f}x'} | `{(e.get('source') or {}).get('tuned')}` |")
    return "\n".join(lines)


def write_run_report(cfg, runner: StageRunner, eval_dir: Path, online_path: Path, export_dir: Path,
                     train_metrics: dict, seconds: float) -> dict:
    run_dir = Path(cfg.run_dir)
    report = json.loads((eval_dir / "report.json").read_text()) if (eval_dir / "report.json").is_file() else {}
    online = json.loads(online_path.read_text()) if online_path.is_file() else None
    table = headline_table(report)
    summary = {
        "run_dir": str(run_dir),
        "report": str(run_dir / "report.md"),
        "eval_report": str(eval_dir / "report.md"),
        "export": str(export_dir),
        "stages": [dataclasses.asdict(r) for r in runner.results],
        "train_metrics": train_metrics,
        "online": online,
        "eval": report,
        "seconds": seconds,
    }
    md = [f"# specstop pipeline report: {run_dir}", "", f"**{provenance_line(report)}**", "",
          "## Headline (replay, test split)", "", table, "",
          f"Full replay report: `{eval_dir / 'report.md'}`; export: `{export_dir}`.", ""]
    settings = by_decoding_table(export_dir)
    if settings:
        md += ["## The exported policy per decoding setting", "",
               "Decoders use the row for their request's setting (greedy: greedy; sampled: the nearest temperature).",
               "", settings, ""]
    if online:
        md += [f"## Online check (real decoding, {'sampled' if online.get('sampled') else 'greedy'})", "",
               f"dtype: {(online.get('dtype') or {}).get('dtype')} ({(online.get('dtype') or {}).get('reason')}); "
               "decoding is lossless relative to the target in this dtype (bf16 near-ties can flip between "
               "batched verification and single-token steps; listed below).", "",
               online.get("markdown", ""), ""]
    md += ["## Validation metrics per family (best checkpoint)", "", family_metrics_table(train_metrics), ""]
    md += ["", "## Stages", "", runner.summary_table(), "", f"Total wall time: {seconds:.0f} s", ""]
    (run_dir / "report.md").write_text("\n".join(md))
    atomic_write_json(run_dir / "report.json", summary)
    return summary
