"""``specstop sweep``: train a grid of predictors and tabulate them like SpecDec++ Table 3.

    specstop sweep --config configs/train/specdecpp_resnet.yaml --data-dir DATA \
        --w-rej 1,3,6,12 --depth 0,1,2,3,4 [--lr 5e-5,1e-4] --out runs/sweep

Every grid point is the base config with ``model.init_args.w_rej``, ``predictor_config.depth``
(and ``lr``) replaced, trained in-process; its loggers and checkpoint go to ``OUT/<run>/``.
The table (``OUT/sweep.md`` + ``OUT/sweep.json``) lists train/validation binary KL and AUROC,
validation F1, and - when ``specstop.eval.tune`` provides ``best_throughput(checkpoint, data_dir)
-> {"throughput", "threshold"}`` - the best simulated throughput and its threshold.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from specstop.config_cli import setting
from specstop.config_io import read_yaml
from specstop.errors import UserError
from specstop.outputs import atomic_write_text

log = logging.getLogger("specstop.sweep")


def _floats(text: str | None) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()] if text else []


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()] if text else []


@dataclass
class SweepSettings:
    """The grid `specstop sweep` trains and where it writes."""

    config: str | None = setting(None, flags=("--config",), required=True)
    """Base train YAML (configs/train/*.yaml)."""
    w_rej: str = setting("1,3,6,12", flags=("--w-rej",))
    """Comma list of reject weights (SpecDec++: 1,3,6,12)."""
    depth: str = setting("", flags=("--depth",))
    """Comma list of ResNet depths D (specdecpp_resnet only); empty = the config's."""
    lr: str = setting("", flags=("--lr",))
    """Comma list of learning rates; empty = the config's."""
    data_dir: str | None = setting(None, flags=("--data",), deprecated=("--data-dir",), metavar="DIR")
    """Dataset folder (overrides data.init_args.data_dir)."""
    max_epochs: int | None = setting(None, flags=("--max-epochs",))
    """Override trainer.max_epochs."""
    out: str | None = setting(None, flags=("--out",), required=True)
    """Output folder (runs + sweep.md + sweep.json)."""
    no_baselines: bool = setting(False, flags=("--no-baselines",), negatable=False)
    """Skip the logistic-regression/static baselines."""
    cost_model: str = setting("llama2-7b-70b", flags=("--cost-model",))
    """Cost model for the simulated-throughput column: a cost.json from `specstop calibrate-cost` (this
    machine) or a preset (default llama2-7b-70b: SpecDec++'s A100 figures, NOT this machine)."""


def command():
    """The parser (``--config`` here is the base train YAML, a setting of its own)."""
    from specstop.config_cli import TypedCommand

    return TypedCommand(SweepSettings, prog="specstop sweep", config_flag=False,
                        description="train a grid of predictors and tabulate them (SpecDec++ Table 3)")


def main(argv: list[str]) -> int:
    args, _ = command().parse(argv)
    return run(args)


def _grid_config(base: dict, out: Path, name: str, w_rej: float, depth: int | None, lr: float | None, args) -> dict:
    cfg = json.loads(json.dumps(base))  # deep copy of plain YAML data
    model = cfg.setdefault("model", {})
    init = model.setdefault("init_args", {}) if "class_path" in model else model
    init["w_rej"] = w_rej
    if depth is not None:
        init.setdefault("predictor_config", {})
        init["predictor_config"] = {**(init["predictor_config"] or {}), "depth": depth}
    if lr is not None:
        init["lr"] = lr
    data = cfg.setdefault("data", {})
    dinit = data.setdefault("init_args", {}) if "class_path" in data else data
    if args.data_dir:
        dinit["data_dir"] = args.data_dir
    trainer = cfg.setdefault("trainer", {})
    if args.max_epochs is not None:
        trainer["max_epochs"] = args.max_epochs
    trainer["logger"] = [
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out), "name": name}},
    ]
    trainer.setdefault("enable_progress_bar", False)
    cfg.setdefault("checkpoint", {})["dirpath"] = str(out / name / "checkpoints")
    cfg["evaluate_after_fit"] = False
    return cfg


def _simulated_throughput(ckpt: str, data_dir: str, cost_model: str) -> dict:
    """The checkpoint's exactly tuned throughput on validation, or ``{"error": why}`` (the row says it)."""
    from specstop.eval.tune import best_throughput

    try:
        return best_throughput(ckpt, data_dir, cost_model=cost_model)
    except (UserError, ValueError, KeyError) as err:  # the table is still useful without this column
        log.warning("simulated throughput failed for %s: %s", ckpt, err)
        return {"error": f"{type(err).__name__}: {err}"}


def run_grid(args) -> list[dict]:
    from specstop.models.checkpoint import load_predictor
    from specstop.outputs import check_writable
    from specstop.train.cli import build_cli
    from specstop.train.evaluate import evaluate_predictor
    from specstop.train.launch import requested_processes, run_train

    base = read_yaml(args.config, "train config") or {}
    out = check_writable(args.out, "--out")  # before the first of many trainings
    out.mkdir(parents=True, exist_ok=True)
    depths = _ints(args.depth) or [None]
    lrs = _floats(args.lr) or [None]
    rows = []
    for w_rej, depth, lr in itertools.product(_floats(args.w_rej) or [1.0], depths, lrs):
        name = f"wrej{w_rej:g}" + (f"_D{depth}" if depth is not None else "") + (f"_lr{lr:g}" if lr is not None else "")
        log.info("sweep: training %s", name)
        cfg = _grid_config(base, out, name, w_rej, depth, lr, args)
        conf_path = out / name / "config.yaml"
        conf_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(conf_path, yaml.safe_dump(cfg, sort_keys=False))
        if requested_processes(["--config", str(conf_path)]) > 1:
            # Several devices: Lightning relaunches the training command per rank, so it must be
            # its own `specstop train` process (not this sweep); evaluate its best checkpoint here.
            run_train(["--config", str(conf_path)])
            best = json.loads((out / name / "checkpoints" / "metrics.json").read_text())["best_checkpoint"]
            one = {**cfg, "trainer": {**cfg["trainer"], "devices": 1, "strategy": "auto", "num_nodes": 1}}
            cli = build_cli(one, run=False)
        else:
            cli = build_cli(cfg, run=False)
            cli.trainer.fit(cli.model, cli.datamodule)
            best = cli.trainer.checkpoint_callback.best_model_path
        predictor, _ = load_predictor(best)
        dm = cli.datamodule
        val = evaluate_predictor(predictor, dm, "validation", baselines=not args.no_baselines)
        train = evaluate_predictor(predictor, dm, "train", baselines=False)
        row = {
            "run": name,
            "w_rej": w_rej,
            "depth": depth,
            "lr": lr if lr is not None else cli.model.hparams.lr,
            "train_kl": train.get("kl"),
            "val_kl": val.get("kl"),
            "train_auroc": train.get("auroc"),
            "val_auroc": val.get("auroc"),
            "val_f1": val.get("f1"),
            "checkpoint": str(Path(best).resolve()),
            "simulated": _simulated_throughput(best, dm.data_dir, args.cost_model),
            "validation": val,
        }
        rows.append(row)
        _write(out, rows)  # after every run: a crashed sweep keeps its finished rows
    return rows


def _fmt(v, nd=4) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _write(out: Path, rows: list[dict]) -> None:
    atomic_write_text(out / "sweep.json", json.dumps(rows, indent=2, default=float) + "\n")
    lines = [
        "| w_rej | D | lr | train KL | val KL | train AUROC | val AUROC | val F1 | best sim. throughput (h) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        sim = r.get("simulated")
        sim_s = (f"{sim['throughput']:.2f} ({sim['threshold']:.3g})" if sim and "throughput" in sim
                 else f"n/a ({(sim or {}).get('error', 'not computed')[:120]})")
        lines.append(
            f"| {r['w_rej']:g} | {'-' if r['depth'] is None else r['depth']} | {r['lr']:g} | {_fmt(r['train_kl'])} | "
            f"{_fmt(r['val_kl'])} | {_fmt(r['train_auroc'])} | {_fmt(r['val_auroc'])} | {_fmt(r['val_f1'])} | {sim_s} |"
        )
    note = (
        "\nKL: mean binary KL(true || predicted acceptance) in nats (SpecDec++ Table 3), of the best "
        "checkpoint (by the config's monitor) on each split.\n"
    )
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n" + note)


def run(args) -> int:
    rows = run_grid(args)
    print((Path(args.out) / "sweep.md").read_text())
    print(f"wrote {Path(args.out) / 'sweep.md'} and sweep.json ({len(rows)} runs)")
    return 0
