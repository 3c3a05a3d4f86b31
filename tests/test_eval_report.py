"""End to end: tune + eval CLIs on a synthetic dataset write parseable reports and plots."""

import json

import numpy as np
import pytest

from specstop.policy import PolicySpec


def test_tune_and_eval_cli(tmp_path):
    pytest.importorskip("datasets")
    from specstop.cli import main
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint
    from specstop.testing import write_synthetic_dataset

    data = write_synthetic_dataset(
        tmp_path / "data",
        {"validation": 4, "test": 4},
        tokens_per_prompt=40,
        hidden_size=8,
        with_rollouts=True,
        rollout_length=20,
    )
    save_predictor_checkpoint(tmp_path / "disco.ckpt", build_predictor("disco_ffn"))
    save_predictor_checkpoint(
        tmp_path / "sdpp.ckpt", build_predictor("specdecpp_resnet", hidden_size=8, depth=1)
    )
    tuned = tmp_path / "tuned.json"
    rc = main(
        [
            "tune",
            "--data",
            str(data),
            "--cost-model",
            "llama2-7b-70b",
            "--checkpoint",
            f"disco={tmp_path / 'disco.ckpt'}",
            "--checkpoint",
            f"sdpp={tmp_path / 'sdpp.ckpt'}",
            "--out",
            str(tuned),
            "--sl-max-grid",
            "4,8",
        ]
    )
    assert rc == 0
    # A predictor named explicitly must load: a missing one fails the command (never "skipped").
    assert main(["tune", "--data", str(data), "--cost-model", "llama2-7b-70b", "--checkpoint",
                 f"gone={tmp_path / 'missing.ckpt'}", "--out", str(tmp_path / "t2.json"), "--sl-max-grid", "4,8"]) == 2
    assert not (tmp_path / "t2.json").exists()
    t = json.loads(tuned.read_text())
    assert t["schema_version"] == 1 and t["best"] in t["policies"]
    assert {"static_opt", "heuristic_opt", "confidence_opt", "disco", "sdpp"} <= set(t["policies"])
    assert set(t["checkpoints"]) == {"disco", "sdpp"}
    assert len(t["policies"]["sdpp"]["validation"]["paper_grid"]) == 5
    PolicySpec.from_dict(t["policies"]["disco"]["spec"])
    out = tmp_path / "report"
    assert main(["eval", "--data", str(data), "--tuned", str(tuned), "--out", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    for key in (
        "target_only",
        "dynheur",
        "static_5",
        "static_opt",
        "confidence_0.4",
        "confidence_opt",
        "disco",
        "sdpp",
        "pearl",
        "oracle",
    ):
        assert key in rep["rows"], key
        assert np.isfinite(rep["rows"][key]["latency_per_token"])
    assert rep["rows"]["oracle"]["gap_closed"] == pytest.approx(1.0)
    assert rep["rows"]["static_opt"]["improvement_over_static_opt"] == 0.0
    assert "MCSD top-k" in rep["skipped"]
    for f in ("pareto.png", "oracle_sl_hist.png", "oracle_sl_by_index.png", "calibration.png", "report.md"):
        assert (out / f).stat().st_size > 0
    assert "Oracle" in (out / "report.md").read_text()


def test_row_key_for_policy_finds_rows_by_name_and_spec():
    from specstop.eval.report import row_key_for_policy

    rows = {
        "target_only": {"spec": None},
        "dynheur": {"spec": {"kind": "heuristic"}},
        "static_opt": {"spec": {"kind": "static", "k": 6}},
        "confidence_0.4": {"spec": {"kind": "confidence", "threshold": 0.4}},
        "disco_ffn": {"spec": {"kind": "predictor"}},
    }
    assert row_key_for_policy(rows, "disco_ffn") == "disco_ffn"
    assert row_key_for_policy(rows, "static:6") == "static_opt"
    assert row_key_for_policy(rows, "heuristic") == "dynheur"
    assert row_key_for_policy(rows, "confidence:0.4") == "confidence_0.4"
    assert row_key_for_policy(rows, "static:3") is None
    assert row_key_for_policy(rows, "specdecpp_resnet") is None


def test_calibration_pairs_hidden_scores_with_the_drafted_token():
    # Hidden heads score the state after a token: on a mismatch row that is the state after the
    # draft's own token d_m (stored with the rollout), not after the target's X_i.
    from specstop.eval.episodes import from_arrays
    from specstop.eval.report import aligned_scores

    gm = np.array([1, 0, 1, 0, 1], bool)
    d = from_arrays(gm, max_new_tokens=10, eos_token_id=99, token=np.arange(5),
                    rollouts={1: {"tokens": [7, 8]}, 3: {"tokens": [7]}})
    row = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    d.add_scores("h", "hidden", row, np.zeros(3), np.array([0.1, 0.2]))
    d.add_scores("q", "dist", row, np.zeros(3), None)
    np.testing.assert_allclose(aligned_scores(d, "h"), [0.9, 0.1, 0.7, 0.2, 0.5])
    np.testing.assert_allclose(aligned_scores(d, "q"), row)
    d.temperature = 1.0
    assert aligned_scores(d, "h") is None


def _brute_force_oracle_by_index(gm: np.ndarray, lengths: list[int], bins: int) -> list:
    """DISCO Fig. 6 by its definition: per prompt, each round's oracle SL is the number of leading
    matches from where the round starts (the round then emits them plus the target's token); round
    j of n sits at j / (n - 1); each bucket of width 1 / bins averages the SLs that land in it."""
    buckets: list[list[int]] = [[] for _ in range(bins)]
    start = 0
    for n_tok in lengths:
        rows, sls, s = gm[start:start + n_tok], [], 0
        while s < n_tok:
            k = 0
            while s + k < n_tok and rows[s + k]:
                k += 1
            sls.append(k)
            s += k + 1
        for j, sl in enumerate(sls):
            x = j / (len(sls) - 1) if len(sls) > 1 else 0.0
            buckets[min(int(x * bins), bins - 1)].append(sl)
        start += n_tok
    return [float(np.mean(b)) if b else None for b in buckets]


def test_report_charts_the_oracle_sl_over_the_normalized_round_index(tmp_path, monkeypatch):
    from specstop.eval import plots
    from specstop.eval.cost import CostModel
    from specstop.eval.episodes import from_arrays
    from specstop.eval.report import build_report, to_markdown

    rng = np.random.default_rng(3)
    lengths = [30, 7, 55, 1, 18]
    # Acceptance that falls along each prompt, so the buckets differ from each other.
    gm = np.concatenate([rng.random(n) < np.linspace(0.95, 0.3, n) for n in lengths])
    data = from_arrays(gm, lengths=lengths, max_new_tokens=1000, eos_token_id=99)
    drawn = {}
    real_plot = plots.oracle_index_plot
    monkeypatch.setattr(plots, "oracle_index_plot", lambda path, curve: drawn.setdefault("curve", curve) and
                        real_plot(path, curve))
    rep = build_report(data, {"policies": {}}, CostModel(t_draft=0.01, t_target=0.03), {}, {}, out_dir=tmp_path)
    want = _brute_force_oracle_by_index(gm, lengths, bins=20)
    assert len({m for m in want if m is not None}) > 3  # the buckets differ: a chart worth checking
    for curve in (rep["oracle_sl_by_index"], drawn["curve"]):
        assert curve["bins"] == 20
        assert [m is None for m in curve["mean"]] == [m is None for m in want]
        np.testing.assert_allclose([m for m in curve["mean"] if m is not None], [m for m in want if m is not None])
    assert sum(rep["oracle_sl_by_index"]["rounds"]) == rep["oracle_sl"]["rounds"]
    assert (tmp_path / rep["figures"]["oracle_by_index"]).stat().st_size > 0
    assert "oracle_sl_by_index.png" in to_markdown(rep)
