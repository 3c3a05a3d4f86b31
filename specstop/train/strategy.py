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
