"""Row gathers from memory-mapped Arrow columns, so data-parallel ranks share one copy of the data.

The hidden-state column dominates a dataset's size (``[N, H]`` float16, H in the thousands). Under
DDP every rank builds its own data module; copying the column into each process's RAM multiplies
memory by the number of ranks. :class:`MappedRows` instead keeps the Arrow buffers of the shard
files (which ``datasets`` memory-maps) and copies only the rows of each batch, so the ranks of a
node share the page cache.
"""

from __future__ import annotations

import numpy as np
import torch


class MappedRows:
    """A read-only ``[N, W]`` matrix stored as memory-mapped chunks (one per shard file).

    Args:
        chunks: ``[n_i, W]`` arrays (views of Arrow buffers; never written to).
    """

    def __init__(self, chunks: list[np.ndarray]) -> None:
        chunks = [c for c in chunks if len(c)]
        if not chunks:
            raise ValueError("MappedRows needs at least one non-empty chunk")
        widths = {c.shape[1] for c in chunks}
        if len(widths) != 1:
            raise ValueError(f"chunks have different widths {sorted(widths)}")
        self.chunks = chunks
        self.bounds = np.cumsum([0] + [len(c) for c in chunks])
        self.shape = (int(self.bounds[-1]), widths.pop())
        self.dtype = chunks[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def head(self, n: int) -> MappedRows:
        """The first ``n`` rows (still mapped)."""
        out, left = [], n
        for c in self.chunks:
            if left <= 0:
                break
            out.append(c[:left])
            left -= len(c)
        return MappedRows(out)

    def __getitem__(self, index) -> torch.Tensor:
        """``[len(index), W]`` rows (a fresh tensor) for an index tensor/array, a slice or None (all)."""
        if index is None:
            index = slice(None)
        if isinstance(index, slice):
            idx = np.arange(*index.indices(len(self)))
        elif isinstance(index, torch.Tensor):
            idx = index.cpu().numpy().astype(np.int64, copy=False)
        else:
            idx = np.asarray(index, dtype=np.int64)
        out = np.empty((len(idx), self.shape[1]), dtype=self.dtype)
        which = np.searchsorted(self.bounds, idx, side="right") - 1
        for c in np.unique(which):
            sel = which == c
            out[sel] = self.chunks[c][idx[sel] - self.bounds[c]]
        return torch.from_numpy(out)


class PreviousRows:
    """Row ``prev[i]`` of ``rows`` for each row i, zeros where ``prev[i] < 0`` (still memory-mapped).

    The draft state that produced q_i is the tokens table's hidden state of the row before i in
    the same response (the state after X_{i-1}); at position 0 there is none (zeros).

    Args:
        rows: the ``[N, W]`` hidden states. prev: ``[N]`` int64 source row per row, -1 for none.
    """

    def __init__(self, rows: MappedRows, prev: np.ndarray) -> None:
        self.rows = rows
        self.prev = np.asarray(prev, dtype=np.int64)
        self.shape = (len(self.prev), rows.shape[1])
        self.dtype = rows.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        """``[len(index), W]`` rows (fresh tensor) for an index tensor/array, a slice or None (all)."""
        if index is None or isinstance(index, slice):
            src = self.prev[index if index is not None else slice(None)]
        else:
            src = self.prev[index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)]
        out = torch.zeros((len(src), self.shape[1]), dtype=torch.from_numpy(np.zeros(0, self.dtype)).dtype)
        has = src >= 0
        if has.any():
            out[torch.from_numpy(has)] = self.rows[src[has]]
        return out


def previous_row_index(prompt_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``[N]`` the row holding (same prompt, position - 1) for each row, -1 at position 0.

    Raises:
        ValueError: a row's predecessor is missing (rows of a response are not consecutive).
    """
    positions = np.asarray(positions, dtype=np.int64)
    idx = np.arange(len(positions), dtype=np.int64)
    prev = np.where(positions > 0, idx - 1, -1)
    has = prev >= 0
    ok = (positions[prev[has]] == positions[has] - 1) & (np.asarray(prompt_ids)[prev[has]] == np.asarray(prompt_ids)[has])
    if not ok.all():
        raise ValueError("token rows of a response are not stored consecutively by position; regenerate the dataset")
    return prev
