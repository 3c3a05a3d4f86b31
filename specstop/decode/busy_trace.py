"""When each of PEARL's two workers was busy, so a run can show that draft and target really overlapped.

PEARL's speedup rests on the draft and the target computing at the same time (on CUDA: two streams).
Output equal to the target's proves nothing about that: a worker that ran each op to the end before the
next was issued gives the same tokens. So each worker of the threads backend records its busy intervals,
and :func:`busy_overlap` measures the seconds during which both were busy.

On CPU an interval is host time from an op's start to its end. On CUDA it is device time between two
events recorded on the worker's own stream around the op (both measured from one origin event), so the
figure is what the streams had in flight together, not when the host threads happened to run.
"""

from __future__ import annotations

from collections import deque

import torch

from specstop import clock

#: Intervals kept per worker (a long generation keeps its latest ones).
MAX_INTERVALS = 8192


class BusyTrace:
    """Busy intervals of one worker.

    Args:
        stream: the worker's CUDA stream, or None on CPU (host clock).
        origin: a CUDA timing event recorded once before either worker ran (CUDA only); every interval
            is measured from it, so two workers' intervals share one time axis.
    """

    def __init__(self, stream: torch.cuda.Stream | None = None, origin: torch.cuda.Event | None = None) -> None:
        if (stream is None) != (origin is None):
            raise ValueError("a CUDA busy trace needs both its stream and the shared origin event")
        self.stream, self.origin = stream, origin
        self._marks: deque = deque(maxlen=MAX_INTERVALS)
        self._open = None

    def begin(self) -> None:
        """Mark the start of an op (call on the worker's thread, inside its stream on CUDA)."""
        self._open = self._mark()

    def end(self) -> None:
        """Mark the end of the op begun last."""
        if self._open is not None:
            self._marks.append((self._open, self._mark()))
            self._open = None

    def clear(self) -> None:
        self._marks.clear()

    def intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` seconds of every finished op, oldest first (CUDA: waits for the stream)."""
        if self.stream is None:
            return list(self._marks)
        self.stream.synchronize()
        return [(self.origin.elapsed_time(a) / 1e3, self.origin.elapsed_time(b) / 1e3) for a, b in list(self._marks)]

    def _mark(self):
        if self.stream is None:
            return clock.now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same time covered by sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> dict[str, float]:
    """Seconds each of two workers was busy, and seconds both were.

    Args:
        first, second: ``(start, end)`` intervals of each worker, on one time axis.

    Returns:
        ``{"first_s", "second_s", "both_s"}``; ``both_s`` is 0 for workers that never ran at the same time.
    """
    a, b = _union(first), _union(second)
    both, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):  # sweep the two sorted lists once
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return {"first_s": sum(e - s for s, e in a), "second_s": sum(e - s for s, e in b), "both_s": both}
