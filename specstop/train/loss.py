"""Weighted binary cross-entropy on acceptance logits (SpecDec++ section 4.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_bce_with_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    w_acc: float = 1.0,
    w_rej: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mean_i [ -w_acc * y_i * log sigmoid(z_i) - w_rej * (1 - y_i) * log sigmoid(-z_i) ]``.

    Written with ``logsigmoid`` so large |z| never produces ``log(0)`` (``log(1 - sigmoid(z)) ==
    logsigmoid(-z)``). Targets may be hard (0/1, bool) or soft (acceptance probabilities in [0, 1]).

    Normalisation: the plain mean over the tokens that receive a signal (the rows of the batch, or
    the ``True`` entries of ``mask``) - *not* divided by the weights, so raising ``w_rej`` raises
    the loss scale, as in SpecDec++'s sum form (their sum over tokens differs from ours only by
    the constant token count of a batch).

    Args:
        logits: ``[...]`` predicted acceptance logits z.
        target: ``[...]`` labels y (bool or float in [0, 1]).
        w_acc: weight of the accept term (SpecDec++: 1).
        w_rej: weight of the reject term (SpecDec++ sweeps {1, 3, 6, 12}).
        mask: optional ``[...]`` bool, the tokens that count (online token mixing: the drafted ones).

    Returns:
        Scalar loss (0 when no token counts).
    """
    y = target.to(logits.dtype)
    per_token = -w_acc * y * F.logsigmoid(logits) - w_rej * (1.0 - y) * F.logsigmoid(-logits)
    if mask is not None:
        per_token = per_token[mask]
    if per_token.numel() == 0:
        return logits.sum() * 0.0  # keeps the graph (DDP expects a gradient from every rank)
    return per_token.mean()
