"""What this machine is (CPU model, feature flags) and the cache of hardware checks measured on it.

The dtype choice and the single-row kernel route both measure once per machine and cache the
result here, keyed by what changes the answer (CPU model, flags, torch version, threads).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def cpu_model_name() -> str:
    """The CPU model string (``/proc/cpuinfo`` "model name", else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU feature flags (``/proc/cpuinfo``; empty where unavailable, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _check_cache_path() -> Path:
    from specstop.paths import cache_dir

    return cache_dir() / "hardware" / "dtype_check.json"


def cached_check(key: str) -> dict | None:
    """A hardware check's cached result (``~/.cache/specstop/hardware/dtype_check.json``), or None."""
    try:
        return json.loads(_check_cache_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def store_check(key: str, value: dict) -> None:
    """Cache a hardware check's result under ``key`` (atomic write; a read-only cache is ignored)."""
    path = _check_cache_path()
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        doc[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError):  # a read-only cache only costs a re-measurement next time
        pass
