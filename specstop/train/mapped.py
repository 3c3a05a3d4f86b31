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
