"""Before a pair is loaded: will it fit in memory, and what a loading failure means.

:func:`check_pair_fits` adds up the weights both models will occupy at the chosen dtype (from the
safetensors headers, no weights read) and refuses - naming the sizes and the fix - when that would
leave less than the memory guard's reserve; loading would otherwise end in the OOM killer.
:func:`loading_errors` turns what Hugging Face raises for unusable model files into one-line
user errors that name the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from specstop.errors import UserError
from specstop.memory import check_fits, fmt_bytes
from specstop.pair.weights import estimated_load_bytes


def check_pair_fits(draft: str, target: str, dtype, *, offloaded: bool = False) -> bool:
    """Refuse to load a pair that cannot fit in the available memory.

    Args:
        draft, target: what will be loaded (local folders are measured; hub ids are skipped).
        dtype: the torch dtype both models load in.
        offloaded: the target is spread by a device map (its size is not all in this process's RAM).

    Returns:
        Whether a second copy of the weights fits as well: the packed linear weights of the ``packed``
        kernel route (:mod:`specstop.pair.fast_paths`) are such a copy.
    """
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else 4
    sizes = {}
    for role, src in (("draft", draft), ("target", target)):
        if role == "target" and offloaded:
            continue
        if Path(src).is_dir():
            n = estimated_load_bytes(src, itemsize)
            if n:
                sizes[role] = n
    if not sizes:
        return True
    need = int(sum(sizes.values()) * 1.1)  # + activations, KV cache and allocator slack
    parts = " + ".join(f"{role} {fmt_bytes(n)}" for role, n in sizes.items())
    smaller = "" if itemsize <= 2 else "use --dtype bfloat16 (half the memory), "
    room = check_fits(need, f"loading the pair in {str(dtype).replace('torch.', '')} ({parts})",
                      f"{smaller}use a smaller pair or a machine with more memory")
    return room >= sum(sizes.values())


def check_dtype_name(dtype) -> None:
    """Refuse an unknown ``dtype`` name before any model is loaded."""
    from specstop.pair.dtype_choice import resolve_dtype

    if dtype in (None, "auto"):
        return  # resolved once, by the loader, with the pair to time
    try:
        resolve_dtype(dtype, "cpu")
    except ValueError as err:
        raise UserError(f"dtype: {err}") from None


@contextlib.contextmanager
def loading_errors(what: str) -> Iterator[None]:
    """Re-raise Hugging Face's errors for unusable model files as one-line user errors naming ``what``."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        SafetensorError = OSError  # noqa: N806
    try:
        yield
    except UserError:
        raise
    except (OSError, SafetensorError, ValueError) as err:
        text = " ".join(str(err).split())
        raise UserError(f"could not load {what}: {text[:500]}") from err
