"""``specstop train``: LightningCLI over :class:`PredictorModule` and the data modules.

Usage::

    specstop train --config configs/train/disco_ffn.yaml --data data/mbpp   # = --data.data_dir data/mbpp
    specstop train fit --config ...            # the same; ``fit`` is the default subcommand
    specstop train validate --config ... --ckpt_path best.ckpt
    specstop train --config ... --print_config

The model and data are given as ``class_path``/``init_args`` (subclass mode), so the online-mixing
module and data module are chosen from YAML like the offline ones. Input sizes are linked from
the dataset manifest (``data.hidden_size``/``data.k`` -> ``model.init_args.hidden_size``/``k``);
unknown keys are rejected by jsonargparse.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from specstop.errors import UserError
from specstop.memory import raise_if_tripped
from specstop.pair.identity import check_same_pair
from specstop.train.module import PredictorModule
from specstop.train.strategy import check_strategy, set_deepspeed_batch_size

log = logging.getLogger("specstop.train")

SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEFAULT_LOG_DIR = "runs/train"


class MemoryGuardCallback(Callback):
    """Stops training at the next batch once the memory guard has tripped (see specstop.memory)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        raise_if_tripped()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        raise_if_tripped()


class BestCheckpoint(ModelCheckpoint):
    """The ``checkpoint`` callback: the best epochs by the monitored metric (``--checkpoint.*``).

    A resumed run (``--ckpt_path``) logs into a new version folder, so its checkpoint folder differs
    from the one the resumed checkpoint recorded; Lightning then forgets the best score so far and
    would call the first epoch after the resume the best. Here the best so far is kept: its files
    stay where the first part of the run wrote them (Lightning never removes files outside this
    run's folder), and a later epoch replaces it only by beating its score, as in a run that was
    never interrupted.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state_dict)
            return
        best = state_dict.get("best_model_path") or ""
        if not best or not Path(best).exists():
            super().load_state_dict(state_dict)  # the earlier best is gone: start the ranking afresh
            return
        self.best_model_path = best
        self.best_model_score = state_dict.get("best_model_score")
        self.best_k_models = {p: s for p, s in (state_dict.get("best_k_models") or {}).items() if Path(p).exists()}
        self.kth_best_model_path = state_dict.get("kth_best_model_path", self.kth_best_model_path)
        self.kth_value = state_dict.get("kth_value", self.kth_value)


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` after every epoch (every validation), whatever the monitored metric did.

    Lightning 2's ``save_last=True`` writes last.ckpt only in a step where a best checkpoint was
    saved, so after Ctrl-C it could hold an epoch long past. This companion of :class:`BestCheckpoint`
    monitors nothing and keeps one file, ``last.ckpt`` (its ``best_model_path``), rewritten after
    every validation (or every training epoch when there is none). It runs after the best callback,
    so last.ckpt holds the best score up to its epoch and a resume ranks later epochs against it.
    """

    def __init__(self, best: ModelCheckpoint) -> None:
        super().__init__(
            dirpath=best.dirpath,
            filename=self.CHECKPOINT_NAME_LAST,
            monitor=None,
            save_top_k=1,
            save_last=False,
            save_weights_only=best.save_weights_only,
            enable_version_counter=False,
        )

    def load_state_dict(self, state_dict: dict) -> None:
        pass  # nothing to carry over: the resumed-from last.ckpt is never removed, the next epoch writes a new one


def add_last_checkpoint(trainer: L.Trainer) -> None:
    """Give the best callback a :class:`LastCheckpoint` when it asks for ``save_last``."""
    best = best_checkpoint_callback(trainer)
    if best is None or not best.save_last or any(isinstance(c, LastCheckpoint) for c in trainer.callbacks):
        return
    best.save_last = False  # written by the companion, after every epoch instead of after improvements only
    trainer.callbacks.append(LastCheckpoint(best))


def best_checkpoint_callback(trainer: L.Trainer) -> ModelCheckpoint | None:
    """The callback that ranks epochs by the monitored metric (not :class:`LastCheckpoint`)."""
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
                 and not isinstance(c, LastCheckpoint)), None)


class SpecstopCLI(LightningCLI):
    """LightningCLI with specstop defaults: best- and last-checkpoint callback, CSV + TensorBoard, links."""

    _argv: list[str] | None = None  # the command line, for the resume hint
    _trainer: L.Trainer | None = None  # set when fitting starts: what an interrupt outside an epoch kept

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(BestCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val_auroc",
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "best-{epoch:02d}-{val_auroc:.4f}",
                "checkpoint.auto_insert_metric_name": False,
                # last.ckpt after every epoch (LastCheckpoint): an interrupted run keeps its latest
                # epoch, not only its best.
                "checkpoint.save_last": True,
                "trainer.logger": [
                    {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": DEFAULT_LOG_DIR}},
                    {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": DEFAULT_LOG_DIR, "name": "lightning_logs"},
                    },
                ],
            }
        )
        describe_changed_defaults(parser)
        parser.add_argument(
            "--evaluate_after_fit",
            type=bool,
            default=True,
            help="after fit, evaluate the best checkpoint on validation (+ baselines) into metrics.json",
        )
        # Input sizes come from the dataset manifest, never from the config (apply_on=instantiate:
        # the data module reads the manifest when it is built).
        parser.link_arguments("data.hidden_size", "model.init_args.hidden_size", apply_on="instantiate")
        parser.link_arguments("data.k", "model.init_args.k", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the checkpoint's hyper-parameters here, first of all: the path is checked
        # before that read, so a wrong kind of file is one line rather than a torch traceback.
        sub = self.config.get("subcommand")
        if sub:
            check_resume_checkpoint(self.config[sub].get("ckpt_path"))
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy(cfg.trainer.strategy)
        # `--trainer.default_root_dir DIR` moves the whole run: loggers left at the default
        # save_dir follow it (otherwise checkpoints would land under runs/train regardless).
        root = cfg.trainer.get("default_root_dir")
        if root:
            for lg in cfg.trainer.get("logger") or []:
                init = lg.get("init_args") if hasattr(lg, "get") else None
                if init is not None and init.get("save_dir") == DEFAULT_LOG_DIR:
                    init["save_dir"] = str(root)
        if self.subcommand in (None, "fit"):
            check_train_outputs(cfg)  # before any data is read or an epoch is run

    def before_fit(self) -> None:
        set_deepspeed_batch_size(self.trainer, self.datamodule)
        align_logger_versions(self.trainer)
        add_last_checkpoint(self.trainer)
        SpecstopCLI._trainer = self.trainer
        self.trainer.callbacks.append(MemoryGuardCallback())
        self.trainer.callbacks.append(ResumeHintCallback(self._argv))
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        check_resume_pair(cfg.get("ckpt_path"), self.datamodule)

    def after_fit(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        report = finish_fit(self.trainer, self.model, self.datamodule, evaluate=cfg.get("evaluate_after_fit", True))
        if report.get("best_checkpoint"):
            print(f"best checkpoint: {report['best_checkpoint']}")
            print(f"metrics: {Path(report['metrics_path']).resolve()}")


#: Help of the Lightning arguments whose default specstop changes (Lightning's own text states
#: Lightning's default, which `specstop train` does not use).
CHANGED_DEFAULTS_HELP = {
    "checkpoint.monitor": "quantity that ranks the epochs (specstop: val_auroc, the validation AUROC; "
                          "Lightning's None keeps only the last epoch)",
    "checkpoint.mode": "max or min: whether a higher or a lower monitored value is better (specstop: max, "
                       "for val_auroc)",
    "checkpoint.save_top_k": "how many of the best epochs to keep (specstop: 1; 0 keeps none, -1 keeps all)",
    "checkpoint.filename": "the best checkpoints' file name, with named formatting fields (specstop: "
                           "best-{epoch:02d}-{val_auroc:.4f})",
    "checkpoint.auto_insert_metric_name": "put 'name=' before each formatted metric in filename (specstop: "
                                          "False, as the filename spells the names itself)",
    "checkpoint.save_last": "True (specstop's default) also writes last.ckpt after every epoch, whether or "
                            "not the epoch was the best, so an interrupted run resumes from its latest "
                            "epoch (--ckpt_path); 'link' links it instead of copying; False writes none",
    "trainer.logger": "the run's loggers (specstop: a CSVLogger and a TensorBoardLogger in "
                      f"{DEFAULT_LOG_DIR}, which --trainer.default_root_dir moves); False disables logging",
}


def describe_changed_defaults(parser) -> None:
    """Give the arguments whose default specstop changes a help that states specstop's default."""
    for action in parser._actions:
        if action.dest in CHANGED_DEFAULTS_HELP:
            action.help = CHANGED_DEFAULTS_HELP[action.dest]


def check_train_outputs(cfg) -> None:
    """Refuse, before any data is read, checkpoint and log folders that cannot be written."""
    from specstop.outputs import check_writable

    root = cfg.trainer.get("default_root_dir")
    places = {"--checkpoint.dirpath": cfg.get("checkpoint", {}).get("dirpath") if hasattr(cfg.get("checkpoint", {}), "get") else None}
    for lg in cfg.trainer.get("logger") or []:
        init = lg.get("init_args") if hasattr(lg, "get") else None
        if init is not None and init.get("save_dir"):
            places.setdefault("logger save_dir", init.get("save_dir"))
    if root:
        places["--trainer.default_root_dir"] = root
    for flag, folder in places.items():
        if folder:
            check_writable(folder, flag)


class ResumeHintCallback(Callback):
    """On Ctrl-C (or a crash) prints the one command that resumes from the last saved epoch."""

    def __init__(self, argv: list[str] | None) -> None:
        self.argv = [a for a in (argv or []) if a != "fit"]

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not trainer.is_global_zero or not isinstance(exception, KeyboardInterrupt):
            return
        print(resume_hint(trainer, self.argv), file=sys.stderr)


def resume_hint(trainer, argv: list[str]) -> str:
    """The one line printed when training is interrupted: what was kept and how to resume.

    The epoch and step it names are read back from the saved file, so the line says what a resume
    will start from.
    """
    last = next((c.best_model_path for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), "")
    if not last:  # `--checkpoint.save_last false`: Lightning's own last file, if any
        last = getattr(best_checkpoint_callback(trainer), "last_model_path", "")
    if not last or not Path(last).exists():
        return "specstop train: interrupted before the first epoch finished; nothing to resume: rerun the same command"
    args, skip = [], False
    for a in argv:  # an earlier --ckpt_path is replaced by the newest last.ckpt
        if skip:
            skip = False
            continue
        if a == "--ckpt_path":
            skip = True
            continue
        if not a.startswith("--ckpt_path="):
            args.append(a)
    cmd = shlex.join(["specstop", "train", *args, "--ckpt_path", str(Path(last).resolve())])
    progress = saved_progress(last)
    saved = f"epoch {progress[0]} (step {progress[1]})" if progress else "the latest saved epoch"
    return (
        f"specstop train: interrupted during epoch {trainer.current_epoch}; {saved} is saved in {last}: "
        f"resume with `{cmd}`"
    )


def saved_progress(path: str | Path) -> tuple[int, int] | None:
    """``(epoch, global step)`` recorded in a Lightning checkpoint file, or None when unreadable."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(ckpt["epoch"]), int(ckpt["global_step"])
    except Exception:  # a DeepSpeed folder, a file being replaced: the hint still names the path
        return None


#: ``--ckpt_path`` values Lightning resolves itself rather than reading as a path.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def check_resume_checkpoint(ckpt_path) -> None:
    """Refuse a ``--ckpt_path`` that is not a training checkpoint, in one line naming the flag.

    The path goes through the reader every checkpoint goes through
    (:func:`specstop.models.checkpoint.read_checkpoint_meta`), so a folder (other than a DeepSpeed
    checkpoint folder), a JSON or safetensors file, a file torch cannot read or a missing path is
    refused before the data is read, instead of failing inside Lightning's restore.
    """
    if not ckpt_path:
        return
    text = str(ckpt_path)
    if text in LIGHTNING_CKPT_NAMES or text.startswith("registry:"):
        return
    if (Path(text) / "checkpoint").is_dir():
        return  # a DeepSpeed checkpoint folder: its strategy restores it as it is
    from specstop.models.checkpoint import read_checkpoint_meta

    try:
        read_checkpoint_meta(text)
    except UserError as err:
        raise type(err)(f"--ckpt_path: {err}") from None


def check_resume_pair(ckpt_path, datamodule) -> None:
    """Refuse to resume (``--ckpt_path``) from a checkpoint trained on another model pair's data."""
    if not ckpt_path or not Path(str(ckpt_path)).is_file() or not hasattr(datamodule, "manifest"):
        return  # no resume, or Lightning's "last"/"best" shortcuts
    from specstop.models.checkpoint import read_checkpoint_meta

    dataset = read_checkpoint_meta(ckpt_path).get("dataset")
    check_same_pair(
        dataset.get("pair") if isinstance(dataset, dict) else None, datamodule.manifest.get("pair"),
        what=f"--ckpt_path {ckpt_path} was trained on data from another model pair than {datamodule.data_dir} holds",
        fix="resume with the dataset it was trained on, or start a new run without --ckpt_path",
    )


def align_logger_versions(trainer: L.Trainer) -> None:
    """Give every logger of the run the first logger's version, so one run is one folder.

    CSVLogger and TensorBoardLogger each pick the next free ``version_N`` on their own; with the
    same save_dir/name the second would pick N + 1 and split the run over two folders.
    """
    loggers = list(trainer.loggers)
    if len(loggers) < 2:
        return
    version = loggers[0].version
    for lg in loggers[1:]:
        if getattr(lg, "_version", "unset") is None:
            lg._version = version


def finish_fit(trainer: L.Trainer, model: PredictorModule, datamodule, *, evaluate: bool = True) -> dict:
    """Evaluate the best checkpoint and write ``metrics.json`` next to it.

    Returns:
        ``{"best_checkpoint", "metrics_path", "metrics"}`` (empty on non-zero ranks).
    """
    if not trainer.is_global_zero:
        return {}
    ckpt_cb = best_checkpoint_callback(trainer)
    best = getattr(ckpt_cb, "best_model_path", "") if ckpt_cb is not None else ""
    if not best:
        log.warning("no checkpoint was saved (no validation metric to monitor?); metrics.json not written")
        return {}
    if Path(best).is_dir():  # DeepSpeed writes a folder of ZeRO shards
        from specstop.models.checkpoint import convert_zero_checkpoint

        best = str(convert_zero_checkpoint(best))
    metrics: dict = {
        "best_checkpoint": str(Path(best).resolve()),
        "monitor": getattr(ckpt_cb, "monitor", None),
        "best_score": float(ckpt_cb.best_model_score) if ckpt_cb.best_model_score is not None else None,
        "family": model.family,
        "label": model.label,
        "w_acc": model.w_acc,
        "w_rej": model.w_rej,
        "predictor_config": model.predictor.config_dict(),
    }
    if evaluate and hasattr(datamodule, "splits"):
        from specstop.models.checkpoint import load_predictor
        from specstop.train.evaluate import evaluate_predictor

        predictor, _ = load_predictor(best)
        metrics["validation"] = evaluate_predictor(
            predictor, datamodule, "validation", threshold=model.hparams.get("f1_threshold")
        )
    else:
        metrics["validation"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    path = Path(best).parent / "metrics.json"
    path.write_text(json.dumps(metrics, indent=2, default=float) + "\n")
    return {"best_checkpoint": metrics["best_checkpoint"], "metrics_path": str(path), "metrics": metrics}


def build_cli(args=None, *, run: bool = True) -> SpecstopCLI:
    """Construct the CLI (``run=False``: parse + instantiate only; ``args``: list or dict)."""
    return SpecstopCLI(
        PredictorModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        auto_configure_optimizers=False,  # one place to set the optimiser: model.init_args.lr/schedule
        save_config_kwargs={"overwrite": True},
        # run=True (`specstop train`): parse errors are raised, and main() turns them into one line.
        parser_kwargs=(
            {"exit_on_error": False, **{sub: {"exit_on_error": False} for sub in SUBCOMMANDS},
             "fit": {"description": "train a stopping predictor", "exit_on_error": False}}
            if run else {}
        ),
        seed_everything_default=0,
    )


def with_default_subcommand(argv: list[str]) -> list[str]:
    """``--config X ...`` -> ``fit --config X ...`` (``fit`` is implied unless help is asked)."""
    if not argv or argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help"):
        return argv
    if any(a in SUBCOMMANDS for a in argv if not a.startswith("-")) and argv[0] not in SUBCOMMANDS:
        # A subcommand given after options (``--config X fit``) is not valid LightningCLI syntax.
        sub = next(a for a in argv if a in SUBCOMMANDS)
        raise SystemExit(f"specstop train: put the subcommand first: specstop train {sub} {' '.join(a for a in argv if a != sub)}")
    return ["fit", *argv]


def with_data_shorthand(argv: list[str]) -> list[str]:
    """``--data DIR`` (a dataset folder, the spelling every other command uses) -> ``--data.data_dir DIR``.

    LightningCLI's own ``--data`` takes a data-module class or config; a value that is a dataset
    folder (it holds ``manifest.json``) can only mean the folder, so it is rewritten.
    """
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--data" and (Path(out[i + 1]) / "manifest.json").is_file():
            out[i] = "--data.data_dir"
    return out


def main(argv: list[str] | None = None) -> int:
    argv = with_data_shorthand(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings():
        # `specstop train ARGS` hands LightningCLI the arguments after the subcommand while
        # sys.argv still holds the whole command line (Lightning's DDP launcher re-runs it per
        # rank, so it must stay as is); LightningCLI warns about exactly this combination.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        from specstop.config_io import check_yaml_file
        from specstop.train.launch import _flag_values

        for path in _flag_values(argv, "--config"):  # duplicate keys / sections: file:line, before Lightning reads it
            if Path(path).is_file():
                check_yaml_file(path, "train config")
        try:
            SpecstopCLI._argv, SpecstopCLI._trainer = argv, None
            build_cli(with_default_subcommand(argv), run=True)
        except argparse.ArgumentError as err:
            raise UserError(summarize_parse_error(str(err))) from None
        except KeyboardInterrupt:
            # Outside the epochs (reading the data, building the model, the final evaluation): say what
            # is saved, so no resume names a last.ckpt that was never written.
            raise KeyboardInterrupt(interrupted_outside_epochs(SpecstopCLI._trainer, argv)) from None
    return 0


def interrupted_outside_epochs(trainer: L.Trainer | None, argv: list[str]) -> str:
    """What an interrupt outside the training epochs kept, without the ``specstop train:`` prefix: the
    resume command of the last saved epoch (:func:`resume_hint`), or that nothing was saved yet."""
    if trainer is None:
        return "interrupted before training started; nothing was saved: rerun the same command"
    return resume_hint(trainer, [a for a in argv if a != "fit"]).removeprefix("specstop train: ")


def summarize_parse_error(text: str) -> str:
    """jsonargparse's nested error report -> ``config key 'data.batch_size': Expected a <class 'int'>. Got value: eight``.

    The report nests ``Parser key "X":`` lines (one per level of class_path/init_args); the line
    after the innermost one says what was expected. Unrecognised reports are joined into one line.
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keys, detail = [], None
    for i, ln in enumerate(lines):
        m = re.match(r'Parser key "([^"]+)":?\s*(.*)', ln)
        if m:
            keys.append(m.group(1))
            detail = m.group(2) or (lines[i + 1] if i + 1 < len(lines) else "")
    if not keys:
        return " ".join(lines) + " (see `specstop train --help`)"
    nested = next((m.group(1) for ln in lines if (m := re.search(r"NestedArg\(key='([^']+)'", ln))), None)
    if nested and str(detail).startswith("Does not validate"):
        key = ".".join([*keys, nested])
        return (
            f"config key {key!r} is unknown or its value is invalid for this class (the valid keys and their "
            "types: `specstop train --config X --print_config`)"
        )
    return (
        f"config key {'.'.join(keys)!r}: {detail} (fix the value in the YAML or the --{'.'.join(keys)} flag; "
        "`specstop train --config X --print_config` shows the resolved config)"
    )
