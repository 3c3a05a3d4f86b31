"""The tuned batch schedule (``tuned.json`` ``batch_schedule``): read and checked once for every engine,
and the per-row checks every engine's written schedule shares."""

from __future__ import annotations

from typing import Any

from specstop.errors import UserError
from specstop.export.engines.base import bad, is_int, is_num

BATCH_SCHEDULE_FORMAT = 1
_FIX_SCHEDULE = "rerun `specstop tune` to rewrite tuned.json's batch_schedule"


def read_batch_schedule(tuned: dict) -> dict | None:
    """The validated ``batch_schedule`` of a tuned file, or None when it has none.

    Returns:
        ``{"cost_model", "entries": [{"batch_size", "k", "predicted_speedup", "predicted_speedup_by_k",
        "threshold"}, ...]}`` with batch sizes ascending.

    Raises:
        UserError: an unknown format, or an entry with a missing or ill-typed field.
    """
    sched = tuned.get("batch_schedule")
    if sched is None:
        return None
    where = "tuned.json batch_schedule"
    if not isinstance(sched, dict) or sched.get("format") != BATCH_SCHEDULE_FORMAT:
        got = sched.get("format") if isinstance(sched, dict) else type(sched).__name__
        raise UserError(f"{where}: format {got!r} is not {BATCH_SCHEDULE_FORMAT}; {_FIX_SCHEDULE} with this specstop")
    entries = sched.get("entries")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: 'entries' must be a non-empty list; {_FIX_SCHEDULE}")
    out, prev = [], 0
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise UserError(f"{where}: entry {i} is not an object; {_FIX_SCHEDULE}")
        b, k = e.get("batch_size"), e.get("k")
        if not is_int(b) or b < 1:
            raise UserError(f"{where}: entry {i} batch_size {b!r} is not a positive integer; {_FIX_SCHEDULE}")
        if b <= prev:
            raise UserError(f"{where}: batch sizes must ascend, got {b} after {prev}; {_FIX_SCHEDULE}")
        if not is_int(k) or k < 0:
            raise UserError(f"{where}: batch size {b} has k {k!r}, not an integer >= 0; {_FIX_SCHEDULE}")
        speed = e.get("predicted_speedup")
        if speed is not None and (not is_num(speed) or speed <= 0):
            raise UserError(f"{where}: batch size {b} predicted_speedup {speed!r} is not a positive number; {_FIX_SCHEDULE}")
        by_k = e.get("predicted_speedup_by_k") or {}
        if not isinstance(by_k, dict):
            raise UserError(f"{where}: batch size {b} predicted_speedup_by_k must map K to a speedup; {_FIX_SCHEDULE}")
        thr = e.get("threshold")
        if thr is not None:
            if not isinstance(thr, dict) or not is_num(thr.get("threshold")) or not 0.0 <= thr["threshold"] <= 1.0 \
                    or not is_int(thr.get("sl_max")) or thr["sl_max"] < 1:
                raise UserError(f"{where}: batch size {b} threshold must be null or {{threshold in [0, 1], sl_max >= 1, "
                                f"predicted_speedup}}, got {thr!r}; {_FIX_SCHEDULE}")
        out.append({"batch_size": b, "k": k, "predicted_speedup": speed,
                    "predicted_speedup_by_k": {str(kk): v for kk, v in by_k.items()}, "threshold": thr})
        prev = b
    return {"cost_model": sched.get("cost_model"), "entries": out}


def check_schedule_rows(engine: str, rows: Any) -> None:
    """A written schedule's ``by_batch_size``: batch sizes ascending from >= 1, K integers >= 0, speedups positive.

    Raises:
        UserError: the first violation.
    """
    if not isinstance(rows, list) or not rows:
        raise bad(engine, "batch_schedule.by_batch_size must be a non-empty list")
    prev = 0
    for r in rows:
        b, k, speed = r.get("batch_size"), r.get("k"), r.get("predicted_speedup")
        if not is_int(b) or b <= prev:
            raise bad(engine, f"batch_schedule batch sizes must be integers ascending from >= 1, got {b!r} after {prev}")
        if not is_int(k) or k < 0:
            raise bad(engine, f"batch_schedule K at batch size {b} must be an integer >= 0, got {k!r}")
        if speed is not None and (not is_num(speed) or speed <= 0):
            raise bad(engine, f"batch_schedule predicted speedup at batch size {b} must be positive, got {speed!r}")
        prev = b
