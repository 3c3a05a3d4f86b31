"""Improved-MCSD decision models (Lu et al., section 3.3; DynaSD code).

* ``mcsd_hidden_mlp``: a 3-layer MLP on the draft hidden state labelled with min(1, p/q). The
  upstream code uses 768 -> 512 -> 256 -> 1 for a 768-wide draft; we scale the widths with the
  hidden size H as round(2H/3) -> round(H/3).
* ``mcsd_topk_mlp``: a 2-layer MLP on top-k probabilities + entropy labelled with the verification
  result (upstream 11 -> 44 -> 1, i.e. width 4 x input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specstop.models.base import StoppingPredictor
from specstop.models.features import DIST, HIDDEN, FeatureSpec
from specstop.models.registry import register_predictor


@dataclass
class MCSDHiddenConfig:
    """Attributes: hidden_size: the draft's hidden width H (linked from the dataset manifest)."""

    hidden_size: int = 768
    hidden_layer: int = -1


@register_predictor("mcsd_hidden_mlp")
class MCSDHiddenMLP(StoppingPredictor):
    config_cls = MCSDHiddenConfig
    default_label = "accept_prob"
    labels = ("accept_prob", "accept_expected")

    def __init__(self, config: MCSDHiddenConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        w1, w2 = max(1, round(2 * h / 3)), max(1, round(h / 3))
        self.net = nn.Sequential(nn.Linear(h, w1), nn.ReLU(), nn.Linear(w1, w2), nn.ReLU(), nn.Linear(w2, 1))

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(kind=HIDDEN, hidden_size=self.config.hidden_size, hidden_layer=self.config.hidden_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B]`` logits."""
        return self.net(x).squeeze(-1)


@dataclass
class MCSDTopkConfig:
    """Attributes: k: top probabilities (upstream 10); width_factor: hidden width = factor x input (upstream 4)."""

    k: int = 10
    width_factor: int = 4


@register_predictor("mcsd_topk_mlp")
class MCSDTopkMLP(StoppingPredictor):
    config_cls = MCSDTopkConfig
    default_label = "verified"
    labels = ("verified", "accept_prob", "accept_expected", "greedy_match")

    def __init__(self, config: MCSDTopkConfig) -> None:
        super().__init__(config)
        d = self.feature_spec.input_dim
        self.net = nn.Sequential(nn.Linear(d, config.width_factor * d), nn.ReLU(), nn.Linear(config.width_factor * d, 1))

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(kind=DIST, k=self.config.k, use_position=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k + 1]`` -> ``[B]`` logits."""
        return self.net(x).squeeze(-1)
