"""Check the requested Lightning strategy before anything expensive starts."""

from __future__ import annotations

from specstop.errors import UserError

INSTALL_HINT = "pip install 'specstop[distributed]'"


def strategy_name(strategy) -> str:
    """A lower-case name for a strategy given as a string, a dict (class_path) or an instance."""
    if isinstance(strategy, str):
        return strategy.lower()
    if isinstance(strategy, dict):
        return str(strategy.get("class_path", "")).lower()
    cp = getattr(strategy, "class_path", None)  # jsonargparse Namespace
    if cp is not None:
        return str(cp).lower()
    return type(strategy).__name__.lower()


def check_strategy(strategy) -> None:
    """Fail at once, with the install command, when a DeepSpeed strategy lacks ``deepspeed``.

    Without this check Lightning only fails once the Trainer is built - after the dataset (and,
    in online mixing, the draft) has been loaded.
    """
    if "deepspeed" not in strategy_name(strategy):
        return
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise UserError(
            f"trainer.strategy={strategy_name(strategy)!r} needs DeepSpeed, which is not installed "
            f"({err}). Install the optional extra with: {INSTALL_HINT} "
            "(or choose strategy auto, ddp or fsdp)"
        ) from None


def set_deepspeed_batch_size(trainer, datamodule) -> None:
    """Tell a DeepSpeed strategy the training batch size before Lightning asks the dataloader for it.

    specstop's loaders yield whole batches (``DataLoader(batch_size=None)``), so Lightning's DeepSpeed
    strategy, which reads ``train_dataloader.batch_sampler.batch_size`` for DeepSpeed's required
    ``train_micro_batch_size_per_gpu``, finds no batch sampler and fails. The data module knows the size.
    """
    strategy = getattr(trainer, "strategy", None)
    config = getattr(strategy, "config", None)
    if "deepspeed" not in type(strategy).__name__.lower() or not isinstance(config, dict):
        return
    size = getattr(datamodule, "batch_size", None)
    if size and "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = int(size)
