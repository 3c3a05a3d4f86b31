"""Reading a generated dataset back as flat torch tensors (for fast training) or a Dataset."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from specstop.data_gen.storage import load_arrays, load_table

__all__ = ["load_split_tensors", "load_table"]


def load_split_tensors(
    out_dir: str | Path, split: str, columns: Iterable[str], table: str = "tokens"
) -> dict[str, torch.Tensor]:
    """Columns of one split's ``table`` as tensors, straight from Arrow.

    Args:
        out_dir: dataset folder.
        split: e.g. ``"train"``.
        columns: column names (see ``schema.features_for``). String columns are not supported.
        table: ``tokens`` (default), ``mixed``, ``rollouts`` or ``sequences``.

    Returns:
        ``{column: tensor}``: scalars ``[R]``; fixed-size lists (``topk``, ``hidden``) ``[R, width]``;
        variable-length lists (rollout ``tokens``/``topk``/``entropy``/``hidden``, ``response_ids``)
        as the flat values ``[sum]`` plus ``{column}_offsets`` ``[R + 1]`` (int64). float16 stays
        float16, bools are ``torch.bool``.
    """
    arrays = load_arrays(out_dir, table, split, columns=list(columns))
    out: dict[str, torch.Tensor] = {}
    for name, arr in arrays.items():
        if isinstance(arr, tuple):
            flat, offsets = arr
            out[name] = _to_tensor(flat)
            out[f"{name}_offsets"] = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        else:
            if arr.dtype == object:
                raise TypeError(f"column {name!r} holds strings; read it with load_table(...) instead")
            out[name] = _to_tensor(arr)
    return out


def _to_tensor(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == np.bool_:
        return torch.from_numpy(a.copy())
    return torch.from_numpy(a.copy()) if not a.flags.writeable else torch.from_numpy(a)
