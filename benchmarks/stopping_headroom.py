"""Where a learned stopping policy can still gain on a dataset, and what holds it back.

Two questions decide whether a learned stop beats a tuned confidence threshold:

1. Does the predictor see more than the draft's top-1 probability? A stop rule acts on a ranking
   of draft positions; if a head ranks "the drafted token matches the target's argmax" no better
   than top-1 does (AUROC of the greedy-match label), tuning a threshold on it can only reproduce
   the confidence policy. Printed per score: AUROC overall and per response-position bucket.
2. Where does the oracle's time go? Latency per token splits exactly into draft time
   (``n_draft * t_draft / n``) and target time (the rest). Even the oracle, which never drafts a
   rejected token, pays one draft step per accepted token; when t_draft is a large share of a
   verification (CPU), that floor caps what any stopping rule can win. Printed per report row.

Usage::

    python benchmarks/stopping_headroom.py --data runs/disco_mbpp_humaneval/data --split test \\
        --checkpoint disco_hard=PATH --checkpoint mcsd_hidden=PATH \\
        --report runs/exp14/eval_mbpp_test/report.json --out runs/exp14/headroom_test

Writes ``headroom.json`` and ``roc.png`` under ``--out``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specstop.script_args import ScriptParser, existing_dir, existing_file, result_dir, write_result
from specstop.script_main import run_main

POSITION_BUCKETS = ((0, 16), (16, 64), (64, 10**9))


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` [N] for boolean ``labels`` [N] (ties count one half)."""
    keep = ~np.isnan(scores)
    s, y = scores[keep], labels[keep].astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    # Average ranks over ties (Mann-Whitney U).
    _, first, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def response_positions(offsets: np.ndarray) -> np.ndarray:
    """``[P+1]`` prompt row offsets -> ``[T]`` position of each row within its response."""
    lengths = np.diff(offsets)
    return np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)


def latency_split(report: dict) -> dict:
    """Per report row: latency/token split into draft and target time (seconds per emitted token)."""
    t_draft = float(report["cost_model"]["t_draft"])
    out = {}
    for key, row in report["rows"].items():
        if "n_draft" not in row or not row.get("n"):
            continue
        draft = row["n_draft"] * t_draft / row["n"]
        out[key] = {
            "label": row["label"],
            "latency_per_token": row["latency_per_token"],
            "draft_s_per_token": draft,
            "target_s_per_token": row["latency_per_token"] - draft,
            "draft_share": draft / row["latency_per_token"],
            "discard_rate": row.get("discard_rate"),
            "verification_rate": row.get("verification_rate"),
        }
    return out


def plot_roc(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for name, (scores, labels) in curves.items():
        keep = ~np.isnan(scores)
        s, y = scores[keep], labels[keep].astype(bool)
        order = np.argsort(-s, kind="mergesort")
        tpr = np.concatenate([[0.0], np.cumsum(y[order]) / max(1, y.sum())])
        fpr = np.concatenate([[0.0], np.cumsum(~y[order]) / max(1, (~y).sum())])
        ax.plot(fpr, tpr, label=f"{name} ({auroc(s, y):.3f})", linewidth=1)
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.5)
    ax.set_xlabel("false positive rate (mismatch scored as match)")
    ax.set_ylabel("true positive rate")
    ax.set_title("greedy match: ROC per score")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from specstop.eval.episodes import load_replay_data
    from specstop.eval.report import aligned_scores
    from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints
    from specstop.jsonio import read_json

    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=existing_dir, help="dataset folder (greedy)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--checkpoint", action="append", default=[], help="NAME=PATH, repeatable")
    ap.add_argument("--report", type=existing_file, help="report.json of `specstop eval` on the same split (latency split)")
    ap.add_argument("--out", required=True, type=result_dir(__file__, "headroom.json"),
                    help="folder for headroom.json and roc.png (created when they are written)")
    args = ap.parse_args(argv)

    data = load_replay_data(args.data, args.split)
    if data.temperature > 0:
        raise SystemExit("stopping_headroom: greedy datasets only (the greedy-match label is the target)")
    info, skipped = score_checkpoints(data, args.data, args.split, parse_checkpoint_args(args.checkpoint))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    labels = np.asarray(data.greedy_match, dtype=bool)
    scores = {"top-1 probability": np.asarray(data.top1, dtype=np.float64)}
    for name in info:
        s = aligned_scores(data, name)
        if s is not None:
            scores[name] = s
    pos = response_positions(np.asarray(data.offsets))
    table = {}
    print(f"{args.data}:{args.split}: {len(labels)} rows, match rate {labels.mean():.3f}")
    print(f"{'score':<24}{'AUROC':>8}" + "".join(f"{f'pos {a}-{b}' if b < 10**9 else f'pos {a}+':>12}" for a, b in POSITION_BUCKETS))
    for name, s in scores.items():
        by_pos = [auroc(s[(pos >= a) & (pos < b)], labels[(pos >= a) & (pos < b)]) for a, b in POSITION_BUCKETS]
        table[name] = {"auroc": auroc(s, labels), "auroc_by_position": by_pos,
                       "rows_scored": int((~np.isnan(s)).sum())}
        print(f"{name:<24}{table[name]['auroc']:>8.3f}" + "".join(f"{v:>12.3f}" for v in by_pos))
    # How often a confident draft is wrong: no threshold on top-1 can stop before these.
    top1 = scores["top-1 probability"]
    confident_wrong = float(((top1 > 0.9) & ~labels).sum() / max(1, (~labels).sum()))
    print(f"mismatches drafted with top-1 > 0.9: {confident_wrong:.1%}")

    result = {"data": args.data, "split": args.split, "rows": int(len(labels)), "match_rate": float(labels.mean()),
              "scores": table, "mismatches_with_top1_above_0.9": confident_wrong, "skipped": skipped}
    if args.report:
        report = read_json(args.report, "report.json of `specstop eval`")
        split = latency_split(report)
        result["latency_split"] = split
        print(f"\n{'policy':<58}{'latency':>9}{'draft':>8}{'target':>8}{'draft share':>12}")
        for row in split.values():
            print(f"{row['label'][:57]:<58}{row['latency_per_token']:>9.4f}{row['draft_s_per_token']:>8.4f}"
                  f"{row['target_s_per_token']:>8.4f}{row['draft_share']:>12.1%}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "headroom.json", result, __file__, indent=1)
    plot_roc({k: (v, labels) for k, v in scores.items()}, out / "roc.png")
    print(f"wrote {out / 'headroom.json'} and {out / 'roc.png'}")
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
