"""``specstop pipeline --config FILE``: every setting of the YAML is also a flag (``--run-dir``,
``--online-prompts 0`` ...), which overrides the file."""

from __future__ import annotations

from specstop.config_cli import TypedCommand
from specstop.errors import UserError
from specstop.pipeline.config import PipelineConfig
from specstop.pipeline.report import headline_table, provenance_line


def command() -> TypedCommand:
    """The parser: every :class:`PipelineConfig` setting, ``--config`` and ``--force``."""
    cmd = TypedCommand(PipelineConfig, prog="specstop pipeline",
                       description="pair -> data -> train -> tune -> eval -> export -> online check, resumable",
                       load_file=PipelineConfig.from_yaml,
                       config_help="pipeline YAML (configs/pipelines/*.yaml); flags override it")
    cmd.add_argument("--force", action="store_true", help="rerun every stage even if unchanged")
    return cmd


def main(argv: list[str]) -> int:
    from specstop.pipeline.run import run_pipeline

    cmd = command()
    cfg, flags = cmd.parse(argv)
    if not flags.config:
        raise UserError("no pipeline config: pass --config FILE (configs/pipelines/*.yaml)")
    # A section checked here may hold values from flags over the file: the message names both.
    given = cmd.section_flags
    cfg.validate(f"{flags.config} with {', '.join(given)}" if given else flags.config)
    summary = run_pipeline(cfg, force=flags.force)
    print()
    print("stages:")
    for st in summary["stages"]:
        peak = f"  peak {st['peak_rss'] / 1e9:5.1f} GB" if st.get("peak_rss") else ""
        print(f"  {st['name']:<22} {st['status']:<7} {st['seconds']:8.1f} s{peak}")
    print()
    print(provenance_line(summary["eval"]))
    print()
    print(headline_table(summary["eval"]))
    print()
    if summary.get("online"):
        print("Online check:")
        print(summary["online"].get("markdown", ""))
        print()
    print(f"report: {summary['report']}")
    print(f"replay report: {summary['eval_report']}")
    print(f"export: {summary['export']}")
    print(f"wall time: {summary['seconds']:.0f} s")
    return 0
