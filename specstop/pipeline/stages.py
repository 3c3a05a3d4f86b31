"""Resumable stages: run a step only when its inputs or configuration changed.

Each stage has a fingerprint: a hash of its own configuration and of the outputs of the stages it
reads - each stage's ``output_id``, new whenever the stage runs, so a stage that ran again (a cost
table re-measured after it failed its check, a dataset regenerated after its record was lost) makes
every stage reading it run again, even with an unchanged configuration. ``<run_dir>/stages/<name>.json``
records the fingerprint, output id and outputs of the last successful run; a rerun with the same
fingerprint whose outputs still exist is reused. A stage that was interrupted left no record (records
are written atomically at the end), so it runs again - and the stages themselves resume their own
partial work (data generation keeps finished shards).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstop.errors import ResourceLimitError, UserError
from specstop.jsonio import atomic_write_json, read_json_or_none
from specstop.memory import PeakRSS, guarded_stage

log = logging.getLogger(__name__)


def fingerprint(obj: Any) -> str:
    """Stable short hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class StageResult:
    name: str
    status: str  # "ran" | "reused" | "skipped" | "failed"
    seconds: float
    fingerprint: str
    outputs: dict = field(default_factory=dict)
    note: str = ""
    peak_rss: int | None = None  # bytes, sampled while the stage ran (None when reused)
    output_id: str = ""  # what readers of this stage fingerprint: new each time the stage runs


class StageRunner:
    """Runs named stages under ``run_dir`` with fingerprint-based reuse."""

    def __init__(self, run_dir: str | Path, force: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.state_dir = self.run_dir / "stages"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.force = force
        self.results: list[StageResult] = []

    def _record_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def previous(self, name: str) -> dict | None:
        return read_json_or_none(self._record_path(name))

    def run(
        self,
        name: str,
        config: Any,
        upstream: list[str],
        fn: Callable[[], dict],
        *,
        outputs_exist: Callable[[dict], bool] | None = None,
    ) -> StageResult:
        """Run stage ``name`` unless an identical earlier run can be reused.

        Args:
            config: the stage's own configuration (JSON-able).
            upstream: names of stages whose outputs this stage reads (their fingerprints count).
            fn: does the work and returns the outputs dict (paths, figures).
            outputs_exist: checks a reused record's outputs are still on disk.
        """
        ups = {}
        for u in upstream:
            rec = next((r for r in self.results if r.name == u), None)
            ups[u] = (rec.output_id or rec.fingerprint) if rec else None
        fp = fingerprint({"config": config, "upstream": ups})
        prev = self.previous(name)
        if (
            not self.force
            and prev
            and prev.get("fingerprint") == fp
            and prev.get("status") == "done"
            and (outputs_exist is None or outputs_exist(prev.get("outputs", {})))
        ):
            # Records from before output ids stand for their fingerprint (an old run stays reusable).
            res = StageResult(name, "reused", 0.0, fp, prev.get("outputs", {}), "inputs and config unchanged",
                              output_id=prev.get("output_id") or fp)
            log.info("stage %-10s reused (inputs and config unchanged)", name)
            self.results.append(res)
            return res
        log.info("stage %-10s running%s", name, " (config or inputs changed)" if prev else "")
        t0 = time.perf_counter()
        mem = PeakRSS()
        try:
            # Each stage runs under the memory guard and frees its models when it ends, so the next
            # stage starts from a small footprint (stages run in this process).
            with guarded_stage(f"pipeline stage {name!r}"), mem:
                outputs = fn() or {}
        except BaseException as err:
            self.results.append(StageResult(name, "failed", time.perf_counter() - t0, fp, peak_rss=mem.peak or None))
            # Name the stage in a user error (the memory guard's message names it already).
            if isinstance(err, UserError) and not isinstance(err, ResourceLimitError) and err.args and not str(
                err.args[0]
            ).startswith("pipeline stage"):
                err.args = (f"pipeline stage {name!r}: {err.args[0]}", *err.args[1:])
            raise
        dt = time.perf_counter() - t0
        finished = time.time()
        output_id = fingerprint({"fingerprint": fp, "finished": finished, "outputs": outputs})
        atomic_write_json(
            self._record_path(name),
            {"name": name, "fingerprint": fp, "output_id": output_id, "status": "done", "seconds": dt,
             "outputs": outputs, "peak_rss": mem.peak or None, "finished": finished},
        )
        res = StageResult(name, "ran", dt, fp, outputs, peak_rss=mem.peak or None, output_id=output_id)
        self.results.append(res)
        return res

    def summary_table(self) -> str:
        lines = ["| stage | status | seconds | peak memory (GB) | note |", "|---|---|---:|---:|---|"]
        for r in self.results:
            peak = "-" if not r.peak_rss else f"{r.peak_rss / 1e9:.1f}"
            lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {peak} | {r.note} |")
        return "\n".join(lines)
