"""Can more context or another rule shape lift a learned stop above the tuned confidence threshold?

Companion to ``stopping_headroom.py`` (which shows that trained heads rank draft positions like
the draft's top-1 probability). Two probes, both on a greedy dataset:

1. **Feature information.** A gradient-boosted classifier (stronger than any shipped head) is fit
   on the train split to predict the greedy-match label from nested feature sets, and its AUROC
   is read on the held-out splits:

   - ``top1``: the draft's largest probability (what the confidence policy thresholds);
   - ``disco``: top-10 probabilities + entropy + log position (DISCO's input);
   - ``+context``: the draft's top-1 and entropy one and two tokens back, whether the previous
     token matched, and the current run of matches. A decoder has all of them for free at the
     decision: earlier draft distributions were computed when those tokens were drafted (a
     correction token shares its prefix with the rejected draft), tokens before the round are
     verified, and tokens earlier in the round matter only if they were accepted, so teacher-forced
     values equal decode-time values on every decision that counts. This covers the round index j
     and "the previous round's outcome" that issue 14 suggests;
   - ``+target``: ``+context`` plus TV(p, q) one token back: more than a decoder knows inside a
     round (an upper bound on what the target's own uncertainty adds).

2. **Rule shapes.** Tuned on validation by grid search, evaluated on test (and a transfer set), with
   the calibrated cost model, for the top-1 probability and each ``--checkpoint``'s score ``s``:
   ``below`` (stop when s_j < tau), ``cumprod`` (stop when prod s < c), ``below+slope`` (a
   threshold that depends on the round index: s_j < tau + slope (j - 1)) and ``below+cumprod``
   (either). Each also tunes SL_max over ``--sl-max``.

If no feature set lifts the AUROC materially above top-1, and no rule shape lifts the learned score
above top-1 under the same shape, the gain over the tuned confidence threshold is capped by what
the draft knows, not by the predictor.

Usage::

    python benchmarks/stopping_ceiling.py --data runs/disco_mbpp_humaneval/data \\
        --transfer runs/disco_mbpp_humaneval/test_data --cost runs/disco_mbpp_humaneval/cost.json \\
        --checkpoint disco_hard=PATH --out runs/exp14/ceiling

Writes ``ceiling.json`` and ``ceiling.png`` under ``--out``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from stopping_headroom import auroc

from specstop.data_gen.readback import load_split_tensors
from specstop.eval.cost import load_cost_model
from specstop.eval.episodes import load_replay_data
from specstop.eval.replay import replay
from specstop.eval.scoring import parse_checkpoint_args, score_checkpoints
from specstop.eval.tune import check_sl_max, max_sl_supported
from specstop.policy import PolicySpec, RoundPolicy
from specstop.script_args import ScriptParser, existing_dir, positive_int, result_dir, write_result
from specstop.script_main import run_main

RUN_CAP = 16  # longer match runs carry no extra signal and would dominate the scale
TOP1 = "top1"


def feature_sets(data_dir: str, split: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Nested feature matrices ``{name: [T, F]}`` and the ``[T]`` greedy-match labels of a split."""
    t = load_split_tensors(data_dir, split, ["position", "topk", "entropy", "greedy_match", "tv"])
    pos = t["position"].numpy()
    topk = t["topk"].float().numpy()
    ent = t["entropy"].float().numpy()
    match = t["greedy_match"].numpy().astype(np.float64)
    tv = t["tv"].float().numpy()

    def back(a: np.ndarray, lag: int, fill: float) -> np.ndarray:
        """``a`` shifted ``lag`` rows back within each response; ``fill`` before its start."""
        out = np.full(len(a), fill, dtype=np.float64)
        out[lag:] = a[:-lag]
        out[pos < lag] = fill
        return out

    # Current run of matches ending at the previous token (0 at a response start or after a miss).
    run = np.zeros(len(pos))
    for i in range(1, len(pos)):
        run[i] = 0.0 if pos[i] == 0 else (run[i - 1] + 1.0 if match[i - 1] else 0.0)
    top1 = topk[:, :1].astype(np.float64)
    disco = np.c_[topk[:, :10], ent, np.log1p(pos) / np.log1p(1024)]
    context = np.c_[
        disco, back(topk[:, 0], 1, 1.0), back(topk[:, 0], 2, 1.0), back(ent, 1, 0.0), back(ent, 2, 0.0),
        back(match, 1, 1.0), np.minimum(run, RUN_CAP) / RUN_CAP,
    ]
    target = np.c_[context, back(tv, 1, 0.0)]
    return {"top1": top1, "disco": disco, "+context": context, "+target": target}, match


def feature_information(data_dir: str, heldout: dict[str, tuple[str, str]]) -> dict:
    """AUROC per feature set of a boosted classifier fit on ``train``; ``heldout``: name -> (dir, split)."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    x_train, y_train = feature_sets(data_dir, "train")
    evals = {name: feature_sets(d, s) for name, (d, s) in heldout.items()}
    out = {}
    for fs in x_train:
        t0 = time.perf_counter()
        clf = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0)
        clf.fit(x_train[fs], y_train)
        out[fs] = {name: auroc(clf.predict_proba(x[fs])[:, 1], y) for name, (x, y) in evals.items()}
        out[fs]["features"] = int(x_train[fs].shape[1])
        print(f"  {fs:10s} " + "  ".join(f"{n} AUROC {v:.4f}" for n, v in out[fs].items() if n != "features")
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


class ShapedRule(RoundPolicy):
    """Stop when ``s_j < tau + slope (j - 1)`` or ``prod_{i<=j} s_i < c``, or at the cap.

    ``s`` is the draft's top-1 probability (``use_top1``) or the predictor's score. Built through
    :meth:`factory` so a grid can replay many shapes with the stock replay.
    """

    def __init__(self, spec: PolicySpec, tau: float, slope: float, c: float, use_top1: bool) -> None:
        super().__init__(spec)
        self.tau, self.slope, self.c, self.use_top1 = tau, slope, c, use_top1

    @classmethod
    def factory(cls, tau: float, slope: float, c: float, use_top1: bool):
        return lambda spec: cls(spec, tau, slope, c, use_top1)

    def should_stop(self, step) -> bool:
        if step.j >= self.cap():
            return True
        s = step.top1 if self.use_top1 else step.score
        if s is None:  # hidden-state predictors have no score for token 1 (as in RoundPolicy)
            return False
        self._cum *= s
        return s < self.tau + self.slope * (step.j - 1) or self._cum < self.c


SHAPES = {
    "below": [(t, 0.0, 0.0) for t in np.linspace(0.30, 0.95, 27)],
    "cumprod": [(0.0, 0.0, c) for c in np.linspace(0.20, 0.90, 29)],
    "below+slope": [(t, s, 0.0) for t in np.linspace(0.30, 0.90, 13) for s in (-0.04, -0.02, 0.01, 0.02, 0.04)],
    "below+cumprod": [(t, 0.0, c) for t in np.linspace(0.30, 0.90, 13) for c in np.linspace(0.30, 0.80, 11)],
}


def rule_shapes(datasets: dict, scores: list[str], cost, sl_max_grid: list[int]) -> dict:
    """Per score and shape: validation-tuned parameters and the speedup on every dataset."""

    def metrics(data, score: str, params, sl_max: int) -> dict:
        # kind decides the decision cost charged per draft step (confidence's or the predictor's).
        spec = (PolicySpec(kind="confidence", sl_max=sl_max) if score == TOP1
                else PolicySpec(kind="predictor", family=score, sl_max=sl_max))
        make = ShapedRule.factory(*params, use_top1=score == TOP1)
        return replay(data, spec, make_policy=make).metrics(cost.for_policy(spec))

    out = {}
    for score in scores:
        for shape, grid in SHAPES.items():
            best = min(
                ((metrics(datasets["validation"], score, p, sl)["latency_per_token"], p, sl)
                 for p in grid for sl in sl_max_grid),
                key=lambda r: r[0],
            )
            _, params, sl = best
            row = {"tau": params[0], "slope": params[1], "c": params[2], "sl_max": sl}
            row.update({f"{name}_speedup": metrics(d, score, params, sl)["speedup"] for name, d in datasets.items()})
            out[f"{score} {shape}"] = row
            print(f"  {score:12s} {shape:14s} " + "  ".join(
                f"{k[:-8]} {v:.3f}x" for k, v in row.items() if k.endswith("_speedup")), flush=True)
    return out


def static_opt(datasets: dict, cost, k_max: int = 12) -> dict:
    """Static SL-opt: the K <= ``k_max`` fastest on validation, and its speedup on every dataset."""
    ks = range(1, k_max + 1)

    def m(data, k):
        spec = PolicySpec(kind="static", k=k)
        return replay(data, spec).metrics(cost.for_policy(spec))

    k = min(ks, key=lambda k: m(datasets["validation"], k)["latency_per_token"])
    return {"k": k, **{f"{name}_speedup": m(d, k)["speedup"] for name, d in datasets.items()}}


def plot(info: dict, shapes: dict, static: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    sets = list(info)
    evals = [k for k in info[sets[0]] if k != "features"]
    w = 0.8 / len(evals)
    for i, name in enumerate(evals):
        a.bar(np.arange(len(sets)) + i * w, [info[s][name] for s in sets], w, label=name)
    a.set_xticks(np.arange(len(sets)) + w * (len(evals) - 1) / 2, sets)
    lo = min(info[s][n] for s in sets for n in evals)
    a.set_ylim(lo - 0.02, min(1.0, max(info[s][n] for s in sets for n in evals) + 0.01))
    a.set_ylabel("AUROC of greedy match (held out)")
    a.set_title("What a boosted classifier can read from the draft")
    a.legend()
    rows = list(shapes)
    names = [k[: -len("_speedup")] for k in shapes[rows[0]] if k.endswith("_speedup") and not k.startswith("validation")]
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        b.barh(np.arange(len(rows)) + i * w, [shapes[r][f"{name}_speedup"] for r in rows], w, label=name)
        b.axvline(static[f"{name}_speedup"], color=f"C{i}", ls="--", lw=1)
    b.set_yticks(np.arange(len(rows)) + w * (len(names) - 1) / 2, rows, fontsize=8)
    b.set_xlim(min(static[f"{n}_speedup"] for n in names) - 0.05,
               max(shapes[r][f"{n}_speedup"] for r in rows for n in names) + 0.03)
    b.set_xlabel(f"replay speedup (dashed: Static SL-opt K={static['k']})")
    b.set_title("Rule shapes, tuned on validation")
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=existing_dir, help="greedy dataset with train / validation / test splits")
    ap.add_argument("--transfer", type=existing_dir, help="a second dataset whose test split is a transfer set (e.g. HumanEval)")
    ap.add_argument("--cost", required=True, help="calibrated cost.json (specstop calibrate-cost)")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--sl-max", type=positive_int, nargs="+", default=[8, 12, 16])
    ap.add_argument("--out", required=True, type=result_dir(__file__, "ceiling.json"),
                    help="folder for ceiling.json and ceiling.png (created when they are written)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    heldout = {"test": (args.data, "test")}
    if args.transfer:
        heldout["transfer"] = (args.transfer, "test")
    print("feature information (fit on train):", flush=True)
    info = feature_information(args.data, heldout)
    checkpoints = parse_checkpoint_args(args.checkpoint)
    datasets = {"validation": load_replay_data(args.data, "validation"), **{
        name: load_replay_data(d, s) for name, (d, s) in heldout.items()}}
    srcs = {"validation": (args.data, "validation"), **heldout}
    for name, data in datasets.items():
        _, skipped = score_checkpoints(data, srcs[name][0], srcs[name][1], checkpoints)
        if skipped:
            raise SystemExit(f"could not score {name}: {skipped}")
    cost = load_cost_model(args.cost)
    # Rounds may not draft past the stored rollouts of any split (they end where labelling stopped).
    caps = [c for c in (max_sl_supported(d) for d in datasets.values()) if c is not None]
    cap = min(caps, default=max(args.sl_max))
    try:
        for sl in args.sl_max:
            for d in datasets.values():
                check_sl_max(d, sl)
    except ValueError as err:
        raise SystemExit(f"--sl-max: {err}") from None
    static = static_opt(datasets, cost, min(12, cap))
    print(f"Static SL-opt K={static['k']}: " + "  ".join(f"{k[:-8]} {v:.3f}x" for k, v in static.items() if k != "k"))
    print("rule shapes (tuned on validation):", flush=True)
    shapes = rule_shapes(datasets, [TOP1, *checkpoints], cost, args.sl_max)
    result = {"data": args.data, "transfer": args.transfer, "cost": args.cost, "checkpoints": checkpoints,
              "feature_information": info, "static_opt": static, "rule_shapes": shapes}
    write_result(out / "ceiling.json", result, __file__)
    plot(info, shapes, static, out / "ceiling.png")
    print(f"wrote {out / 'ceiling.json'} and {out / 'ceiling.png'}")
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
