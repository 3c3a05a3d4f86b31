"""The context window of a loaded pair, and the one check that a request fits in it.

Positions past ``max_position_embeddings`` do not fail loudly: rotary models keep producing
tokens (or timings) from positions they were never trained on. So every command that feeds the
pair a long sequence (``decode``'s prompt, ``calibrate-cost --context-tokens``; ``generate``
truncates or skips prompts against the same limit) checks it first.
"""

from __future__ import annotations

from specstop.errors import UserError


def context_window(pair) -> int | None:
    """The smaller of the two models' ``max_position_embeddings`` (None when unknown)."""
    limits = []
    for m in (pair.draft, pair.target):
        cfg = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
        n = getattr(cfg, "max_position_embeddings", None)
        if n:
            limits.append(int(n))
    return min(limits) if limits else None


def check_fits(pair, needed: int, what: str, fix: str) -> None:
    """Refuse ``needed`` positions when the pair's context window is smaller.

    Args:
        pair: the loaded ModelPair.
        needed: positions the request uses (prompt plus new tokens, context plus a verify block).
        what: the request, e.g. ``the prompt (900 tokens) plus --max-new-tokens 256``.
        fix: what the user can change.

    Raises:
        UserError: naming both numbers and the fix.
    """
    window = context_window(pair)
    if window is not None and needed > window:
        raise UserError(
            f"{what} needs {needed} positions but the models' context window is {window} tokens "
            f"(max_position_embeddings); {fix}"
        )
