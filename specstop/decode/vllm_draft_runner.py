"""The draft runners alive in this process: specstop's stop in vLLM's own draft-model runner.

:mod:`specstop.decode.vllm_worker` (which imports vLLM, and is loaded by vLLM's worker by name) registers each
runner it builds here; with vLLM's single-process engine the runners live in the caller's process, and
benchmarks and tests read their ``stops`` (rounds, draft lengths, settings, live re-pricing) through
:func:`live_runners`, without importing vLLM.
"""

from __future__ import annotations

import weakref

from specstop import clock

__all__ = ["live_runners", "register"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


def register(runner) -> None:
    """Record ``runner`` (a :class:`specstop.decode.vllm_worker.SpecstopDraftModelProposer`) as alive."""
    runner.created = clock.now()
    _LIVE.add(runner)


def live_runners() -> list:
    """The runners alive in this process, oldest first."""
    return sorted(_LIVE, key=lambda r: r.created)
