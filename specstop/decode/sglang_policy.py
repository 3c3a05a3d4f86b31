"""specstop's tuned batch schedule as an SGLang adaptive speculative decoding policy: ``SpecstopAdaptivePolicy``.

SGLang's adaptive speculation switches the draft step count (``speculative_num_steps``) at run time
between pre-built runtime states. Its ``AdaptiveController`` takes the policy object that picks the
step count (the ``AdaptiveSpecPolicy`` protocol in
``python/sglang/srt/speculative/adaptive_runtime_state.py``, injectable since sgl-project/sglang#37274):

* ``candidate_steps`` - every step count it may ask for (the controller builds one state for each);
* ``set_cuda_graph_bs(bs_list)`` and ``cuda_graph_bs_for_step(step)`` - which captured CUDA-graph batch
  sizes each step's state needs (None: graphs are off);
* ``get_steps_for_batch(batch_size)`` - the step count for the batch about to be drafted;
* ``on_verify_complete(num_correct_drafts_per_req, batch_size[, num_steps])`` - feedback after each
  verify; a step count to switch to, or None;
* ``on_state_activated(steps)`` - newer revisions tell the policy which state is active.

This policy runs the tuned schedule: a batch of B requests drafts the K of the tier with the largest
batch size <= B (tier keys are lower bounds, as in ``--speculative-adaptive-config``). The tuned K depends
on the batch size only, not on acceptance, so verify feedback never switches the state.

Which drafters it serves is SGLang's choice, not the policy's: the controller exists only in workers
that implement adaptive states. At the revisions read, SGLang's own EAGLE/EAGLE3 workers build theirs
with SGLang's EMA policy, a plugin algorithm (``SpeculativeAlgorithm.register``) builds its own and can
inject this one, and the ``STANDALONE`` worker (a separate draft model, the pairs specstop tunes) has
no adaptive controller. See ``docs/engines.md``.

The tiers are read by :func:`specstop.export.engines.sglang.read_tiers`, the rule the export's validator
applies too. The module needs specstop's core install only (no extras).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specstop.errors import UserError
from specstop.export.engines.sglang import POLICY_CLASS, TIERS_FIX, read_tiers

__all__ = ["POLICY_CLASS", "SpecstopAdaptivePolicy"]


class SpecstopAdaptivePolicy:
    """SGLang ``AdaptiveSpecPolicy`` that runs specstop's tuned K per batch size.

    Args:
        tiers: ``{B: K}`` or the adaptive-config dict itself (``{"B": {"candidate_steps": [K]}}``, see
            :func:`read_tiers`).
        initial_steps: the worker's ``speculative_num_steps`` at startup (``--speculative-num-steps``);
            always a candidate, since the controller registers the worker's first state under it.

    Raises:
        UserError: tiers that :func:`read_tiers` refuses.
    """

    def __init__(self, tiers: dict, initial_steps: int):
        if tiers and all(isinstance(b, int) for b in tiers):  # {B: K}: checked by the one tiers rule
            tiers = {str(b): {"candidate_steps": [k]} for b, k in tiers.items()}
        parsed = read_tiers(tiers)
        self._bounds = list(parsed)
        self._steps = [int(parsed[b]) for b in self._bounds]
        self._initial = int(initial_steps)
        self._current = self._initial
        self._cuda_graph_bs: list[int] | None = None

    @classmethod
    def from_file(cls, path: str | Path, initial_steps: int) -> SpecstopAdaptivePolicy:
        """The policy from a tiers file (``sglang_adaptive.json`` beside ``sglang.json``).

        Raises:
            UserError: the file is missing, not JSON, or not valid tiers.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: no such tiers file; {TIERS_FIX}") from None
        except (OSError, ValueError) as err:
            raise UserError(f"{path}: not a readable JSON tiers file ({err}); {TIERS_FIX}") from None
        return cls(read_tiers(data, str(path)), initial_steps)

    @property
    def candidate_steps(self) -> list[int]:
        """Every step count the schedule runs, and the worker's initial one, ascending."""
        return sorted({*self._steps, self._initial})

    @property
    def current_steps(self) -> int:
        """The step count of the state active last (as far as this policy was told)."""
        return self._current

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        """The batch sizes SGLang captures CUDA graphs for (None or empty: graphs are off)."""
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int, *args: Any, **kwargs: Any) -> int:
        """The tuned K for a batch of ``batch_size`` requests: the tier with the largest key <= it.

        Extra arguments that some revisions pass (context length, request ids) do not change the tuned K.
        An empty batch keeps the current state.
        """
        if batch_size < 1:
            return self._current
        steps = self._steps[0]
        for bound, k in zip(self._bounds, self._steps):
            if bound > batch_size:
                break
            steps = k
        return steps

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int,
                           num_steps: int | None = None, *args: Any, **kwargs: Any) -> int | None:
        """Verify feedback; the schedule's K depends on the batch size only, so never a switch (None)."""
        return None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The captured graph batch sizes whose tier runs ``step`` (None when graphs are off): the state for
        ``step`` needs graphs only for the batch sizes that reach it."""
        if self._cuda_graph_bs is None:
            return None
        return [b for b in self._cuda_graph_bs if self.get_steps_for_batch(b) == step]

    def on_state_activated(self, steps: int) -> None:
        """The controller switched to the state for ``steps``."""
        self._current = int(steps)
