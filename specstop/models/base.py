"""The base class every stopping predictor derives from."""

from __future__ import annotations

from dataclasses import asdict
from typing import ClassVar

import torch
from torch import nn

from specstop.models.features import FeatureSpec


class StoppingPredictor(nn.Module):
    """A plain ``nn.Module`` mapping features of the current draft token to one logit.

    ``sigmoid(logit)`` is the predicted probability that the draft token is accepted.

    Class attributes:
        family: registry name (set by ``register_predictor``).
        config_cls: the family's dataclass config.
        default_label: the dataset column it is trained on by default.
        labels: the label columns that make sense for it.
    """

    family: ClassVar[str] = ""
    config_cls: ClassVar[type] = object
    default_label: ClassVar[str] = "accept_prob"
    labels: ClassVar[tuple[str, ...]] = ("accept_prob",)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @property
    def feature_spec(self) -> FeatureSpec:
        raise NotImplementedError

    def config_dict(self) -> dict:
        return asdict(self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, input_dim]`` features -> ``[B]`` logits."""
        raise NotImplementedError

    @torch.no_grad()
    def predict_proba(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, input_dim]`` -> ``[B]`` predicted acceptance probabilities."""
        return torch.sigmoid(self.forward(x))
