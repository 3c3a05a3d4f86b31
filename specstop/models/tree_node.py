"""``tree_node_mlp``: the node head of dynamic token trees - P(a tree node is accepted | its path).

A dynamic tree (``tree:N``, :mod:`specstop.decode.drafting`) grows the candidate children with the
highest estimated path acceptance. By default that estimate is the joint draft probability along
the path (EAGLE-2). The node head replaces the per-node factor with a learned probability that the
target accepts the node given that it accepts the node's parent path, from features the draft has
at hand when it decides which nodes to draft (never the candidate's token id):

    [ s_j, j / k, log(joint) / LOG_SCALE, top-k probabilities of q_parent, entropy(q_parent), d / depth_scale ]

where q_parent is the draft distribution the candidates are taken from, s_j its j-th largest
probability (the node is the parent's rank-j candidate, j = 0..k-1), joint = the product of the
draft probabilities along the path including the node itself, and d the node's depth (1 = a child
of the root). :class:`NodeFeatureSpec` builds these rows in training (from dataset columns,
:mod:`specstop.train.tree_nodes`) and at decode time (from live draft distributions,
:mod:`specstop.decode.node_head`), so the two cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from specstop.models.base import StoppingPredictor
from specstop.models.registry import register_predictor
from specstop.probs import entropy as _entropy
from specstop.probs import top_k_probs

__all__ = ["NODE_LABEL", "TREE_NODE", "NodeFeatureSpec", "TreeNodeConfig", "TreeNodeMLP"]

TREE_NODE = "tree_node"  # the feature kind: reads a tree node's path, not a chain token
NODE_LABEL = "node_accepted"  # the label: candidate == the target's token, given the path was accepted
# Log joint probabilities run from 0 to a few tens of nats below; dividing keeps them near [-3, 0].
LOG_SCALE = 10.0
# Joint probabilities are clamped here before the log (a float32 product can underflow to 0).
MIN_JOINT = 1e-30


@dataclass(frozen=True)
class NodeFeatureSpec:
    """What a node head reads (saved into checkpoints as ``feature_spec``).

    Attributes:
        k: the parent's top-k probabilities read, and the candidates per node the head scores
            (ranks 0..k-1; a tree scored by the head drafts at most k children per node).
        depth_scale: depth d is encoded as ``d / depth_scale``.
    """

    k: int = 10
    depth_scale: float = 8.0
    kind: str = TREE_NODE

    # The chain-predictor interface (data modules, export and the runtime ask these).
    reads_hidden = False
    reads_state = False
    needs_hidden = False

    @property
    def input_dim(self) -> int:
        return self.k + 5

    def to_dict(self) -> dict:
        return asdict(self)

    def build(
        self,
        rank: torch.Tensor,
        log_parent_joint: torch.Tensor,
        parent_topk: torch.Tensor,
        parent_entropy: torch.Tensor,
        depth: torch.Tensor,
    ) -> torch.Tensor:
        """Assemble the ``[B, k + 5]`` float32 node features.

        Args:
            rank: ``[B]`` the node's rank j among its parent's candidates (0-based, < k).
            log_parent_joint: ``[B]`` log of the joint draft probability of the parent's path (0 at
                the root's children).
            parent_topk: ``[B, >=k]`` the parent's sorted top draft probabilities.
            parent_entropy: ``[B]`` entropy of the parent's draft distribution (nats).
            depth: ``[B]`` the node's depth (>= 1).
        """
        topk = parent_topk[..., : self.k].float()
        rank = rank.long()
        own = topk.gather(-1, rank.unsqueeze(-1)).squeeze(-1)
        log_joint = log_parent_joint.float() + torch.log(own.clamp_min(MIN_JOINT))
        return torch.cat(
            [
                own.unsqueeze(-1),
                (rank.float() / self.k).unsqueeze(-1),
                (log_joint.clamp_min(math.log(MIN_JOINT)) / LOG_SCALE).unsqueeze(-1),
                topk,
                parent_entropy.float().unsqueeze(-1),
                (depth.float() / self.depth_scale).unsqueeze(-1),
            ],
            dim=-1,
        )

    def build_children(self, probs: torch.Tensor, log_parent_joint: float, depth: int, n: int) -> torch.Tensor:
        """Decode-time helper: features of a parent's first ``n <= k`` candidates. ``[V] -> [n, k + 5]``."""
        topk = top_k_probs(probs, self.k)
        ent = _entropy(probs)
        return self.build(
            torch.arange(n),
            torch.full((n,), float(log_parent_joint)),
            topk.expand(n, -1).cpu(),
            ent.expand(n).cpu(),
            torch.full((n,), int(depth)),
        )


@dataclass
class TreeNodeConfig:
    """Attributes: k: parent top-k size (linked from the dataset); width: hidden width of the MLP;
    depth_scale: depth normalisation (about the deepest tree depth of interest)."""

    k: int = 10
    width: int = 64
    depth_scale: float = 8.0


@register_predictor("tree_node_mlp")
class TreeNodeMLP(StoppingPredictor):
    """A 2-hidden-layer MLP ``k + 5 -> width -> width -> 1`` on :class:`NodeFeatureSpec` rows."""

    config_cls = TreeNodeConfig
    default_label = NODE_LABEL
    labels = (NODE_LABEL,)

    def __init__(self, config: TreeNodeConfig) -> None:
        super().__init__(config)
        d, w = self.feature_spec.input_dim, config.width
        self.net = nn.Sequential(nn.Linear(d, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1))

    @property
    def feature_spec(self) -> NodeFeatureSpec:
        return NodeFeatureSpec(k=self.config.k, depth_scale=self.config.depth_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k + 5]`` -> ``[B]`` logits."""
        return self.net(x).squeeze(-1)
