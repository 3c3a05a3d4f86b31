"""Memory guard: a stage stops with a clear message before the machine runs out of memory.

The kernel's OOM killer ends a process without a word, in the middle of whatever it was doing.
Instead, every CLI command and every pipeline stage runs inside :func:`guarded_stage`, which

* watches the memory still available (host memory, or the cgroup limit of a container when that
  is lower) from a background thread every ``POLL_SECONDS``;
* when it falls below the reserve (``$SPECSTOP_MEMORY_RESERVE``, default ``max(1 GiB, 5% of
  RAM)``) raises :class:`~specstop.errors.ResourceLimitError` in the main thread (delivered as
  SIGUSR2 by ``_thread.interrupt_main``; ``$SPECSTOP_MEMORY_GUARD=0`` turns it off), naming the
  stage, the measured numbers and what to reduce. Our writes are atomic and jobs resumable, so
  rerunning the command continues from the finished work;
* frees what a stage left behind (``gc``, CUDA cache, glibc ``malloc_trim``) when it ends, so a
  pipeline's next stage starts from a small footprint.

:func:`check_fits` refuses up front to load something that cannot fit (model weights), and
:func:`check_memory` is the cooperative check long loops call between batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specstop.errors import ResourceLimitError, UserError

log = logging.getLogger(__name__)

RESERVE_ENV = "SPECSTOP_MEMORY_RESERVE"
# How the monitor thread interrupts the main thread: SIGUSR2 (SIGINT would read as Ctrl+C, which
# Lightning turns into sys.exit; SIGUSR1 is SLURM's requeue signal, which Lightning handles).
GUARD_SIGNAL = getattr(signal, "SIGUSR2", None)
POLL_SECONDS = 0.5
GIB = 1 << 30

#: What to reduce, per command (the innermost stage's advice is shown).
ADVICE = {
    "specstop generate": "lower generation.batch_size (--batch-size), labels.chunk_rows or labels.rollouts.batch_size "
    "(--rollout-batch-size), run the models in bfloat16 (--dtype bfloat16), or use a smaller pair",
    "specstop train": "lower data.batch_size or data.eval_batch_size, cap rows with data.max_rows, or train on a GPU",
    "specstop sweep": "lower data.batch_size or data.max_rows, or sweep fewer configurations per run",
    "specstop tune": "tune on a smaller split, or fewer --checkpoint predictors per run",
    "specstop eval": "evaluate a smaller split, or fewer --checkpoint predictors per run",
    "specstop calibrate-cost": "use --dtype bfloat16 or a smaller pair",
    "specstop decode": "use --dtype bfloat16, fewer --max-new-tokens, or a smaller pair",
}
DEFAULT_ADVICE = "close other programs, use a machine with more memory, or run the models in bfloat16"


@dataclass(frozen=True)
class MemoryStatus:
    """A measurement in bytes: ``available`` to this process (host or cgroup), ``total`` of the
    host or cgroup limit, and this process's resident set ``rss``."""

    available: int
    total: int
    rss: int


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limit() -> tuple[int, int] | None:
    """``(limit, usage)`` of this process's memory cgroup (v2, else v1), or None when unlimited."""
    v2 = Path("/sys/fs/cgroup")
    limit, usage = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    stat = v2 / "memory.stat"
    if limit is None:
        v1 = v2 / "memory"
        limit, usage = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        stat = v1 / "memory.stat"
    if limit is None or usage is None or limit >= 1 << 60:
        return None
    # Page cache the kernel can drop counts as usage; subtract the inactive part like `free` does.
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file") and value.isdigit():
                usage -= int(value)
                break
    except OSError:
        pass
    return limit, max(usage, 0)


def memory_status() -> MemoryStatus:
    """Measure available memory (the tighter of host and cgroup) and this process's RSS."""
    import psutil

    vm = psutil.virtual_memory()
    available, total = int(vm.available), int(vm.total)
    cg = _cgroup_limit()
    if cg is not None and cg[0] < total:
        total = cg[0]
        available = min(available, cg[0] - cg[1])
    return MemoryStatus(available=max(available, 0), total=total, rss=int(psutil.Process().memory_info().rss))


def parse_bytes(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"1.5GiB"`` or a plain byte count -> bytes."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = float(number)
    except ValueError:
        raise UserError(f"${RESERVE_ENV}={text!r} is not a size; use bytes or e.g. 2G, 512M") from None
    if value < 0:
        raise UserError(f"${RESERVE_ENV}={text!r} must be >= 0")
    return int(value * scale)


def reserve_bytes(total: int) -> int:
    """Memory that must stay available: ``$SPECSTOP_MEMORY_RESERVE`` or ``max(1 GiB, 5% of total)``."""
    env = os.environ.get(RESERVE_ENV)
    if env:
        return parse_bytes(env)
    return max(GIB, total // 20)


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GB" if abs(n) >= GIB / 10 else f"{n / (1 << 20):.0f} MB"


# ------------------------------------------------------------------------------ stage tracking
_stages: list[str] = []
_lock = threading.Lock()
_monitor: _Monitor | None = None


def current_stage() -> str:
    """The running stages, outermost first (``pipeline stage 'data' > specstop generate``)."""
    return " > ".join(_stages) or "specstop"


def _advice() -> str:
    for name in reversed(_stages):
        if name in ADVICE:
            return ADVICE[name]
    return DEFAULT_ADVICE


def low_memory_message(status: MemoryStatus, reserve: int) -> str:
    return (
        f"stopped in {current_stage()} before the machine runs out of memory: {fmt_bytes(status.available)} available, "
        f"below the {fmt_bytes(reserve)} reserve (this process uses {fmt_bytes(status.rss)} RSS of "
        f"{fmt_bytes(status.total)}). Finished work is kept: rerun the same command to resume. "
        f"To need less memory: {_advice()} (${RESERVE_ENV} sets the reserve)."
    )


def raise_if_tripped() -> None:
    """Raise :class:`ResourceLimitError` if the guard thread has seen memory run low (cheap: no measurement).

    The guard also interrupts the main thread, but that exception can land inside a library's broad
    ``except Exception`` and be lost; loops that call this between batches stop regardless."""
    if _monitor is not None and _monitor.tripped:
        raise ResourceLimitError(_monitor.tripped)


def check_memory() -> None:
    """Raise :class:`ResourceLimitError` when available memory is below the reserve (call between batches)."""
    raise_if_tripped()
    status = memory_status()
    reserve = reserve_bytes(status.total)
    if status.available < reserve:
        raise ResourceLimitError(low_memory_message(status, reserve))


def check_fits(need: int, what: str, advice: str) -> int:
    """Refuse to allocate ``need`` bytes for ``what`` when that would leave less than the reserve.

    Args:
        need: estimated bytes (e.g. model weights at the load dtype).
        what: what would be loaded, for the message.
        advice: how to need less (e.g. ``use --dtype bfloat16``).

    Returns:
        The bytes still available above the reserve once ``need`` is allocated.
    """
    status = memory_status()
    reserve = reserve_bytes(status.total)
    if need > status.available - reserve:
        raise ResourceLimitError(
            f"{what} needs about {fmt_bytes(need)} but only {fmt_bytes(status.available)} is "
            f"available ({fmt_bytes(reserve)} kept in reserve, this process already uses {fmt_bytes(status.rss)} RSS); "
            f"{advice}, or free memory (${RESERVE_ENV} sets the reserve)."
        )
    return int(status.available - reserve - need)


def release_memory() -> None:
    """Return memory a finished stage left behind: collect cycles, empty the CUDA cache, trim the heap."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed arenas mapped otherwise


class _Monitor(threading.Thread):
    """Polls memory; when it runs low, records the message and interrupts the main thread."""

    def __init__(self, interrupt: bool) -> None:
        super().__init__(name="specstop-memory-guard", daemon=True)
        self.interrupt = interrupt
        self.tripped: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(POLL_SECONDS):
            try:
                status = memory_status()
                reserve = reserve_bytes(status.total)
            except Exception:  # a broken measurement must never kill the job it guards
                return
            if status.available < reserve:
                self.tripped = low_memory_message(status, reserve)
                log.debug("memory guard: %s", self.tripped)
                if self.interrupt:
                    import _thread

                    _thread.interrupt_main(GUARD_SIGNAL)
                return

    def stop(self) -> None:
        self._stop_event.set()


def _on_signal(_signum, _frame) -> None:
    message = _monitor.tripped if _monitor is not None else None
    raise ResourceLimitError(message or f"stopped in {current_stage()}: memory ran low")


@contextlib.contextmanager
def guarded_stage(name: str) -> Iterator[None]:
    """Run a stage under the memory guard (nested stages share one monitor thread).

    Args:
        name: shown in messages, e.g. ``specstop generate`` or ``pipeline stage 'data'``.
    """
    global _monitor
    outermost = not _stages
    previous_handler = None
    in_main = threading.current_thread() is threading.main_thread()
    # Only when nobody else handles the signal (else: the cooperative checks between batches only).
    can_signal = (
        in_main and GUARD_SIGNAL is not None and signal.getsignal(GUARD_SIGNAL) in (signal.SIG_DFL, None)
    )
    with _lock:
        _stages.append(name)
        if outermost and os.environ.get("SPECSTOP_MEMORY_GUARD", "1") != "0":
            if can_signal:
                previous_handler = signal.signal(GUARD_SIGNAL, _on_signal)
            _monitor = _Monitor(interrupt=can_signal)
            _monitor.start()
    try:
        yield
    except ResourceLimitError:
        raise
    except BaseException as err:
        # The guard's interrupt can land inside a library that turns it into another error (a
        # jsonargparse "does not validate" while parsing, a swallowed exception in a loader); once
        # memory ran low, that is the reason the stage failed: say so instead.
        if outermost and _monitor is not None and _monitor.tripped:
            raise ResourceLimitError(_monitor.tripped) from err
        raise
    finally:
        with _lock:
            _stages.pop()
            if outermost and _monitor is not None:
                _monitor.stop()
                _monitor = None
                if previous_handler is not None:
                    signal.signal(GUARD_SIGNAL, previous_handler)
        release_memory()


class PeakRSS:
    """Context manager sampling this process's resident memory (every 0.25 s) to report a stage's
    peak: ``with PeakRSS() as m: ...; m.peak`` (bytes; includes the RSS at entry and exit)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # no psutil / no /proc: report nothing rather than fail the stage
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRSS:
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, name="specstop-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._rss())
