"""Training rows of the tree node head (``tree_node_mlp``), built from the stored ``tokens`` columns.

A greedy round that drafts a token tree accepts a root-to-node path of the target's own tokens. For
response position i and depth d = 1..D, the round that started at position i - d + 1 reached
position i along the target's path X_{i-d+1} .. X_{i-1} (depths 1..d-1) and drafts the top-k
candidates of q_i below it, at depth d. Each candidate j (rank j among its siblings) is one node:

- label: ``target_rank_i == j`` (the candidate is X_i: the target accepts it);
- features (:class:`~specstop.models.tree_node.NodeFeatureSpec`): q_i's top-k and entropy, the
  rank j and the candidate's own probability ``topk_i[j]``, the depth d, and the joint draft
  probability of the parent path ``prod_{m=i-d+1}^{i-1} q_m(X_m)`` (times ``topk_i[j]``).

A path is kept only when every accepted token on it is one of its parent's first k candidates
(``0 <= target_rank_m < k``): a tree of top-k candidates never holds any other path, so the head
is never asked about it at decode time. Rows are stored compactly as (position, depth) paths with
the k candidates expanded per batch, so memory grows with positions x depths, not x k.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specstop.data_gen.storage import load_arrays
from specstop.errors import UserError
from specstop.models.tree_node import MIN_JOINT, NODE_LABEL, TREE_NODE, NodeFeatureSpec
from specstop.train.data import PredictorDataModule

log = logging.getLogger(__name__)

__all__ = ["NODE_COLUMNS", "NodePaths", "NodeSplit", "TreeNodeDataModule", "node_paths", "read_node_columns"]

# The tokens columns node rows are built from (target_rank: labels version 4).
NODE_COLUMNS = ("prompt_id", "split", "position", "topk", "entropy", "target_rank")
NODE_TABLE = "tree_nodes"  # SplitData.table of node rows (they are derived, not a stored table)


@dataclass
class NodePaths:
    """The (position, depth) paths of one split whose parent path a top-k tree can hold.

    Attributes:
        row: ``[P]`` int64 token row of position i (its q_i gives the node's candidates).
        depth: ``[P]`` int64 the nodes' depth d (1 = children of the round's root).
        log_parent_joint: ``[P]`` float64 log of the draft's joint probability of the path
            X_{i-d+1} .. X_{i-1} (0 for d = 1).
    """

    row: np.ndarray
    depth: np.ndarray
    log_parent_joint: np.ndarray

    def __len__(self) -> int:
        return len(self.row)


def node_paths(
    prompt_ids: np.ndarray, positions: np.ndarray, topk: np.ndarray, target_rank: np.ndarray, *, k: int, max_depth: int
) -> NodePaths:
    """Every (position i, depth d <= max_depth) path of a split (see the module docstring).

    Args:
        prompt_ids: ``[T]`` prompt id per token row (any order of rows).
        positions: ``[T]`` response position i per row.
        topk: ``[T, >=k]`` sorted top draft probabilities per row.
        target_rank: ``[T]`` rank of X_i among q_i's top candidates, -1 when not among them.
        k: candidates per node (ranks 0..k-1 can be on a path).
        max_depth: D, the deepest node.

    Returns:
        :class:`NodePaths`, ordered by depth, then by (prompt, position).
    """
    _, code = np.unique(np.asarray(prompt_ids, dtype=object).astype(str), return_inverse=True)
    pos = np.asarray(positions, dtype=np.int64)
    order = np.lexsort((pos, code))
    code, pos = code[order], pos[order]
    rank = np.asarray(target_rank, dtype=np.int64)[order]
    in_tree = (rank >= 0) & (rank < k)
    own = np.asarray(topk, dtype=np.float64)[order, np.where(in_tree, rank, 0)]
    log_own = np.where(in_tree, np.log(np.maximum(own, MIN_JOINT)), 0.0)
    # Prefix sums over the sorted rows: a path's ancestors are the d - 1 rows just before its own.
    log_sum = np.concatenate([[0.0], np.cumsum(log_own)])
    off_path = np.concatenate([[0], np.cumsum(~in_tree)])
    t = np.arange(len(pos))
    rows, depths, joints = [], [], []
    for d in range(1, max_depth + 1):
        first = t - (d - 1)  # the row of position i - d + 1, where the round's path starts
        ok = first >= 0
        f = np.where(ok, first, 0)
        ok &= (code[f] == code) & (pos[f] == pos - (d - 1))
        ok &= off_path[t] - off_path[f] == 0  # every accepted token on the path is a top-k candidate
        sel = t[ok]
        rows.append(order[sel])
        depths.append(np.full(len(sel), d, dtype=np.int64))
        joints.append(log_sum[sel] - log_sum[f[ok]])
    return NodePaths(np.concatenate(rows), np.concatenate(depths), np.concatenate(joints))


def read_node_columns(data_dir: str, split: str) -> dict[str, np.ndarray]:
    """The tokens columns node rows need.

    Raises:
        UserError: the dataset predates labels version 4 (no ``target_rank``): regenerate it.
    """
    try:
        return load_arrays(data_dir, "tokens", split, columns=list(NODE_COLUMNS))
    except KeyError as err:
        raise UserError(
            f"{data_dir} has no target_rank / topk_ids columns (labels version < 4), which the tree node head "
            "trains on: regenerate it with this specstop (`specstop generate` into a new folder)"
        ) from err


class NodeSplit:
    """One split's node rows (:class:`NodePaths` x k candidates), duck-typing ``train.data.SplitData``.

    Node n is candidate ``n % k`` of path ``n // k``; features are assembled per batch.

    Attributes:
        table: ``"tree_nodes"``. labels: ``[P * k]`` float32. prompt_ids / positions: ``[P * k]`` of
            the path's position i (for the disjoint-splits check and logs).
    """

    table = NODE_TABLE

    def __init__(self, paths: NodePaths, topk: np.ndarray, entropy: np.ndarray, target_rank: np.ndarray,
                 prompt_ids: np.ndarray, positions: np.ndarray, k: int) -> None:
        self.k = k
        self.paths = paths
        self.row = torch.from_numpy(paths.row)
        self.depth = torch.from_numpy(paths.depth)
        self.log_parent_joint = torch.from_numpy(paths.log_parent_joint).float()
        self.topk = torch.from_numpy(np.ascontiguousarray(topk[:, :k], dtype=np.float32))
        self.entropy = torch.from_numpy(np.asarray(entropy, dtype=np.float32).copy())
        rank = torch.from_numpy(np.asarray(target_rank, dtype=np.int64))[self.row]
        self.labels = (rank[:, None] == torch.arange(k)[None, :]).reshape(-1).float()
        self.prompt_ids = np.repeat(np.asarray(prompt_ids, dtype=object)[paths.row], k)
        self.positions = np.repeat(np.asarray(positions, dtype=np.int64)[paths.row], k)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def features(self, spec: NodeFeatureSpec, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """``[n, k + 5]`` float32 features of nodes ``index`` (all nodes when None)."""
        if isinstance(index, torch.Tensor):
            node = index.long()
        else:
            node = torch.arange(len(self))[slice(None) if index is None else index]
        path, rank = node // self.k, node % self.k
        row = self.row[path]
        return spec.build(rank, self.log_parent_joint[path], self.topk[row], self.entropy[row], self.depth[path])


class TreeNodeDataModule(PredictorDataModule):
    """Node rows of a specstop dataset for the tree node head (``tree_node_mlp``).

    Batching, shuffling (per epoch, resumable), data-parallel sharding and the disjoint-splits check
    are :class:`~specstop.train.data.PredictorDataModule`'s; only the rows differ.

    Args:
        data_dir: the folder ``specstop generate`` wrote (labels version >= 4).
        max_depth: D, the deepest tree node a row describes (the deepest tree the head will score).
        label: ``node_accepted`` (the only label) or None.
        batch_size / eval_batch_size / seed: as for ``PredictorDataModule`` (rows are nodes).
        max_rows: keep the node rows of at most this many token rows per split (quick experiments).
    """

    def __init__(
        self,
        data_dir: str,
        max_depth: int = 8,
        label: str | None = None,
        batch_size: int = 4096,
        eval_batch_size: int | None = None,
        seed: int = 0,
        max_rows: int | None = None,
    ) -> None:
        from specstop.config_io import check_range

        check_range("data.max_depth", max_depth, low=1)
        super().__init__(data_dir, "tokens", label, batch_size, eval_batch_size, seed, max_rows)
        self.max_depth = int(max_depth)

    def configure(self, spec, label: str) -> None:
        if getattr(spec, "kind", None) != TREE_NODE:
            raise UserError(
                f"TreeNodeDataModule trains the tree node head (family tree_node_mlp); this model reads "
                f"{getattr(spec, 'kind', spec)!r} features - use specstop.train.data.PredictorDataModule"
            )
        super().configure(spec, label)

    def table_for(self, split: str) -> str:
        return NODE_TABLE

    def load_split(self, split: str, table: str | None = None) -> NodeSplit:
        """Build one split's node rows from its tokens columns."""
        assert self.spec is not None
        if table not in (None, NODE_TABLE):
            raise ValueError(f"tree node rows are derived from the tokens table; there is no {table!r} view")
        if self.label != NODE_LABEL:
            raise UserError(f"the tree node head is trained on {NODE_LABEL!r}; got label {self.label!r}")
        if self.spec.k > self.k:
            raise UserError(f"the node head reads top-{self.spec.k} but the dataset stores top-{self.k}; set k <= {self.k}")
        arr = read_node_columns(self.data_dir, split)
        if self.max_rows:
            arr = {c: v[: self.max_rows] for c, v in arr.items()}
        if len(arr["prompt_id"]) == 0:
            raise UserError(f"split {split!r} of {self.data_dir} has no tokens rows")
        bad = arr["split"] != split
        if bad.any():
            raise UserError(
                f"{int(bad.sum())} rows in {split!r} shards say they belong to split {arr['split'][bad][0]!r}; "
                "the dataset is inconsistent - regenerate it"
            )
        paths = node_paths(arr["prompt_id"], arr["position"], arr["topk"], arr["target_rank"],
                           k=self.spec.k, max_depth=self.max_depth)
        data = NodeSplit(paths, arr["topk"], arr["entropy"], arr["target_rank"], arr["prompt_id"], arr["position"],
                         self.spec.k)
        if len(data) == 0:
            raise UserError(f"split {split!r} of {self.data_dir} yields no tree node rows (no path of top-{self.spec.k} tokens)")
        log.info("%s: %d tree node rows (%d paths, depth <= %d), label %s (mean %.3f)",
                 split, len(data), len(paths), self.max_depth, NODE_LABEL, float(data.labels.mean()))
        return data

    def summary(self) -> dict:
        out = super().summary()
        out["tree_nodes"] = {"max_depth": self.max_depth}
        return out
