"""The learned node head as a tree scorer: which candidates a dynamic tree (``tree:N``) drafts.

``specstop decode --policy tree:N --node-head CKPT`` grows the tree best-first by the head's
predicted path acceptance (the product of its per-node estimates along the path) instead of the
joint draft probability. The head is a ``tree_node_mlp`` checkpoint (:mod:`specstop.models.tree_node`,
trained by ``specstop train --config configs/train/tree_node_mlp.yaml``); it only picks the nodes,
so the tree decoder stays lossless (see :mod:`specstop.decode.drafting`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specstop.errors import UserError
from specstop.models.tree_node import TREE_NODE

__all__ = ["NodeHeadScorer", "load_node_head"]


class NodeHeadScorer:
    """A :data:`~specstop.decode.drafting.NodeScorer` backed by a trained node head.

    Args:
        predictor: a ``tree_node_mlp`` predictor (its ``feature_spec.kind`` is ``"tree_node"``).
        meta: the checkpoint's metadata (its ``dataset.pair`` is checked against the decoding pair).
        source: where it was loaded from (named in errors and labels).
    """

    def __init__(self, predictor, meta: dict | None = None, source: str = "node head") -> None:
        spec = predictor.feature_spec
        if getattr(spec, "kind", None) != TREE_NODE:
            raise UserError(
                f"{source} is a {predictor.family!r} predictor, not a tree node head; train one with "
                "configs/train/tree_node_mlp.yaml"
            )
        self.predictor = predictor.eval()
        self.spec = spec
        self.meta = dict(meta or {})
        self.source = source
        self.device = next(predictor.parameters()).device

    @property
    def max_candidates(self) -> int:
        """Children per node the head can score (ranks 0..k-1, what it was trained on)."""
        return self.spec.k

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, n: int, log_joint: float, depth: int) -> list[float]:
        """P(candidate i accepted | parent path accepted), i = 0..n-1.

        Args:
            q: ``[V]`` the parent's draft distribution. n: candidates (<= k).
            log_joint: log joint draft probability of the parent's path. depth: the children's depth.
        """
        x = self.spec.build_children(q, log_joint, depth, n).to(self.device)
        return torch.sigmoid(self.predictor(x).float()).tolist()

    def check_pair(self, pair) -> None:
        """Refuse, in one line, a head trained on data from another draft/target pair."""
        from specstop.pair.identity import check_same_pair

        dataset = self.meta.get("dataset")
        check_same_pair(
            dataset.get("pair") if isinstance(dataset, dict) else None, pair.to_dict(),
            what=f"--node-head {self.source} was trained on data from another model pair",
            fix="train a node head on data generated with this pair",
        )


def load_node_head(path: str | Path) -> NodeHeadScorer:
    """Load a ``tree_node_mlp`` training checkpoint as a scorer (CPU: a few hundred weights)."""
    from specstop.models.checkpoint import load_predictor

    predictor, meta = load_predictor(path)
    return NodeHeadScorer(predictor, meta, str(path))


def load_tree_export(path: str | Path):
    """The token-tree policy of an export folder: ``(policy text, node head scorer or None)``, or None
    when the export is a chain policy (no ``tree`` entry in its config).

    Raises:
        UserError: a malformed ``tree`` entry or node head (re-export).
    """
    from specstop.export.folder import CONFIG_NAME
    from specstop.export.reading import load_predictor_weights, read_export_config

    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        return None
    config = read_export_config(cfg_path)
    tree = config.get("tree")
    if tree is None:
        return None
    if not isinstance(tree, dict) or not isinstance(tree.get("policy"), str):
        raise UserError(f"{cfg_path}: 'tree' must hold the tree policy text (mcsd:... or tree:N); re-export it")
    head = None
    if tree.get("node_head") is not None:
        predictor = load_predictor_weights(path, cfg_path, tree["node_head"]).eval()
        head = NodeHeadScorer(predictor, {"dataset": {"pair": config.get("pair")}}, f"{path} node head")
    return tree["policy"], head
