"""Evaluate a trained predictor on a split: row metrics, run calibration and the baselines.

Used after ``specstop train`` (``metrics.json`` next to the best checkpoint) and by the sweep.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from specstop.models.base import StoppingPredictor
from specstop.train.data import PredictorDataModule, SplitData
from specstop.train.metrics import (
    cumprod_calibration,
    evaluate_logits,
    logistic_regression_baseline,
    static_sl_f1,
)

log = logging.getLogger(__name__)

STATIC_KS = tuple(range(1, 11))


@torch.no_grad()
def predict_logits(predictor: StoppingPredictor, data: SplitData, chunk: int = 65536) -> torch.Tensor:
    """``[N]`` logits of every row of ``data`` (CPU, in chunks)."""
    predictor = predictor.eval()
    device = next(predictor.parameters()).device
    spec = predictor.feature_spec
    out = [
        predictor(data.features(spec, slice(i, i + chunk)).to(device)).float().cpu()
        for i in range(0, len(data), chunk)
    ]
    return torch.cat(out) if out else torch.zeros(0)


def evaluate_predictor(
    predictor: StoppingPredictor,
    dm: PredictorDataModule,
    split: str = "validation",
    *,
    threshold: float | None = None,
    baselines: bool = True,
    max_baseline_rows: int = 100_000,
    run_length: int = 10,
) -> dict:
    """All metrics of ``predictor`` on ``split`` of ``dm`` (configured for this predictor).

    Returns:
        ``{"split", "table", "rows", "label", **row metrics (auroc, ap, f1, [f1_tau], ece, kl, ...),
        "on_tokens": {...} (greedy-label F1 and the cumulative-product calibration on the teacher
        -forced tokens rows, when the predictor can read them), "baselines": {"logistic_regression":
        {...}, "static_sl": [{k, f1, ...}], "static_sl_best": {...}}}``.
    """
    if dm.spec is None:
        dm.configure(predictor.feature_spec, dm.label or predictor.default_label)
    data = dm.splits.get(split) or dm.load_split(split)
    dm.splits[split] = data
    logits = predict_logits(predictor, data)
    report: dict = {"split": split, "table": data.table, "rows": len(data), "label": dm.label}
    report.update(evaluate_logits(logits, data.labels, threshold))

    tokens = _tokens_view(dm, split, data)
    if tokens is not None:
        tok_logits = logits if tokens is data else predict_logits(predictor, tokens)
        p_hat = torch.sigmoid(tok_logits).numpy()
        greedy = dm_tokens_column(dm, split, "greedy_match", len(tokens))
        on_tokens: dict = {
            "rows": len(tokens),
            "cumprod_calibration": cumprod_calibration(
                tokens.prompt_ids, tokens.positions, p_hat, tokens.labels.numpy(), max_len=run_length
            ),
        }
        if greedy is not None:
            g = greedy.astype(bool)
            pred = p_hat >= 0.5
            on_tokens["f1_greedy"] = _f1(pred, g)
            if threshold is not None:
                on_tokens["f1_greedy_tau"] = _f1(p_hat >= threshold, g)
        report["on_tokens"] = on_tokens
        if baselines and greedy is not None:
            static = [static_sl_f1(tokens.prompt_ids, tokens.positions, greedy, k) for k in STATIC_KS]
            report.setdefault("baselines", {})["static_sl"] = static
            report["baselines"]["static_sl_best"] = max(static, key=lambda r: r["f1"])

    if baselines and ("train" in dm.splits or _has_rows(dm, "train")):
        train = dm.splits.get("train") or dm.load_split("train")
        dm.splits["train"] = train
        rng = np.random.default_rng(0)
        ti = _subsample(len(train), max_baseline_rows, rng)
        vi = _subsample(len(data), max_baseline_rows, rng)
        spec = predictor.feature_spec
        try:
            report.setdefault("baselines", {})["logistic_regression"] = logistic_regression_baseline(
                train.features(spec, ti).numpy(),
                train.labels[ti].numpy(),
                data.features(spec, vi).numpy(),
                data.labels[vi].numpy(),
                threshold=threshold,
            )
        except ValueError as err:  # e.g. one class only in a tiny split
            log.warning("logistic-regression baseline skipped: %s", err)
    return report


def _has_rows(dm: PredictorDataModule, split: str) -> bool:
    return dm.split_rows(split).get("tokens", 0) > 0


def _subsample(n: int, cap: int, rng) -> torch.Tensor:
    idx = np.arange(n) if n <= cap else np.sort(rng.choice(n, cap, replace=False))
    return torch.from_numpy(idx)


def _f1(pred: np.ndarray, label: np.ndarray) -> float:
    tp = float((pred & label).sum())
    p, r = tp / max(pred.sum(), 1), tp / max(label.sum(), 1)
    return 2 * p * r / max(p + r, 1e-12)


def _tokens_view(dm: PredictorDataModule, split: str, data: SplitData) -> SplitData | None:
    """The split's teacher-forced ``tokens`` rows with the predictor's features, when readable."""
    if data.table == "tokens":
        return data
    try:
        return dm.load_split(split, table="tokens")
    except (ValueError, KeyError) as err:
        log.info("no tokens-table view of %s for run metrics: %s", split, err)
        return None


def dm_tokens_column(dm: PredictorDataModule, split: str, column: str, expected_rows: int) -> np.ndarray | None:
    """One column of the split's tokens table, in storage order (the order ``load_split`` keeps)."""
    from specstop.data_gen.storage import load_arrays

    try:
        arr = load_arrays(dm.data_dir, "tokens", split, columns=[column])[column]
    except KeyError:
        return None
    arr = arr[: expected_rows] if dm.max_rows else arr
    return arr if len(arr) == expected_rows else None
