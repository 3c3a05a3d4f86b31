"""Which epoch's shuffle (and token mixing) a training epoch uses - the same after a resume.

A data module draws epoch e's permutation from ``seed + e``. The epoch number must therefore come
from state that survives a restart: the trainer's ``current_epoch`` (restored from the checkpoint
by Lightning) when a trainer is attached, else a counter of epochs started that the data module
saves in and restores from checkpoints (Lightning calls ``state_dict``/``load_state_dict`` on data
modules). A counter living only in the dataset object would restart at 0 on resume and replay
epoch 0's order, so a resumed run would train on other batches than an uninterrupted one.
"""

from __future__ import annotations


class ShuffleEpochs:
    """Mixin for ``LightningDataModule``s whose training batches depend on the epoch."""

    _epochs_started: int = 0

    def next_shuffle_epoch(self) -> int:
        """The epoch a new pass over the training data belongs to (call once per training pass)."""
        trainer = getattr(self, "trainer", None)
        epoch = int(trainer.current_epoch) if trainer is not None else int(self._epochs_started)
        self._epochs_started = epoch + 1
        return epoch

    def state_dict(self) -> dict:
        return {"shuffle_epochs_started": int(self._epochs_started)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._epochs_started = int((state_dict or {}).get("shuffle_epochs_started", 0))
