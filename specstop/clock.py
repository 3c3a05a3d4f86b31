"""The one clock every step cost is read from: calibration, the decoders' round timers, live pricing.

``now()`` is :func:`time.perf_counter` unless a test installs another clock with :func:`using` - a fake
clock that a model's forward advances by a cost of its choosing, so the calibration, its check and the
decoders' live re-pricing can be driven through cost levels that a real machine only shows by chance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_now: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on the current clock (monotonic; only differences mean anything)."""
    return _now()


@contextmanager
def using(clock: Callable[[], float]) -> Iterator[None]:
    """Read every step cost from ``clock`` (a callable returning seconds) inside the block."""
    global _now
    before, _now = _now, clock
    try:
        yield
    finally:
        _now = before
