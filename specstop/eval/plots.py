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


def oracle_sl_by_index(lengths, prompts, bins: int = 20) -> dict:
    """Mean oracle speculation length per bucket of the normalized round index (DISCO Figs. 4, 6).

    Each prompt's rounds ``0 .. n-1`` get the normalized index ``j / (n - 1)`` (0 for a prompt of one
    round), so every prompt spans [0, 1] whatever its length; the index range is cut into ``bins``
    equal buckets (the last one closed) and each bucket averages the oracle lengths that fall in it.

    Args:
        lengths: [rounds] the oracle's speculation length of each round, in decoding order per prompt.
        prompts: [rounds] the prompt each round belongs to.
        bins: number of equal-width buckets of the normalized index.

    Returns:
        ``{"bins", "mean": [bins] (None for an empty bucket), "rounds": [bins] counts}``.
    """
    lengths, prompts = np.asarray(lengths, float), np.asarray(prompts)
    index = np.zeros(len(lengths))
    for p in np.unique(prompts):
        at = np.flatnonzero(prompts == p)
        if len(at) > 1:
            index[at] = np.arange(len(at)) / (len(at) - 1)
    # floor(index * bins) puts 1.0 in a bucket of its own: it belongs to the last one.
    bucket = np.minimum((index * bins).astype(int), bins - 1)
    count = np.bincount(bucket, minlength=bins)
    total = np.bincount(bucket, weights=lengths, minlength=bins)
    mean = [float(t / c) if c else None for t, c in zip(total, count)]
    return {"bins": int(bins), "mean": mean, "rounds": count.tolist()}


def oracle_index_plot(path: Path, curve: dict) -> Path:
    """Bar chart of :func:`oracle_sl_by_index`: mean oracle SL over the normalized round index."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    bins = curve["bins"]
    keep = [i for i, m in enumerate(curve["mean"]) if m is not None]
    ax.bar([(i + 0.5) / bins for i in keep], [curve["mean"][i] for i in keep], width=0.9 / bins,
           color="tab:blue", alpha=0.8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("normalized index of the speculation round (0 = first, 1 = last of its prompt)")
    ax.set_ylabel("mean oracle speculation length")
    ax.set_title(f"Oracle SL over the sequence ({sum(curve['rounds'])} rounds, {bins} buckets)")
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

