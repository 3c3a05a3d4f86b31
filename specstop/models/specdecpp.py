"""SpecDec++'s acceptance prediction head (Huang et al., section 5.1).

A (D+1)-layer ResNet with SiLU over the draft's final hidden state e_i: D residual blocks
``x <- x + SiLU(W_d x + b_d)``, each with its own weights, then a linear layer to one logit. D = 0
is a linear head. (The reference code builds its blocks with list multiplication, which makes all
"layers" one shared block; we build D distinct modules.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specstop.errors import UserError
from specstop.models.base import StoppingPredictor
from specstop.models.features import HIDDEN, FeatureSpec
from specstop.models.registry import register_predictor


@dataclass
class SpecDecPPConfig:
    """Attributes: hidden_size: draft width H (from the manifest); depth: D in 0..4 (paper default 3)."""

    hidden_size: int = 896
    depth: int = 3
    hidden_layer: int = -1

    def __post_init__(self) -> None:
        if not 0 <= self.depth <= 4:
            raise UserError(f"SpecDec++ depth D must be in 0..4 (paper's sweep), got {self.depth}")


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


@register_predictor("specdecpp_resnet")
class SpecDecPPResNet(StoppingPredictor):
    config_cls = SpecDecPPConfig
    default_label = "accept_prob"
    labels = ("accept_prob", "accept_expected")

    def __init__(self, config: SpecDecPPConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.blocks = nn.ModuleList([ResidualBlock(h) for _ in range(config.depth)])
        self.head = nn.Linear(h, 1)

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(kind=HIDDEN, hidden_size=self.config.hidden_size, hidden_layer=self.config.hidden_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B]`` logits."""
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)
