"""The context window of a loaded pair, and the one check that a request fits in it.

Positions past ``max_position_embeddings`` do not fail loudly: rotary models keep producing
tokens (or timings) from positions they were never trained on. So every command that feeds the
pair a long sequence (``decode``'s prompt, ``calibrate-cost --context-tokens``; ``generate``
truncates or skips prompts against the same limit) checks it first.
"""

from __future__ import annotations

from specstop.config_io import MAX_SEED, check_seed
from specstop.errors import UserError

__all__ = ["MAX_SEED", "check_fits", "check_request", "check_seed", "context_window", "vocabulary_size"]


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


def check_request(pair, prompt_ids, max_new_tokens, *, what: str = "prompt_ids") -> list[int]:
    """The one check of a decoding request, shared by every decoder: ``prompt_ids`` must be one
    non-empty sequence of integer token ids of this pair's vocabulary, ``max_new_tokens`` a
    positive integer, and both together must fit in the context window (:func:`check_fits`).

    Args:
        pair: the loaded ModelPair.
        prompt_ids: a list (or tuple) of ints, or a 1-D integer tensor / array.
        max_new_tokens: tokens to generate at most.
        what: how the caller names the prompt (``prompts[3]`` for a batch row).

    Returns:
        The prompt as a list of ints.

    Raises:
        UserError: naming the bad id or shape and the vocabulary or context size.
    """
    ids = _id_list(prompt_ids, what)
    if not ids:
        raise UserError(f"{what} is empty: give at least one token (e.g. the chat template's header)")
    vocab = vocabulary_size(pair)
    if vocab is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise UserError(
                    f"{what}[{i}] = {t} is not a token id of this pair: ids run from 0 to {vocab - 1} (a vocabulary "
                    f"of {vocab} tokens); tokenize the prompt with the pair's tokenizer"
                )
    n_new = _as_int(max_new_tokens)
    if n_new is None or n_new < 1:
        raise UserError(f"max_new_tokens must be an integer >= 1, got {_show(max_new_tokens)}")
    check_fits(pair, len(ids) + n_new, f"{what} ({len(ids)} tokens) plus max_new_tokens {n_new}",
               "shorten the prompt or lower max_new_tokens")
    return ids


def vocabulary_size(pair) -> int | None:
    """How many token ids the pair can read: its shared vocabulary, and never more than either
    model's embedding rows (None when neither is known)."""
    sizes = [int(pair.vocab_size)] if getattr(pair, "vocab_size", None) else []
    for name in ("draft", "target"):
        emb = getattr(getattr(pair, name, None), "get_input_embeddings", None)
        rows = getattr(emb(), "num_embeddings", None) if callable(emb) else None
        if rows:
            sizes.append(int(rows))
    return min(sizes) if sizes else None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer_dtype(dtype) -> bool:
    """Is a tensor's or an array's dtype an integer type (bool is not)?"""
    import numpy as np
    import torch

    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    try:
        return bool(np.issubdtype(dtype, np.integer))
    except TypeError:
        return False


def _as_int(value) -> int | None:
    """An integer (Python, numpy or a 0-d integer tensor) as int; None for anything else (bools,
    floats, strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    if getattr(value, "ndim", None) == 0 and _integer_dtype(getattr(value, "dtype", None)):
        return int(value.item())
    return None


def _id_list(prompt_ids, what: str) -> list[int]:
    """``prompt_ids`` as a list of ints, or one line naming what is wrong with its shape or type."""
    if isinstance(prompt_ids, (str, bytes)):
        raise UserError(f"{what} is text, not token ids; tokenize it first (e.g. pair.tokenizer(text)['input_ids'])")
    shape = getattr(prompt_ids, "shape", None)
    if shape is not None and getattr(prompt_ids, "dtype", None) is not None:  # a tensor or an array
        shape = list(shape)
        if len(shape) != 1:
            hint = ": pass ids[0] (one prompt per call; BatchedSpeculativeDecoder takes several)" if (
                len(shape) == 2 and shape[0] == 1) else ""
            raise UserError(f"{what} must be one sequence of token ids (shape [n]), got shape {shape}{hint}")
        if not _integer_dtype(prompt_ids.dtype):
            raise UserError(f"{what} must hold integer token ids, got dtype {prompt_ids.dtype}")
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        raise UserError(f"{what} must be a list of integer token ids, got {type(prompt_ids).__name__}")
    ids = []
    for i, t in enumerate(prompt_ids):
        value = _as_int(t)
        if value is None:
            if isinstance(t, (list, tuple)) or getattr(t, "ndim", 0):
                raise UserError(f"{what} must be one sequence of token ids, but {what}[{i}] is a sequence itself "
                                "(one prompt per call; BatchedSpeculativeDecoder takes several)")
            raise UserError(f"{what}[{i}] = {_show(t)} is not an integer token id")
        ids.append(value)
    return ids
