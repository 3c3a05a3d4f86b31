"""The ``specstop eval`` report: a DISCO-Table-1 style comparison on a test split, plus figures.

Rows (stable keys in report.json): target_only, dynheur, static_5, static_opt, heuristic_opt,
confidence_0.4, confidence_opt, one row per tuned predictor (DISCO, SpecDec++, MCSD ...), MCSD
predictors also at the paper's beta = 0.4, pearl, oracle. Columns: latency per token (cost model),
speedup over target only, discard rate N_discarded/N, verification rate N_target/N, mean accepted
tokens per round without the bonus token (``accepted_per_round``) and with it
(``tokens_per_round``), improvement over Static SL-opt, and the fraction of the
Static-opt -> Oracle latency gap closed.

Greedy data use exact replay; sampled data (T > 0) use R realisations of the acceptance draws
conditioned on the recorded target samples (:mod:`specstop.eval.sampled`, which states its one
approximation), replayed by the same machinery, with each row's spread over the realisations.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from specstop.eval import plots
from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData
from specstop.eval.pearl import pearl_replay
from specstop.eval.replay import Counts, ReplayTrace, replay
from specstop.eval.sampled import APPROXIMATION, per_copy_latency, spread
from specstop.eval.segments import build_layout, fast_replay, sweep
from specstop.eval.tune import max_sl_supported, pareto_points
from specstop.policy import DEFAULT_SL_MAX, PolicySpec

REPORT_SCHEMA_VERSION = 1
PAPER_FAMILIES = {
    "disco_ffn": "DISCO",
    "specdecpp_resnet": "SpecDec++",
    "mcsd_hidden_mlp": "MCSD hidden",
    "mcsd_topk_mlp": "MCSD top-k",
}
MCSD_BETA = 0.4
COLUMNS = (
    "latency_per_token",
    "speedup",
    "discard_rate",
    "verification_rate",
    "accepted_per_round",
    "tokens_per_round",
    "improvement_over_static_opt",
    "gap_closed",
)


def aligned_scores(data, key: str) -> np.ndarray | None:
    """``[T]`` scores of predictor ``key`` paired with the label of the drafted token at each row.

    Distribution predictors score row i's own q_i: aligned as stored. Hidden-state predictors score
    the state *after* a token: a matched row's stored score (state after X_i = after the drafted
    token) is aligned, a mismatched row needs the state after the draft's own token d_m, which the
    rollouts store (``mismatch_scores``); rows without one are NaN. Sampled data has neither, so
    hidden predictors get None (no aligned pairs).
    """
    row = np.asarray(data.row_scores[key], dtype=np.float64)
    if data.score_reads.get(key, "dist") != "hidden":
        return row
    if data.temperature > 0 and getattr(data, "virtual_repeats", None) is None:
        return None
    out = row.copy()
    mm = ~data.greedy_match
    rid = data.rollout_of_row[mm]
    mm_scores = np.full(len(rid), np.nan)
    has = rid >= 0
    mm_scores[has] = data.mismatch_scores[key][rid[has]]
    out[mm] = mm_scores
    return out


def build_report(
    data: ReplayData,
    tuned: dict,
    cost: CostModel,
    predictors: dict,
    skipped: dict,
    *,
    out_dir: str | Path,
) -> dict:
    """Replay every policy on ``data``, write the figures into ``out_dir``; return the report dict.

    Args:
        data: the evaluation split, scored with every available predictor (keys = checkpoint names).
        tuned: the tuned-policy file's content.
        predictors: {name: {"family", "rule", "reads", ...}} of the scored predictors.
        skipped: {name: reason} for predictors that could not be used.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sampled = data.temperature > 0
    if sampled and getattr(data, "virtual_repeats", None) is None:
        raise ValueError("sampled data is reported through specstop.eval.sampled.virtual_replay_data")
    # Sampled data arrive as R realisations of the acceptance draws in greedy form (eval.sampled):
    # the same exact machinery replays them; each row also gets its spread over the realisations.
    layout = build_layout(data)
    supported = max_sl_supported(data)
    cap20 = DEFAULT_SL_MAX if supported is None else min(DEFAULT_SL_MAX, supported)
    rows: dict[str, dict] = {}
    skipped_rows = dict(skipped)

    def run(name: str, label: str, spec: PolicySpec) -> None:
        try:
            if spec.kind != "static" and spec.sl_max > cap20 and supported is not None:
                raise ValueError(
                    f"SL_max {spec.sl_max} exceeds what the stored rollouts support ({supported})"
                )
            m = fast_replay(data, spec, layout).metrics(cost.for_policy(spec))
            if sampled:
                m["latency_spread"] = spread(per_copy_latency(data, spec, cost.for_policy(spec)))
        except (KeyError, ValueError) as err:
            skipped_rows[name] = f"{type(err).__name__}: {err}"
            return
        rows[name] = {"label": label, "spec": spec.to_dict(), **m}

    n = data.num_tokens
    rows["target_only"] = {
        "label": "target only",
        "spec": None,
        **Counts(n=n, rounds=n, prompts=data.num_prompts, target_only=n, k_hist=[n]).metrics(cost),
    }
    run("dynheur", "dynHeur (start 5)", PolicySpec(kind="heuristic", start=5, sl_max=cap20))
    run("static_5", "Static SL-5", PolicySpec(kind="static", k=5))
    pols = tuned.get("policies", {})

    def tuned_spec(name: str) -> PolicySpec | None:
        if name not in pols:
            skipped_rows[name] = f"not in the tuned-policy file ({tuned.get('_path', 'tuned.json')})"
            return None
        return PolicySpec.from_dict(pols[name]["spec"])

    if (sp := tuned_spec("static_opt")) is not None:
        run("static_opt", f"Static SL-opt (K={sp.k})", sp)
    if (sp := tuned_spec("heuristic_opt")) is not None:
        run("heuristic_opt", f"dynHeur tuned (start {sp.start})", sp)
    run("confidence_0.4", "confidence 0.4", PolicySpec(kind="confidence", threshold=0.4, sl_max=cap20))
    if (sp := tuned_spec("confidence_opt")) is not None:
        run("confidence_opt", f"confidence tuned ({sp.threshold:.3g}, max {sp.sl_max})", sp)
    if "confidence_cumprod" in pols:
        sp = PolicySpec.from_dict(pols["confidence_cumprod"]["spec"])
        run("confidence_cumprod", f"cumulative confidence tuned (h={sp.threshold:.3g}, max {sp.sl_max})", sp)
    seen_families = set()
    for name, pol in pols.items():
        spec = PolicySpec.from_dict(pol["spec"])
        if spec.kind != "predictor":
            continue
        seen_families.add(spec.family)
        paper = PAPER_FAMILIES.get(spec.family, spec.family)
        if name not in predictors:
            skipped_rows[name] = skipped.get(name, "its checkpoint was not scored on this split")
            continue
        sym = "h" if spec.rule == "cumprod" else "tau"
        run(name, f"{paper} [{name}] tuned ({sym}={spec.threshold:.3g}, max {spec.sl_max})", spec)
        if spec.family in ("mcsd_hidden_mlp", "mcsd_topk_mlp"):
            run(
                f"{name}_beta0.4",
                f"{paper} [{name}] beta=0.4 (max {cap20})",
                replace(spec, threshold=MCSD_BETA, sl_max=cap20),
            )
    for fam, paper in PAPER_FAMILIES.items():
        if fam not in seen_families:
            skipped_rows[paper] = (
                f"no tuned {fam} predictor in the tuned-policy file (train one and pass --checkpoint to specstop tune)"
            )
    rows["pearl"] = {
        "label": ("PEARL (timing model, measured core split)" if cost.pearl_split
                  else "PEARL (timing model: draft and target in parallel, idealised overlap)"),
        "spec": {"kind": "pearl"},
        **pearl_replay(data, cost),
    }
    run("oracle", "Oracle (knows the acceptance draws)" if sampled else "Oracle", PolicySpec(kind="oracle"))
    gap_withheld = _relative_columns(rows)

    figures = {}
    extras = {"gap_closed_withheld": gap_withheld} if gap_withheld else {}
    # Greedy and sampled data (realisations in greedy form) alike: static curve, Pareto, oracle SL.
    static_pts = [
        {"k": k, **fast_replay(data, PolicySpec(kind="static", k=k), layout).metrics(cost.for_policy("static"))}
        for k in range(1, cap20 + 1)
    ]
    sweeps, tuned_pts = {}, {}
    for name, r in rows.items():
        spec = r.get("spec")
        if (
            spec
            and spec.get("kind") in ("predictor", "confidence")
            and not name.endswith("_beta0.4")
            and name != "confidence_0.4"
        ):
            ps = PolicySpec.from_dict(spec)
            sweeps[name] = pareto_points(sweep(data, ps, layout))
            tuned_pts[name] = r
    others = {k: rows[k] for k in ("oracle", "dynheur", "pearl") if k in rows}
    figures["pareto"] = plots.pareto_plot(
        out_dir / "pareto.png", static_pts, sweeps, tuned_pts, others
    ).name
    oracle_trace = ReplayTrace()
    replay(data, PolicySpec(kind="oracle"), trace=oracle_trace)
    lens = np.asarray(oracle_trace.k, dtype=np.int64)
    extras["oracle_sl"] = {
        "mean": float(lens.mean()) if len(lens) else None,
        "std": float(lens.std()) if len(lens) else None,
        "rounds": int(len(lens)),
    }
    figures["oracle_hist"] = plots.oracle_histogram(out_dir / "oracle_sl_hist.png", lens).name
    if len(lens):
        extras["oracle_sl_by_index"] = plots.oracle_sl_by_index(lens, oracle_trace.prompt)
        figures["oracle_by_index"] = plots.oracle_index_plot(
            out_dir / "oracle_sl_by_index.png", extras["oracle_sl_by_index"]
        ).name
    extras["static_curve"] = [
        {k: p[k] for k in ("k", "latency_per_token", "verification_rate", "discard_rate")}
        for p in static_pts
    ]
    label = data.greedy_match.astype(float)  # sampled: the realised acceptance draws
    cal = {}
    for name in predictors:
        if name not in data.row_scores:
            continue
        score = aligned_scores(data, name)
        if score is None:
            extras.setdefault("calibration_skipped", {})[name] = (
                "hidden-state scores of sampled data: the tokens rows hold the state after X_i, not after the "
                "draft token the label describes")
            continue
        ok = np.isfinite(score)
        cal[name] = plots.calibration_bins(score[ok], label[ok])
    if cal:
        figures["calibration"] = plots.calibration_plot(
            out_dir / "calibration.png", cal, "accepted (sampled draws)" if sampled else "greedy match"
        ).name
        extras["calibration"] = cal
    if sampled:
        extras["theorem1"] = getattr(data, "theorem1", None)
        extras["sampled_replay"] = {"repeats": data.virtual_repeats, "approximation": APPROXIMATION,
                                    "rows_without_rejection_rollout": data.missing_rejection_rollouts}

    tuned_on = tuned.get("dataset")
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "dataset": data.source,
        "tuned_on": {"dataset": tuned_on, "split": tuned.get("split")},
        "transfer": bool(tuned_on)
        and str(Path(str(tuned_on)).resolve()) != str(Path(data.source.rsplit(":", 1)[0]).resolve()),
        "mode": (f"sampled replay, {data.virtual_repeats} realisations of the acceptance draws" if sampled
                 else "exact greedy replay"),
        "tokens": data.num_tokens // (getattr(data, "virtual_repeats", None) or 1),
        "prompts": getattr(data, "virtual_prompts", data.num_prompts),
        "cost_model": cost.to_dict(),
        "columns": list(COLUMNS),
        "notes": {
            "accepted_per_round": "accepted draft tokens per round, WITHOUT the target's bonus/correction token",
            "tokens_per_round": "emitted tokens per round (N / N_target), WITH the bonus/correction token",
            "gap_closed": "(latency(static_opt) - latency) / (latency(static_opt) - latency(oracle))",
        },
        "rows": rows,
        "skipped": skipped_rows,
        "figures": figures,
        **extras,
    }


def _relative_columns(rows: dict) -> str | None:
    """Fill ``improvement_over_static_opt`` and ``gap_closed``; returns why the gap is not shown, if not.

    "Gap closed" measures a policy against the distance from Static SL-opt to the Oracle, so it means
    something only where the Oracle is the fastest row. Under a cost table whose t_target(K) falls
    as K grows (an erratic calibration) drafting to the first rejection is no longer optimal, and a
    ratio against it would praise policies that are slower than Static SL-opt.
    """
    so = rows.get("static_opt", {}).get("latency_per_token")
    orc = rows.get("oracle", {}).get("latency_per_token")
    # PEARL is another decoding scheme (draft and target in parallel): the chain's Oracle does not bound it.
    faster = [r for k, r in rows.items()
              if k not in ("oracle", "pearl") and orc is not None and r["latency_per_token"] < orc]
    withheld = None
    if faster:
        best = min(faster, key=lambda r: r["latency_per_token"])
        withheld = (f"not shown: the Oracle ({orc:.5f} s/token) is slower than {best['label']} "
                    f"({best['latency_per_token']:.5f} s/token) under this cost model. The Oracle drafts exactly to the "
                    "first rejection, which is fastest only where t_target(K) grows with K: check the cost table "
                    "(`specstop calibrate-cost` prints its check)")
    elif so is not None and orc is not None and so <= orc:
        withheld = "not shown: Static SL-opt is as fast as the Oracle under this cost model (no gap to close)"
    for r in rows.values():
        lat = r["latency_per_token"]
        r["improvement_over_static_opt"] = None if so is None else (so - lat) / so
        r["gap_closed"] = None if (withheld or so is None or orc is None) else (so - lat) / (so - orc)
    return withheld


def _fmt(v, pct=False) -> str:
    if v is None:
        return "-"
    if isinstance(v, (float, np.floating)):
        return f"{100 * v:.1f}%" if pct else f"{v:.4g}"
    return str(v)


def to_markdown(rep: dict) -> str:
    """The report as Markdown (table + notes + figures + skipped)."""
    c = rep["cost_model"]
    cost = CostModel.from_dict(c)
    lines = [
        "# specstop eval report",
        "",
        f"**{cost.provenance_line()}**",
        "",
        f"- data: `{rep['dataset']}` ({rep['prompts']} prompts, {rep['tokens']} tokens), {rep['mode']}",
        f"- tuned on: `{rep['tuned_on']['dataset']}` split `{rep['tuned_on']['split']}`"
        + (" (transfer)" if rep["transfer"] else ""),
        f"- cost model `{c['name']}`: {cost.describe()}",
        "",
        "| policy | latency/token (s) | speedup | discard rate | verification rate | accepted/round (no bonus) | tokens/round (with bonus) | vs Static-opt | gap closed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"].values():
        spr = r.get("latency_spread")
        lat = (f"{r['latency_per_token']:.5f} ± {spr['ci95']:.5f}" if spr and spr.get("ci95") is not None
               else f"{r['latency_per_token']:.5f}")
        lines.append(
            f"| {r['label']} | {lat} | {r['speedup']:.3f}x | {r['discard_rate']:.3f} | {r['verification_rate']:.3f} | "
            f"{r['accepted_per_round']:.2f} | {r['tokens_per_round']:.2f} | {_fmt(r['improvement_over_static_opt'], True)} | {_fmt(r['gap_closed'], True)} |"
        )
    lines += ["", "Notes:"]
    lines += [f"- `{k}`: {v}" for k, v in rep["notes"].items()]
    if rep.get("gap_closed_withheld"):
        lines.append(f"- **gap closed {rep['gap_closed_withheld']}**")
    if "oracle_sl" in rep:
        o = rep["oracle_sl"]
        if o["mean"] is not None:
            lines.append(
                f"- oracle speculation length: mean {o['mean']:.2f}, std {o['std']:.2f} over {o['rounds']} rounds"
            )
    by_index = rep.get("oracle_sl_by_index")
    if by_index:
        filled = [m for m in by_index["mean"] if m is not None]
        lines.append(
            f"- oracle speculation length over the normalized round index (DISCO Figs. 4, 6; {by_index['bins']} "
            f"buckets): {filled[0]:.2f} in the first filled bucket, {filled[-1]:.2f} in the last"
        )
    if rep.get("theorem1"):
        r = rep["theorem1"]
        lines.append(
            f"- Theorem 1 (unbounded drafting): expected rejections at the sampled tokens, sum of 1 - min(1, q/p), "
            f"{r['rejections_expected_at_samples']:.2f} vs sum of TV {r['sum_tv']:.2f} (difference "
            f"{r['difference']:+.2f} ± {1.96 * (r['difference_se'] or 0):.2f}, 95%, over {r['positions']} positions)"
        )
    if rep.get("sampled_replay"):
        sr = rep["sampled_replay"]
        lines.append(f"- latency ± 95% half-width over the {sr['repeats']} realisations; {sr['approximation']}")
    if rep.get("figures"):
        lines += ["", "Figures:"] + [f"- {k}: ![{k}]({v})" for k, v in rep["figures"].items()]
    if rep.get("skipped"):
        lines += ["", "Skipped:"] + [f"- {k}: {v}" for k, v in rep["skipped"].items()]
    return "\n".join(lines) + "\n"


def write_report(rep: dict, out_dir: str | Path) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    j = out_dir / "report.json"
    j.write_text(json.dumps(rep, indent=2, default=_json_default) + "\n")
    m = out_dir / "report.md"
    m.write_text(to_markdown(rep))
    return m, j


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def row_key_for_policy(rows: dict, policy: str) -> str | None:
    """The key of the report row that replays ``policy``, or None.

    Args:
        rows: ``report.json["rows"]``.
        policy: a tuned policy's name (an export's ``config.json["name"]``, e.g. ``disco_ffn``),
            ``static:K``, ``heuristic`` or ``confidence:T``.
    """
    if policy in rows:
        return policy
    kind, _, arg = policy.partition(":")
    if kind == "static":
        for key, row in rows.items():
            spec = row.get("spec") or {}
            if spec.get("kind") == "static" and str(spec.get("k")) == arg:
                return key
    key = {"heuristic": "dynheur", "confidence": f"confidence_{arg}"}.get(kind)
    return key if key in rows else None

