"""DISCO's speculation-length classifier (Mamou et al., section 3).

C_i = FFN(Concat(Top_k(q_i), Ent(q_i), i)) with k = 10. The paper says "2-layer FFN" and gives no
width; we use 64 hidden units with ReLU (about 900 parameters: negligible next to a draft step),
configurable. The position is encoded as log1p(i) / log1p(1024) (see FeatureSpec).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specstop.models.base import StoppingPredictor
from specstop.models.features import DIST, FeatureSpec
from specstop.models.registry import register_predictor


@dataclass
class DiscoConfig:
    """Attributes:
    k: number of top draft probabilities (paper: 10).
    hidden_dim: FFN width (paper: unspecified; 64).
    use_position: include the encoded response position (paper: yes).
    position_scale: see FeatureSpec.position_scale.
    with_state: also read the draft state that produced q_i (FeatureSpec.with_state; not in the
        paper: a specstop extension, off by default).
    hidden_size: the draft's hidden width for ``with_state`` (linked from the dataset manifest).
    """

    k: int = 10
    hidden_dim: int = 64
    use_position: bool = True
    position_scale: float = 1024.0
    with_state: bool = False
    hidden_size: int = 0


@register_predictor("disco_ffn")
class DiscoFFN(StoppingPredictor):
    config_cls = DiscoConfig
    default_label = "accept_expected"
    labels = ("accept_expected", "greedy_match", "accept_prob", "verified")

    def __init__(self, config: DiscoConfig) -> None:
        super().__init__(config)
        spec = self.feature_spec
        self.net = nn.Sequential(nn.Linear(spec.input_dim, config.hidden_dim), nn.ReLU(), nn.Linear(config.hidden_dim, 1))

    @property
    def feature_spec(self) -> FeatureSpec:
        c = self.config
        return FeatureSpec(kind=DIST, k=c.k, use_position=c.use_position, position_scale=c.position_scale,
                           with_state=c.with_state, hidden_size=c.hidden_size if c.with_state else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k + 1 (+1) (+H)]`` -> ``[B]`` logits."""
        return self.net(x).squeeze(-1)
