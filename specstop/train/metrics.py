"""Validation metrics of acceptance predictors, and the baselines they are compared with.

Conventions (stated once, used everywhere):
    * The positive class is "the draft token is accepted".
    * Soft labels (``accept_prob``, ``accept_expected``) are binarised as ``y >= 0.5`` for F1,
      AUROC and average precision, which need classes. Binary KL and ECE use the soft label as is.
    * ECE here compares, per bin of predicted probability (15 equal-width bins), the mean predicted
      acceptance with the mean *label* (soft or hard), weighted by the bin's share of tokens. For
      hard labels this is the usual ECE; for soft labels it measures calibration against the true
      acceptance probability rather than against a coin flip drawn from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, BinaryF1Score

BINARISE_AT = 0.5
ECE_BINS = 15


def binarise(target: torch.Tensor) -> torch.Tensor:
    """``[...]`` soft or hard labels -> ``[...]`` int64 classes (``y >= 0.5``)."""
    return (target.float() >= BINARISE_AT).long()


def binary_entropy(y: torch.Tensor) -> torch.Tensor:
    """``H(y) = -y log y - (1-y) log(1-y)`` in nats, with ``0 log 0 = 0``. ``[...] -> [...]``."""
    y = y.double()
    return -(torch.xlogy(y, y) + torch.xlogy(1 - y, 1 - y))


def binary_kl_from_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(y || sigmoid(z)) = BCE(y, z) - H(y)`` (SpecDec++ Table 3), in nats. ``[...] -> [...]``.

    Computed as BCE-with-logits minus the label entropy in float64, so it is exact for saturated
    logits and never negative beyond rounding.
    """
    z, y = logits.double(), target.double()
    bce = F.binary_cross_entropy_with_logits(z, y, reduction="none")
    return (bce - binary_entropy(y)).clamp_min(0.0)


class BinaryKL(Metric):
    """Mean binary KL between the true and the predicted acceptance probability."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        self.total += binary_kl_from_logits(logits, target).sum()
        self.count += logits.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp_min(1)).float()


class SoftECE(Metric):
    """Expected calibration error against soft or hard labels (see the module docstring)."""

    full_state_update = False

    def __init__(self, n_bins: int = ECE_BINS) -> None:
        super().__init__()
        self.n_bins = n_bins
        for name in ("count", "sum_pred", "sum_label"):
            self.add_state(name, torch.zeros(n_bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: torch.Tensor, target: torch.Tensor) -> None:
        p = probs.detach().double().flatten()
        b = (p * self.n_bins).long().clamp_(0, self.n_bins - 1)
        self.count += torch.bincount(b, minlength=self.n_bins).double()
        self.sum_pred += torch.bincount(b, weights=p, minlength=self.n_bins)
        self.sum_label += torch.bincount(b, weights=target.detach().double().flatten(), minlength=self.n_bins)

    def compute(self) -> torch.Tensor:
        n = self.count.sum().clamp_min(1)
        gap = (self.sum_pred - self.sum_label).abs()  # = count * |mean_pred - mean_label| per bin
        return (gap.sum() / n).float()


class AcceptanceMetrics(nn.Module):
    """All row-level metrics of an acceptance predictor, updated from logits and labels.

    ``compute()`` returns ``{"auroc", "ap", "f1", "f1_tau" (when a threshold is given), "ece",
    "kl", "mean_pred", "mean_label"}``; Lightning syncs the states across devices.

    Args:
        threshold: the tuned probability threshold for a second F1 (None: only F1 at 0.5).
    """

    def __init__(self, threshold: float | None = None) -> None:
        super().__init__()
        self.threshold = threshold
        self.auroc = BinaryAUROC()
        self.ap = BinaryAveragePrecision()
        self.f1 = BinaryF1Score(threshold=0.5)
        self.f1_tau = BinaryF1Score(threshold=threshold) if threshold is not None else None
        self.ece = SoftECE()
        self.kl = BinaryKL()
        self.pred_sum = _MeanOf()
        self.label_sum = _MeanOf()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """``[B]`` logits, ``[B]`` labels (bool or float in [0, 1])."""
        logits = logits.detach().float()
        target = target.detach().float()
        probs = torch.sigmoid(logits)
        cls = binarise(target)
        self.auroc.update(probs, cls)
        self.ap.update(probs, cls)
        self.f1.update(probs, cls)
        if self.f1_tau is not None:
            self.f1_tau.update(probs, cls)
        self.ece.update(probs, target)
        self.kl.update(logits, target)
        self.pred_sum.update(probs)
        self.label_sum.update(target)

    def compute(self) -> dict[str, float]:
        out = {
            "auroc": self.auroc.compute(),
            "ap": self.ap.compute(),
            "f1": self.f1.compute(),
            "ece": self.ece.compute(),
            "kl": self.kl.compute(),
            "mean_pred": self.pred_sum.compute(),
            "mean_label": self.label_sum.compute(),
        }
        if self.f1_tau is not None:
            out["f1_tau"] = self.f1_tau.compute()
        return {k: float(v) for k, v in out.items()}

    def reset(self) -> None:
        for m in self.children():
            if isinstance(m, Metric):
                m.reset()


class _MeanOf(Metric):
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.total += x.double().sum()
        self.count += x.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp_min(1)).float()


def evaluate_logits(logits, target, threshold: float | None = None) -> dict[str, float]:
    """Row metrics of whole arrays at once (numpy or torch): ``[N]`` logits, ``[N]`` labels."""
    m = AcceptanceMetrics(threshold)
    for metric in m.modules():
        # The arrays are the whole split already: no cross-rank sync (after DDP training only
        # rank 0 evaluates, and a sync would wait forever for ranks that have finished).
        if isinstance(metric, Metric):
            metric._to_sync = metric.sync_on_compute = False
    logits = torch.as_tensor(np.asarray(logits) if not torch.is_tensor(logits) else logits).float()
    target = torch.as_tensor(np.asarray(target) if not torch.is_tensor(target) else target).float()
    if logits.numel() == 0:
        return {}
    if binarise(target).unique().numel() < 2:
        # AUROC/AP are undefined with one class; report the rest rather than failing.
        m.update(logits, target)
        out = {"ece": float(m.ece.compute()), "kl": float(m.kl.compute()), "f1": float(m.f1.compute())}
        out.update(auroc=math.nan, ap=math.nan)
        return out
    m.update(logits, target)
    out = m.compute()
    out["n"] = int(logits.numel())
    return out


# ---------------------------------------------------------------------------------------------
# Run-level metrics: the product of predicted acceptances along draft runs, static-SL F1
# ---------------------------------------------------------------------------------------------


def _sorted_runs(prompt_ids: np.ndarray, positions: np.ndarray):
    """Order rows by (prompt, position); return the order and a same-run indicator per row pair."""
    codes = np.unique(np.asarray(prompt_ids), return_inverse=True)[1].reshape(-1)
    pos = np.asarray(positions).astype(np.int64)
    order = np.lexsort((pos, codes))
    return order, codes[order], pos[order]


def cumprod_calibration(
    prompt_ids: Sequence, positions: Sequence, p_hat: Sequence, p_true: Sequence, max_len: int = 10
) -> list[dict]:
    """Calibration of the product of predicted acceptances along draft runs.

    SpecDec++ stops when ``1 - prod_j p_hat_j > h``, so what matters is whether the product over a
    run of consecutive draft tokens matches the probability that the whole run survives. For every
    prompt and every window of ``L`` consecutive positions ``s .. s+L-1`` (L = 1..max_len), we
    compare ``prod p_hat`` with ``prod p_true`` (p_true: the acceptance label - a probability for
    soft labels, 0/1 for greedy_match/verified, where the product is the survival indicator).

    Args:
        prompt_ids: ``[N]`` prompt of each row. positions: ``[N]`` response positions.
        p_hat: ``[N]`` predicted acceptance probabilities. p_true: ``[N]`` labels in [0, 1].
        max_len: longest run length L.

    Returns:
        One dict per L: ``{"length", "mean_pred", "mean_true", "gap" (pred - true), "windows"}``.
        Windows must be consecutive positions of one prompt (gaps in positions break runs).
    """
    order, codes, pos = _sorted_runs(np.asarray(prompt_ids), np.asarray(positions))
    lp = np.log(np.clip(np.asarray(p_hat, dtype=np.float64)[order], 1e-300, 1.0))
    lt = np.log(np.clip(np.asarray(p_true, dtype=np.float64)[order], 1e-300, 1.0))
    n = len(order)
    cp = np.concatenate([[0.0], np.cumsum(lp)])
    ct = np.concatenate([[0.0], np.cumsum(lt)])
    out = []
    for L in range(1, max_len + 1):
        if n < L:
            break
        start = np.arange(n - L + 1)
        end = start + L - 1
        ok = (codes[start] == codes[end]) & (pos[end] - pos[start] == L - 1)
        s = start[ok]
        if len(s) == 0:
            break
        pred = np.exp(cp[s + L] - cp[s])
        true = np.exp(ct[s + L] - ct[s])
        true = np.where(true < 1e-200, 0.0, true)  # log(0) was clipped; a zero label kills the run
        out.append(
            {
                "length": L,
                "mean_pred": float(pred.mean()),
                "mean_true": float(true.mean()),
                "gap": float(pred.mean() - true.mean()),
                "windows": int(len(s)),
            }
        )
    return out


def static_sl_predictions(prompt_ids: Sequence, positions: Sequence, greedy_match: Sequence, k: int):
    """The static speculation length K seen as a per-token classifier (DISCO Table 4 baseline).

    Definition: we run greedy speculative-decoding rounds of length K over each response's greedy
    labels. A round starting at position s drafts s .. s+K-1; let n be its accepted count.
      * n < K: positions s .. s+n (n accepted tokens and the rejected one) are predicted "accept"
        (the static policy continued drafting through them); the next round starts at s+n+1.
      * n = K: positions s .. s+K-1 are predicted "accept" and position s+K - which the static
        policy declined to draft (the bonus token comes from the target) - is predicted "stop";
        the next round starts at s+K+1.
    So every position of a response is scored exactly once with its own ``greedy_match`` label,
    and tokens drafted after a rejection (off the target's trajectory, no label) are not scored.

    Returns:
        ``(pred, label)`` bool arrays over the scored positions, in (prompt, position) order.
    """
    if k < 1:
        raise ValueError(f"static speculation length must be >= 1, got {k}")
    order, codes, pos = _sorted_runs(np.asarray(prompt_ids), np.asarray(positions))
    g = np.asarray(greedy_match).astype(bool)[order]
    pred = np.zeros(len(g), dtype=bool)
    bounds = np.flatnonzero(np.diff(codes)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(g)]):
        s = lo
        while s < hi:
            window = g[s : min(s + k, hi)]
            miss = np.flatnonzero(~window)
            if len(miss):  # rejected at offset miss[0]
                pred[s : s + miss[0] + 1] = True
                s += miss[0] + 1
            else:
                pred[s : s + len(window)] = True
                s += len(window)
                if s < hi and len(window) == k:
                    pred[s] = False  # stopped before drafting s+K
                    s += 1
    return pred, g


def static_sl_f1(prompt_ids: Sequence, positions: Sequence, greedy_match: Sequence, k: int) -> dict:
    """F1 (positive = accept) of the static-K classifier defined in :func:`static_sl_predictions`."""
    pred, label = static_sl_predictions(prompt_ids, positions, greedy_match, k)
    tp = float((pred & label).sum())
    precision = tp / max(pred.sum(), 1)
    recall = tp / max(label.sum(), 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-12)
    return {"k": k, "f1": f1, "precision": precision, "recall": recall, "n": int(len(label))}


# ---------------------------------------------------------------------------------------------
# Logistic-regression baseline
# ---------------------------------------------------------------------------------------------


def logistic_regression_baseline(
    x_train, y_train, x_val, y_val, *, max_rows: int = 200_000, seed: int = 0, threshold: float | None = None
) -> dict:
    """scikit-learn logistic regression on the predictor's own input features.

    Soft labels are fitted exactly by duplicating every row as a positive with weight y and a
    negative with weight 1 - y (the weighted log-likelihood equals the soft-label BCE). Features
    are standardised; training uses at most ``max_rows`` random rows to bound the time.

    Returns:
        The :func:`evaluate_logits` metrics of its validation logits.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x_train, y_train = np.asarray(x_train, dtype=np.float32), np.asarray(y_train, dtype=np.float64)
    x_val, y_val = np.asarray(x_val, dtype=np.float32), np.asarray(y_val, dtype=np.float64)
    if len(x_train) > max_rows:
        idx = np.random.default_rng(seed).choice(len(x_train), max_rows, replace=False)
        x_train, y_train = x_train[idx], y_train[idx]
    scaler = StandardScaler().fit(x_train)
    xt = scaler.transform(x_train)
    xs = np.concatenate([xt, xt])
    ys = np.concatenate([np.ones(len(xt)), np.zeros(len(xt))])
    ws = np.concatenate([y_train, 1.0 - y_train])
    keep = ws > 0
    clf = LogisticRegression(max_iter=500)
    clf.fit(xs[keep], ys[keep], sample_weight=ws[keep])
    logits = clf.decision_function(scaler.transform(x_val))
    return evaluate_logits(logits, y_val, threshold=threshold)
