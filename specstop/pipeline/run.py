"""The stage order of ``specstop pipeline``: each stage is the public command a user would type."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from specstop.errors import UserError
from specstop.pipeline.config import PipelineConfig, decoding_slug
from specstop.pipeline.online_check import online_check
from specstop.pipeline.report import write_run_report
from specstop.pipeline.stages import StageRunner

log = logging.getLogger("specstop")


def _cli(argv: list[str]) -> None:
    """Run one specstop subcommand in-process; its errors propagate with their own type.

    A user error inside a stage therefore reaches ``specstop pipeline`` as a one-line error naming
    the stage, and a bug keeps its traceback (``specstop.cli.main`` would turn both into an exit code).
    """
    from specstop.cli import run_command

    log.info("$ specstop %s", " ".join(argv))
    rc = run_command(argv[0], argv[1:])
    if rc:
        raise RuntimeError(f"`specstop {' '.join(argv)}` failed with exit code {rc}")


def _pair_args(cfg: PipelineConfig) -> list[str]:
    if cfg.draft or cfg.target:
        return ["--draft", str(cfg.draft), "--target", str(cfg.target)]
    if not cfg.pair:
        raise UserError("the pipeline config needs `pair:` (a known name or a folder) or `draft:` + `target:`")
    return ["--pair", str(cfg.pair)]


def _write_generate_config(cfg: PipelineConfig, data: dict, out: Path, path: Path) -> None:
    conf = dict(data)
    for key in ("pair", "draft", "target", "out"):
        conf.pop(key, None)
    if cfg.draft or cfg.target:
        conf["draft"], conf["target"] = cfg.draft, cfg.target
    else:
        conf["pair"] = cfg.pair
    conf["out"] = str(out)
    conf.setdefault("dtype", cfg.dtype)
    if cfg.device:
        conf.setdefault("device", cfg.device)
    if cfg.draft_quant:
        conf.setdefault("draft_quant", cfg.draft_quant)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(conf, sort_keys=False))


def _find_best_checkpoint(root: Path) -> tuple[str, dict]:
    """The newest ``metrics.json`` written by `specstop train` under ``root``."""
    found = sorted(root.rglob("metrics.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"training under {root} wrote no metrics.json / best checkpoint")
    metrics = json.loads(found[-1].read_text())
    return metrics["best_checkpoint"], metrics


def run_pipeline(cfg: PipelineConfig, *, force: bool = False) -> dict:
    """Run (or resume) the pipeline; returns the summary dict also written to report.json.

    The run folder is locked for the run (a second pipeline on it is refused; a lock left by a
    killed run is detected by its pid and taken over).
    """
    from specstop.outputs import claim_output_dir

    with claim_output_dir(cfg.run_dir, command=f"specstop pipeline (run_dir {cfg.run_dir})"):
        return _run_stages(cfg, force=force)


def _run_stages(cfg: PipelineConfig, *, force: bool = False) -> dict:
    """:func:`run_pipeline` once the run folder is claimed."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = StageRunner(run_dir, force=force)
    t_start = time.perf_counter()

    # 1. the pair
    from specstop.pair.registry import KNOWN_PAIRS, is_converted

    if cfg.fetch and cfg.pair in KNOWN_PAIRS:
        runner.run(
            "fetch",
            {"pair": cfg.pair},
            [],
            lambda: (_cli(["fetch-pair", cfg.pair]) or {"pair": cfg.pair}),
            outputs_exist=lambda _o: is_converted(cfg.pair),
        )

    # 2. data (and the optional transfer test set)
    def _generate_stage(name: str, data_cfg: dict) -> Path:
        out = run_dir / name
        conf_path = run_dir / "configs" / f"{name}.yaml"
        _write_generate_config(cfg, data_cfg, out, conf_path)
        def generate() -> dict:
            from specstop.data_gen.runner import DataFolderConflict

            try:
                _cli(["generate", "--config", str(conf_path)])
            except DataFolderConflict as err:
                # The folder is the run's own RUN/<stage>, not a --data the user gave: say so.
                section = {"data": "data section", "test_data": "test_data section"}.get(
                    name, "data section or its also_decoding entry")
                raise UserError(
                    f"{err.problem}; the pipeline's {section} or pair changed since {out} was made: restore them, "
                    f"give a new run_dir (--run-dir), or delete {out} to make that data again"
                ) from None
            return {"data_dir": str(out)}

        runner.run(
            name,
            {"data": data_cfg, "pair": [cfg.pair, cfg.draft, cfg.target], "dtype": cfg.dtype, **_quant(cfg)},
            ["fetch"],
            generate,
            outputs_exist=lambda o: (Path(o.get("data_dir", "")) / "manifest.json").is_file(),
        )
        return out

    data_dir = _generate_stage("data", cfg.data)
    eval_data = _generate_stage("test_data", cfg.test_data) if cfg.test_data else data_dir
    # Each other decoding setting: its own dataset, its own tuned file (step 5), one export (step 7).
    settings = {decoding_slug(setting): setting for setting in cfg.also_decoding}
    setting_data = {slug: _generate_stage(f"data_{slug}", cfg.decoding_data(setting)) for slug, setting in settings.items()}

    # 3. train each family
    checkpoints: dict[str, str] = {}
    train_metrics: dict[str, dict] = {}
    for fam in cfg.families:
        root = run_dir / "train" / fam.name

        def _train(fam=fam, root=root) -> dict:
            from specstop.train.launch import run_train

            # Multi-device runs train in a child process: Lightning relaunches the command per rank.
            run_train(["--config", fam.config, "--data.data_dir", str(data_dir),
                       "--trainer.default_root_dir", str(root), *fam.train_args()])
            ckpt, metrics = _find_best_checkpoint(root)
            return {"checkpoint": ckpt, "metrics": metrics.get("metrics", metrics)}

        cfg_text = Path(fam.config).read_text() if Path(fam.config).is_file() else fam.config
        res = runner.run(
            f"train_{fam.name}",
            {"config": cfg_text, "args": fam.train_args()},
            ["data"],
            _train,
            outputs_exist=lambda o: Path(o.get("checkpoint", "")).is_file(),
        )
        checkpoints[fam.name] = res.outputs["checkpoint"]
        train_metrics[fam.name] = res.outputs.get("metrics", {})

    # 4. cost model
    cost_arg = cfg.cost_model
    if cfg.cost_model == "calibrate":
        # Measured where decoding runs: same pair, dtype and device, the evaluation data's context length,
        # and each trained predictor's own decision per draft step (a learned head costs more than a rule).
        cost_path = run_dir / "cost.json"
        options = cfg.stage_args("calibrate")
        runner.run(
            "calibrate",
            {"pair": [cfg.pair, cfg.draft, cfg.target], "dtype": cfg.dtype, "device": cfg.device,
             "budget": cfg.calibrate_budget, **({"options": options} if options else {}), **_quant(cfg),
             "checkpoints": checkpoints},
            ["fetch", "data", "test_data", *[f"train_{f.name}" for f in cfg.families]],
            lambda: (_cli(calibrate_argv(cfg, cost_path, eval_data, checkpoints)) or {"cost": str(cost_path)}),
            # A table that failed its check is measured again on a rerun (unless it is to be used anyway).
            outputs_exist=lambda o: Path(o.get("cost", "")).is_file() and (cfg.force_cost or _cost_passes(o["cost"])),
        )
        cost_arg = str(cost_path)

    # 5. tune on validation
    tuned = run_dir / "tuned.json"
    tune_argv = ["tune", "--data", str(data_dir), "--cost-model", cost_arg, "--out", str(tuned), *cfg.stage_args("tune")]
    if cfg.force_cost:
        tune_argv.append("--force-cost")
    for name, ckpt in checkpoints.items():
        tune_argv += ["--checkpoint", f"{name}={ckpt}"]
    trains = [f"train_{f.name}" for f in cfg.families]
    # The stack is tuned once, on the main data (its replay is greedy); the other settings' tunes omit it.
    main_tune = [*tune_argv, *(["--levels", cfg.levels] if cfg.levels else [])]
    runner.run(
        "tune",
        {"args": main_tune[1:]},
        ["data", *trains, "calibrate"],
        lambda: (_cli(main_tune) or {"tuned": str(tuned)}),
        outputs_exist=lambda o: Path(o.get("tuned", "")).is_file(),
    )
    setting_tuned = {}
    for slug, sdata in setting_data.items():  # the same predictors and costs, tuned on that setting's data
        out = run_dir / f"tuned_{slug}.json"
        argv = [tune_argv[0], "--data", str(sdata), *tune_argv[3:]]
        argv[argv.index("--out") + 1] = str(out)
        runner.run(
            f"tune_{slug}",
            {"args": argv[1:]},
            [f"data_{slug}", *trains, "calibrate"],
            lambda argv=argv, out=out: (_cli(argv) or {"tuned": str(out)}),
            outputs_exist=lambda o: Path(o.get("tuned", "")).is_file(),
        )
        setting_tuned[slug] = out

    # 6. evaluate on the test split (of the transfer set when given)
    eval_dir = run_dir / "eval"
    eval_argv = ["eval", "--data", str(eval_data), "--tuned", str(tuned), "--out", str(eval_dir), "--overwrite",
                 *cfg.stage_args("eval")]  # --overwrite: a rerun stage replaces its own report
    if cfg.force_cost:
        eval_argv.append("--force-cost")
    runner.run(
        "eval",
        {"args": eval_argv[1:]},
        ["tune", "test_data", "data"],
        lambda: (_cli(eval_argv) or {"report": str(eval_dir / "report.json")}),
        outputs_exist=lambda o: Path(o.get("report", "")).is_file(),
    )

    # 7. export the chosen policy
    export_dir = run_dir / "export"
    tuned_doc = json.loads(tuned.read_text())
    policy_name = tuned_doc.get("best") if cfg.export_policy == "best" else cfg.export_policy
    family = (tuned_doc.get("policies", {}).get(policy_name, {}).get("spec") or {}).get("family")
    # --overwrite: the stage reruns only when its inputs changed, and then replaces its own export.
    export_argv = ["export", "--tuned", str(tuned), "--policy", str(policy_name), "--out", str(export_dir), "--overwrite"]
    if family and family in checkpoints:
        export_argv += ["--checkpoint", checkpoints[family]]
    for out in setting_tuned.values():
        export_argv += ["--also-tuned", str(out)]
    runner.run(
        "export",
        {"args": export_argv[1:]},
        ["tune", *[f"tune_{slug}" for slug in setting_tuned]],
        lambda: (_cli(export_argv) or {"export": str(export_dir)}),
        outputs_exist=lambda o: (Path(o.get("export", "")) / "config.json").is_file(),
    )

    if cfg.levels:  # the jointly tuned stack, exported beside the pair's policy
        levels_dir = run_dir / "export_levels"
        levels_argv = ["export", "--tuned", str(tuned), "--policy", "levels", "--out", str(levels_dir), "--overwrite"]
        runner.run(
            "export_levels",
            {"args": levels_argv[1:]},
            ["tune"],
            lambda: (_cli(levels_argv) or {"export": str(levels_dir)}),
            outputs_exist=lambda o: (Path(o.get("export", "")) / "config.json").is_file(),
        )

    # 8. a short online check with the real decoder: lossless + measured speed
    online_path = run_dir / "online.json"
    if cfg.online_prompts > 0:
        runner.run(
            "online",
            {"n": cfg.online_prompts, "repeats": cfg.online_repeats, "max_new_tokens": cfg.online_max_new_tokens,
             "dtype": cfg.dtype, "hf_default": cfg.online_hf_default, "budget": cfg.online_budget, **_quant(cfg)},
            ["export", "eval", "calibrate"],
            lambda: online_check(cfg, eval_data, export_dir, tuned, eval_dir / "report.json", cost_arg, online_path),
            outputs_exist=lambda o: Path(o.get("online", "")).is_file(),
        )

    summary = write_run_report(cfg, runner, eval_dir, online_path, export_dir, train_metrics, time.perf_counter() - t_start)
    return summary


def calibrate_argv(cfg: PipelineConfig, cost_path: Path, eval_data: Path, checkpoints: dict | None = None) -> list[str]:
    """The calibrate stage's command: this pair, dtype and device at the evaluation data's context,
    for ``calibrate_budget`` seconds, with the ``calibrate:`` section's settings; each trained
    predictor's decision per draft step is timed too (``checkpoints``: family -> checkpoint)."""
    return ["calibrate-cost", *_pair_args(cfg), "--dtype", cfg.dtype, "--out", str(cost_path),
            "--data", str(eval_data), "--budget", str(cfg.calibrate_budget),
            *(["--device", cfg.device] if cfg.device else []),
            *(["--draft-quant", cfg.draft_quant] if cfg.draft_quant else []),
            *[arg for name, ckpt in (checkpoints or {}).items() for arg in ("--checkpoint", f"{name}={ckpt}")],
            *cfg.stage_args("calibrate")]


def _quant(cfg: PipelineConfig) -> dict:
    """A stage's record of the draft's quantization: only when set, so runs made before it existed resume."""
    return {"draft_quant": cfg.draft_quant} if cfg.draft_quant else {}


def _cost_passes(path: str) -> bool:
    """Does the calibrated table at ``path`` pass its check (:mod:`specstop.eval.cost_check`)?"""
    from specstop.eval.cost import load_cost_model
    from specstop.eval.cost_check import table_problems

    try:
        return not table_problems(load_cost_model(path))
    except ValueError:
        return False
