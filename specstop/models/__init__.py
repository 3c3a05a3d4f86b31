"""Stopping predictors: plain ``nn.Module`` families behind one registry (no Lightning here)."""

from specstop.models.base import StoppingPredictor
from specstop.models.features import DIST, HIDDEN, FeatureSpec
from specstop.models.registry import build_predictor, get_predictor_class, predictor_names, register_predictor

__all__ = [
    "DIST",
    "HIDDEN",
    "FeatureSpec",
    "StoppingPredictor",
    "build_predictor",
    "get_predictor_class",
    "predictor_names",
    "register_predictor",
]
