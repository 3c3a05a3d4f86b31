"""The ``specstop`` command: one entry point, one subcommand per stage.

Subcommand modules are imported lazily, so ``specstop --help`` and light commands start fast and
do not import Lightning or datasets. Each provides ``main(argv) -> int``. Every command's settings
and flags come from one dataclass through :mod:`specstop.config_cli` (jsonargparse); ``train``
goes through LightningCLI, the same parser over the training classes.

Errors: a :class:`~specstop.errors.UserError` (bad input the user can fix) is printed as one line
and exits with status 2; anything else is a bug and keeps its traceback. ``SPECSTOP_DEBUG=1`` or
``-v`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from specstop import __version__
from specstop.errors import UserError, find_user_error
from specstop.log import setup_logging

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fetch-pair": ("specstop.pair.fetch_cli", "download, verify and convert a named reference model pair"),
    "info": ("specstop.pair.info_cli", "print a pair's models, tokenizer, parameter counts and cache location"),
    "generate": ("specstop.data_gen.cli", "label every draft position of a prompt set into a dataset"),
    "train": ("specstop.train.cli", "train a stopping predictor (LightningCLI; --config configs/train/*.yaml)"),
    "sweep": ("specstop.pipeline.sweep", "train a grid of predictors and tabulate them (SpecDec++ Table 3)"),
    "calibrate-cost": ("specstop.measure.calibrate_cli", "measure draft/target step costs on this hardware"),
    "tune": ("specstop.measure.levels_tune", "tune stopping thresholds for latency on a validation split"),
    "eval": ("specstop.eval.eval_cli", "replay every policy on a test split and write the report"),
    "export": ("specstop.export.cli", "package a trained, tuned predictor for decoders"),
    "decode": ("specstop.decode.cli", "speculative decoding with a stopping policy"),
    "pipeline": ("specstop.pipeline.cli", "pair -> data -> train -> tune -> eval -> export, resumable"),
}

#: What Ctrl-C leaves and what to do next, per command. Only the commands that pick up where they
#: stopped (finished shards, pipeline stages, downloaded parts) say a rerun resumes.
INTERRUPTED: dict[str, str] = {
    "fetch-pair": "interrupted; downloaded parts and converted models are kept: rerun the same command to "
                  "continue from them",
    "info": "interrupted",
    "generate": "interrupted; finished shards are kept: rerun the same command to resume (it generates only "
                "the unfinished shards)",
    "train": "interrupted outside the training epochs (an interrupted epoch prints its own resume command): rerun "
             "the same command, with --ckpt_path CHECKPOINT_DIR/last.ckpt to continue from the last saved epoch",
    "sweep": "interrupted; the finished runs' rows are in --out's sweep.json, but sweep does not resume: a rerun "
             "trains every grid point again and rewrites sweep.json (copy it first to keep it)",
    "calibrate-cost": "interrupted; no cost model was written (it is written when the measuring ends): rerun "
                      "the same command to measure again",
    "tune": "interrupted; no tuned file was written: rerun the same command (tuning starts over)",
    "eval": "interrupted; no report was written (an earlier one in --out is unchanged): rerun the same command",
    "export": "interrupted; nothing was exported (an export moves into --out only when complete): rerun the "
              "same command",
    "decode": "interrupted",
    "pipeline": "interrupted; finished stages (and a data stage's finished shards) are kept: rerun the same "
                "command to resume from the interrupted stage",
}

__all__ = ["COMMANDS", "INTERRUPTED", "UserError", "main", "run_command"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstop",
        description="Train, tune and export learned stopping predictors for speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"specstop {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_mod, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _debug(verbose: bool) -> bool:
    return verbose or os.environ.get("SPECSTOP_DEBUG", "").strip() not in ("", "0")


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (multi-line messages are joined)."""
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or type(err).__name__


def user_message(err: BaseException, command: str) -> str | None:
    """The one-line message of an error the user can fix, else None (a bug: keep its traceback).

    Only a UserError (or an error a library raised because of one, e.g. jsonargparse wrapping our
    constructors) is the user's to fix; a missing extra names its install line, and a full disk or a
    read-only output met while writing is the machine's state, not a bug.

    Args:
        err: the raised exception.
        command: what was running, e.g. ``"specstop train"`` (named by a missing extra's message).
    """
    from specstop.extras import missing_extra_message

    user = find_user_error(err)
    if user is not None:
        return one_line(user)
    return missing_extra_message(err, command) or _write_failure(err)


def run_command(name: str, argv: list[str]) -> int:
    """Run one subcommand without any error handling (the pipeline runs stages through this).

    Args:
        name: a key of ``COMMANDS``.
        argv: the subcommand's arguments.

    Returns:
        The subcommand's exit status.
    """
    from specstop.memory import guarded_stage

    module_name, _help = COMMANDS[name]
    module = importlib.import_module(module_name)
    with guarded_stage(f"specstop {name}"):
        return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv or "--verbose" in argv
    setup_logging(verbose)
    # Find the subcommand: the first non-option argument.
    cmd_index = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cmd_index is None or argv[cmd_index] not in COMMANDS:
        parser = _build_parser()
        if cmd_index is not None:
            parser.error(f"unknown command {argv[cmd_index]!r}; choose from {', '.join(COMMANDS)}")
        parser.parse_args(argv)
        parser.print_help()
        return 0 if argv else 2
    name = argv[cmd_index]
    rest = [a for a in argv[cmd_index + 1 :] if a not in ("-v", "--verbose")]
    try:
        from specstop.pair.compat import check_supported_versions

        check_supported_versions()  # one line naming the releases needed, before any traceback from them
        return run_command(name, rest)
    except KeyboardInterrupt as err:
        # A command that knows what it kept says so in the interrupt (train: whether an epoch was saved).
        said = str(err.args[0]) if err.args else INTERRUPTED.get(name, "interrupted")
        print(f"specstop {name}: {said}", file=sys.stderr)
        return 130
    except Exception as err:
        message = user_message(err, f"specstop {name}")
        if message is None or _debug(verbose):
            raise
        print(f"specstop {name}: error: {cap(message)} (SPECSTOP_DEBUG=1 shows a traceback)", file=sys.stderr)
        return 2


MAX_MESSAGE = 2000  # an echoed value (a YAML alias bomb's expansion) must not flood the terminal


CAP_TAIL = 400  # a message ends with its fix: the end of a long one is kept


def cap(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to about ``limit`` characters in the middle (the cut is marked), so the problem at
    its start and the fix at its end both stay."""
    if len(text) <= limit:
        return text
    tail = min(CAP_TAIL, limit // 2)
    return f"{text[:limit - tail]} ... ({len(text) - limit} characters left out) ... {text[-tail:]}"


def _write_failure(err: BaseException) -> str | None:
    """The one-line message of a write that failed for lack of space or permission, else None."""
    from specstop.outputs import write_error_message

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            msg = write_error_message(err)
            if msg is not None:
                return msg
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
