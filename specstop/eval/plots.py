"""Report figures (matplotlib, Agg backend, PNG). Each function writes one file and returns its path."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_plot(
    path: Path, static_points: list[dict], sweeps: dict, tuned_points: dict, others: dict | None = None
) -> Path:
    """Verification rate N_target/N vs discard rate N_disc/N (SpecDec++ Fig. 3).

    Args:
        static_points: [{"k", "verification_rate", "discard_rate"}] for static K = 1..K_max.
        sweeps: {name: {"verification_rate": [...], "discard_rate": [...]}} threshold sweeps.
        tuned_points / others: {name: metrics} single points (tuned policies; oracle, heuristics).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.plot(
        [p["discard_rate"] for p in static_points],
        [p["verification_rate"] for p in static_points],
        "k.-",
        label="static K",
    )
    for p in static_points:
        if p["k"] in (1, 2, 4, 8, 16):
            ax.annotate(f"K={p['k']}", (p["discard_rate"], p["verification_rate"]), fontsize=7)
    for name, sw in sweeps.items():
        ax.plot(sw["discard_rate"], sw["verification_rate"], "-", lw=1, alpha=0.8, label=f"{name} sweep")
    for name, m in {**tuned_points, **(others or {})}.items():
        ax.plot([m["discard_rate"]], [m["verification_rate"]], "o", ms=5, label=name)
    ax.set_xlabel("discard rate  N_discarded / N")
    ax.set_ylabel("verification rate  N_target / N")
    ax.set_title("Verification vs discard (lower-left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def oracle_histogram(path: Path, lengths: np.ndarray) -> Path:
    """Oracle speculation length per round (DISCO Fig. 5), with mean and std in the title."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    lengths = np.asarray(lengths)
    hi = int(lengths.max(initial=0))
    ax.hist(lengths, bins=np.arange(-0.5, min(hi, 60) + 1.5), color="tab:blue", alpha=0.8)
    ax.set_xlabel("oracle speculation length K (leading matches per round)")
    ax.set_ylabel("rounds")
    ax.set_title(
        f"Oracle SL: mean {lengths.mean():.2f}, std {lengths.std():.2f} (n={len(lengths)})"
        if len(lengths)
        else "Oracle SL: no rounds"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def calibration_bins(pred: np.ndarray, label: np.ndarray, bins: int = 10) -> dict:
    """Equal-width bins of predicted acceptance: mean predicted, mean empirical, count per bin."""
    pred, label = np.asarray(pred, float), np.asarray(label, float)
    ok = np.isfinite(pred)
    pred, label = pred[ok], label[ok]
    b = np.clip((pred * bins).astype(int), 0, bins - 1)
    cnt = np.bincount(b, minlength=bins)
    mp = np.bincount(b, weights=pred, minlength=bins) / np.maximum(cnt, 1)
    ml = np.bincount(b, weights=label, minlength=bins) / np.maximum(cnt, 1)
    ece = float((np.abs(mp - ml) * cnt).sum() / max(cnt.sum(), 1))
    return {"predicted": mp.tolist(), "empirical": ml.tolist(), "count": cnt.tolist(), "ece": ece}


def calibration_plot(path: Path, curves: dict, label_name: str) -> Path:
    """Reliability diagram: {name: calibration_bins(...)} on one axis."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    for name, c in curves.items():
        cnt = np.asarray(c["count"])
        keep = cnt > 0
        ax.plot(
            np.asarray(c["predicted"])[keep],
            np.asarray(c["empirical"])[keep],
            "o-",
            ms=3,
            label=f"{name} (ECE {c['ece']:.3f})",
        )
    ax.set_xlabel("predicted acceptance")
    ax.set_ylabel(f"empirical acceptance ({label_name})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

