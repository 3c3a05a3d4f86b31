"""Run ``specstop train`` from another command (pipeline, sweep) so multi-device training works.

Lightning starts data-parallel ranks by re-running the current command line once per extra
device. Inside ``specstop pipeline`` that command is the pipeline, so every rank would redo data
generation, tuning and export. When a training run asks for more than one device (or node),
:func:`run_train` therefore starts ``python -m specstop.cli train ...`` as a child process: the
ranks Lightning launches re-run that child command only. Single-device runs stay in-process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import yaml

from specstop.config_io import read_yaml
from specstop.distributed import device_count
from specstop.errors import UserError

log = logging.getLogger(__name__)


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value given to ``flag`` as ``--flag V`` or ``--flag=V``."""
    out = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def requested_processes(argv: list[str]) -> int:
    """Processes a ``specstop train`` command line starts: devices per node x nodes.

    Reads ``trainer.devices`` / ``trainer.accelerator`` / ``trainer.num_nodes`` from its
    ``--config`` files (in order) and then from ``--trainer.*`` flags (later wins), as
    LightningCLI does.
    """
    trainer: dict = {}
    for path in _flag_values(argv, "--config"):
        p = Path(path)
        if p.is_file():
            doc = read_yaml(p, "train config") or {}
            trainer.update((doc.get("trainer") or {}) if isinstance(doc, dict) else {})
    for key in ("devices", "accelerator", "num_nodes"):
        values = _flag_values(argv, f"--trainer.{key}")
        if values:
            trainer[key] = yaml.safe_load(values[-1])
    nodes = int(trainer.get("num_nodes") or 1)
    return device_count(trainer.get("devices", "auto"), trainer.get("accelerator")) * nodes


def run_train(argv: list[str]) -> None:
    """Run ``specstop train ARGV``; in a child process when it starts several ranks.

    In-process, errors propagate with their own type (a user error stays a one-line error of the
    calling command, a bug keeps its traceback), as the pipeline's other stages do.

    Raises:
        UserError: the child process stopped on a user error (exit code 2; it printed the message).
        RuntimeError: training failed otherwise (the child's output has already been printed).
    """
    if requested_processes(argv) <= 1:
        from specstop.cli import run_command

        log.info("$ specstop train %s", " ".join(argv))
        rc = run_command("train", argv)
    else:
        cmd = [sys.executable, "-m", "specstop.cli", "train", *argv]
        log.info("$ %s   (multi-device: its own process, so Lightning relaunches only it per rank)", " ".join(cmd))
        rc = subprocess.run(cmd, env=os.environ.copy()).returncode
    if rc == 2:  # specstop's exit status for a user error; the child printed it above
        raise UserError(f"`specstop train {' '.join(argv)}` stopped on the error printed above (exit code 2)")
    if rc:
        raise RuntimeError(f"`specstop train {' '.join(argv)}` failed with exit code {rc}")
