"""``specstop pipeline``: pair -> data -> train -> tune -> eval -> export -> online check, resumable.

Every stage runs through the same public CLI a user would type (``specstop generate``, ``specstop
train`` ...), so the pipeline cannot drift from the individual commands, and every stage's exact
command line is recorded in the run folder. Stages are skipped when their configuration and the
stages they read are unchanged (see :mod:`specstop.pipeline_stages`).

Run folder::

    RUN/configs/            the generated per-stage configs
    RUN/data/               dataset (train/validation/test)       RUN/test_data/  optional transfer set
    RUN/train/<family>/     Lightning logs, best checkpoint, metrics.json
    RUN/cost.json           cost model (when calibrated)
    RUN/tuned.json          tuned policies (validation split)
    RUN/eval/               replay report (report.md/json, plots)
    RUN/export/             the exported best policy
    RUN/online.json         short online check with the decoder
    RUN/report.md, RUN/report.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specstop.config_io import check_range, check_type, dataclass_from_dict, read_yaml
from specstop.data_gen.storage import atomic_write_json
from specstop.errors import UserError
from specstop.names import check_plain_name
from specstop.pipeline_stages import StageRunner

log = logging.getLogger("specstop")


@dataclass
class FamilySpec:
    """One predictor family to train.

    Attributes:
        name: registry name (disco_ffn, specdecpp_resnet, mcsd_hidden_mlp, mcsd_topk_mlp); a plain
            name, since it names the run folder ``RUN/train/<name>``.
        config: a ``configs/train/*.yaml`` LightningCLI config (default ``configs/train/<name>.yaml``).
        args: extra LightningCLI arguments, e.g. ``["--trainer.max_epochs", "3"]``.
    """

    name: str
    config: str | None = None
    args: list[str | int | float | bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = f"configs/train/{self.name}.yaml"
        self.args = [str(a) for a in self.args]


@dataclass
class PipelineConfig:
    """A pipeline run (YAML keys mirror these fields; unknown keys are an error).

    Attributes:
        run_dir: output folder (resumable: rerun the same config to continue).
        pair: known pair name or folder with draft/ and target/; ``draft``/``target`` instead.
        fetch: run ``specstop fetch-pair`` first when ``pair`` is a known, unconverted name.
        dtype, device: model placement for generation and the online check.
        data: a ``specstop generate`` config (configs/data/*.yaml keys) without pair/out.
        test_data: optional second generate config evaluated for transfer (e.g. HumanEval).
        families: predictor families to train.
        cost_model: preset name, path to cost.json, or ``calibrate`` (run calibrate-cost).
        tune_args / eval_args: extra arguments for ``specstop tune`` / ``specstop eval``.
        online_prompts / online_max_new_tokens: size of the online decoder check (0 disables).
        export_policy: which tuned policy to export (``best`` = the tuned file's best learned one).
    """

    run_dir: str = "runs/pipeline"
    pair: str | None = None
    draft: str | None = None
    target: str | None = None
    fetch: bool = True
    dtype: str = "auto"
    device: str | None = None
    data: dict = field(default_factory=dict)
    test_data: dict | None = None
    families: list[FamilySpec] = field(default_factory=list)
    cost_model: str = "reference-cpu"
    tune_args: list[str | int | float] = field(default_factory=list)
    eval_args: list[str | int | float] = field(default_factory=list)
    online_prompts: int = 2
    online_max_new_tokens: int = 48
    export_policy: str = "best"

    def __post_init__(self) -> None:
        self.tune_args = [str(a) for a in self.tune_args]
        self.eval_args = [str(a) for a in self.eval_args]

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        """Read and check a pipeline YAML: keys, value types, family names, ranges and the data sections.

        Raises:
            UserError: naming the file and the key (or the line of malformed YAML).
        """
        raw = read_yaml(path, "pipeline config")
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise UserError(f"{path}: a pipeline config must be a mapping of keys to values, got {type(raw).__name__}")
        fams_raw = raw.pop("families", None) or []
        cfg = dataclass_from_dict(cls, raw, "", str(path))
        check_type(fams_raw, list, "families")
        for f in fams_raw:
            if isinstance(f, str):
                f = {"name": f}
            cfg.families.append(dataclass_from_dict(FamilySpec, f, "families.", str(path)))
        cfg.validate(str(path))
        return cfg

    def validate(self, source: str = "the pipeline config") -> None:
        """Check ranges, family names and the generate configs before any stage runs."""
        from specstop.data_gen.config import config_from_dict
        from specstop.pair.preflight import check_dtype_name

        check_range("online_prompts", self.online_prompts, low=0)
        check_range("online_max_new_tokens", self.online_max_new_tokens, low=1)
        check_dtype_name(self.dtype)
        seen = set()
        for fam in self.families:
            check_plain_name(fam.name, "family name")  # it names RUN/train/<family>
            if fam.name in seen:
                raise UserError(f"{source}: family {fam.name!r} is listed twice; give each family once")
            seen.add(fam.name)
        for key in ("data", "test_data"):
            section = getattr(self, key)
            if section is None:
                continue
            conf = {k: v for k, v in section.items() if k not in ("pair", "draft", "target", "out")}
            try:
                config_from_dict(conf).validate()
            except UserError as err:
                raise UserError(f"{source}: section {key}: {err}") from None


def _cli(argv: list[str]) -> None:
    """Run one specstop subcommand in-process; its errors propagate with their own type.

    A user error inside a stage therefore reaches ``specstop pipeline`` as a one-line error naming
    the stage, and a bug keeps its traceback (``specstop.cli.main`` would turn both into an exit code).
    """
    from specstop.cli import run_command

    log.info("$ specstop %s", " ".join(argv))
    rc = run_command(argv[0], argv[1:])
    if rc:
        raise RuntimeError(f"`specstop {' '.join(argv)}` failed with exit code {rc}")


def _pair_args(cfg: PipelineConfig) -> list[str]:
    if cfg.draft or cfg.target:
        return ["--draft", str(cfg.draft), "--target", str(cfg.target)]
    if not cfg.pair:
        raise UserError("the pipeline config needs `pair:` (a known name or a folder) or `draft:` + `target:`")
    return ["--pair", str(cfg.pair)]


def _write_generate_config(cfg: PipelineConfig, data: dict, out: Path, path: Path) -> None:
    conf = dict(data)
    for key in ("pair", "draft", "target", "out"):
        conf.pop(key, None)
    if cfg.draft or cfg.target:
        conf["draft"], conf["target"] = cfg.draft, cfg.target
    else:
        conf["pair"] = cfg.pair
    conf["out"] = str(out)
    conf.setdefault("dtype", cfg.dtype)
    if cfg.device:
        conf.setdefault("device", cfg.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(conf, sort_keys=False))


def _find_best_checkpoint(root: Path) -> tuple[str, dict]:
    """The newest ``metrics.json`` written by `specstop train` under ``root``."""
    found = sorted(root.rglob("metrics.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"training under {root} wrote no metrics.json / best checkpoint")
    metrics = json.loads(found[-1].read_text())
    return metrics["best_checkpoint"], metrics


def run_pipeline(cfg: PipelineConfig, *, force: bool = False) -> dict:
    """Run (or resume) the pipeline; returns the summary dict also written to report.json.

    The run folder is locked for the run (a second pipeline on it is refused; a lock left by a
    killed run is detected by its pid and taken over).
    """
    from specstop.outputs import claim_output_dir

    with claim_output_dir(cfg.run_dir, command=f"specstop pipeline (run_dir {cfg.run_dir})"):
        return _run_stages(cfg, force=force)


def _run_stages(cfg: PipelineConfig, *, force: bool = False) -> dict:
    """:func:`run_pipeline` once the run folder is claimed."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = StageRunner(run_dir, force=force)
    t_start = time.perf_counter()

    # 1. the pair
    from specstop.pair.registry import KNOWN_PAIRS, is_converted

    if cfg.fetch and cfg.pair in KNOWN_PAIRS:
        runner.run(
            "fetch",
            {"pair": cfg.pair},
            [],
            lambda: (_cli(["fetch-pair", cfg.pair]) or {"pair": cfg.pair}),
            outputs_exist=lambda _o: is_converted(cfg.pair),
        )

    # 2. data (and the optional transfer test set)
    def _generate_stage(name: str, data_cfg: dict) -> Path:
        out = run_dir / name
        conf_path = run_dir / "configs" / f"{name}.yaml"
        _write_generate_config(cfg, data_cfg, out, conf_path)
        runner.run(
            name,
            {"data": data_cfg, "pair": [cfg.pair, cfg.draft, cfg.target], "dtype": cfg.dtype},
            ["fetch"],
            lambda: (_cli(["generate", "--config", str(conf_path)]) or {"data_dir": str(out)}),
            outputs_exist=lambda o: (Path(o.get("data_dir", "")) / "manifest.json").is_file(),
        )
        return out

    data_dir = _generate_stage("data", cfg.data)
    eval_data = _generate_stage("test_data", cfg.test_data) if cfg.test_data else data_dir

    # 3. train each family
    checkpoints: dict[str, str] = {}
    train_metrics: dict[str, dict] = {}
    for fam in cfg.families:
        root = run_dir / "train" / fam.name

        def _train(fam=fam, root=root) -> dict:
            argv = ["train", "--config", fam.config, "--data.data_dir", str(data_dir),
                    "--trainer.default_root_dir", str(root), *fam.args]
            _cli(argv)
            ckpt, metrics = _find_best_checkpoint(root)
            return {"checkpoint": ckpt, "metrics": metrics.get("metrics", metrics)}

        cfg_text = Path(fam.config).read_text() if Path(fam.config).is_file() else fam.config
        res = runner.run(
            f"train_{fam.name}",
            {"config": cfg_text, "args": fam.args},
            ["data"],
            _train,
            outputs_exist=lambda o: Path(o.get("checkpoint", "")).is_file(),
        )
        checkpoints[fam.name] = res.outputs["checkpoint"]
        train_metrics[fam.name] = res.outputs.get("metrics", {})

    # 4. cost model
    cost_arg = cfg.cost_model
    if cfg.cost_model == "calibrate":
        cost_path = run_dir / "cost.json"
        runner.run(
            "calibrate",
            {"pair": [cfg.pair, cfg.draft, cfg.target], "dtype": cfg.dtype, "device": cfg.device},
            ["fetch"],
            lambda: (_cli(["calibrate-cost", *_pair_args(cfg), "--dtype", cfg.dtype, "--out", str(cost_path),
                           *(["--device", cfg.device] if cfg.device else [])]) or {"cost": str(cost_path)}),
            outputs_exist=lambda o: Path(o.get("cost", "")).is_file(),
        )
        cost_arg = str(cost_path)

    # 5. tune on validation
    tuned = run_dir / "tuned.json"
    tune_argv = ["tune", "--data", str(data_dir), "--cost-model", cost_arg, "--out", str(tuned), *cfg.tune_args]
    for name, ckpt in checkpoints.items():
        tune_argv += ["--checkpoint", f"{name}={ckpt}"]
    runner.run(
        "tune",
        {"args": tune_argv[1:]},
        ["data", *[f"train_{f.name}" for f in cfg.families], "calibrate"],
        lambda: (_cli(tune_argv) or {"tuned": str(tuned)}),
        outputs_exist=lambda o: Path(o.get("tuned", "")).is_file(),
    )

    # 6. evaluate on the test split (of the transfer set when given)
    eval_dir = run_dir / "eval"
    eval_argv = ["eval", "--data", str(eval_data), "--tuned", str(tuned), "--out", str(eval_dir), *cfg.eval_args]
    runner.run(
        "eval",
        {"args": eval_argv[1:]},
        ["tune", "test_data", "data"],
        lambda: (_cli(eval_argv) or {"report": str(eval_dir / "report.json")}),
        outputs_exist=lambda o: Path(o.get("report", "")).is_file(),
    )

    # 7. export the chosen policy
    export_dir = run_dir / "export"
    tuned_doc = json.loads(tuned.read_text())
    policy_name = tuned_doc.get("best") if cfg.export_policy == "best" else cfg.export_policy
    family = (tuned_doc.get("policies", {}).get(policy_name, {}).get("spec") or {}).get("family")
    # --overwrite: the stage reruns only when its inputs changed, and then replaces its own export.
    export_argv = ["export", "--tuned", str(tuned), "--policy", str(policy_name), "--out", str(export_dir), "--overwrite"]
    if family and family in checkpoints:
        export_argv += ["--checkpoint", checkpoints[family]]
    runner.run(
        "export",
        {"args": export_argv[1:]},
        ["tune"],
        lambda: (_cli(export_argv) or {"export": str(export_dir)}),
        outputs_exist=lambda o: (Path(o.get("export", "")) / "config.json").is_file(),
    )

    # 8. a short online check with the real decoder: lossless + measured speed
    online_path = run_dir / "online.json"
    if cfg.online_prompts > 0:
        runner.run(
            "online",
            {"n": cfg.online_prompts, "max_new_tokens": cfg.online_max_new_tokens, "dtype": cfg.dtype},
            ["export"],
            lambda: online_check(cfg, eval_data, export_dir, online_path),
            outputs_exist=lambda o: Path(o.get("online", "")).is_file(),
        )

    summary = write_run_report(cfg, runner, eval_dir, online_path, export_dir, train_metrics, time.perf_counter() - t_start)
    return summary


def online_check(cfg: PipelineConfig, data_dir: Path, export_dir: Path, out_path: Path) -> dict:
    """Decode a few test prompts with the exported policy and with the target alone; check equality."""
    import torch

    from specstop.data_gen.storage import load_table
    from specstop.export.decoder import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair.registry import load_named_pair
    from specstop.probs import DecodingConfig

    pair = load_named_pair(cfg.pair, draft=cfg.draft, target=cfg.target, dtype=cfg.dtype, device=cfg.device)
    seqs = load_table(data_dir, "sequences", "test")
    if len(seqs) == 0:
        seqs = load_table(data_dir, "sequences")
    n = min(cfg.online_prompts, len(seqs))
    policy = StoppingPolicy.from_pretrained(str(export_dir))
    decoder = SpeculativeDecoder(pair, policy, DecodingConfig(temperature=0.0))
    rows = []
    for i in range(n):
        prompt_ids = list(seqs[i]["prompt_ids"])
        x = torch.tensor([prompt_ids], device=pair.target_device)
        t0 = time.perf_counter()
        with torch.no_grad():
            # Compare on the shared vocabulary (padded logit rows suppressed), which is what
            # speculative decoding decodes over.
            padded = list(range(pair.vocab_size, pair.target_identity.logits_size)) or None
            ref = pair.target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.online_max_new_tokens, do_sample=False,
                suppress_tokens=padded,
            )[0, x.shape[1]:].tolist()
        t_target = time.perf_counter() - t0
        res = decoder.generate(prompt_ids, max_new_tokens=cfg.online_max_new_tokens)
        eos = pair.tokenizer.eos_token_id
        ref = _strip_after_eos(ref, eos)
        ours = _strip_after_eos(list(res.token_ids), eos)
        rows.append({
            "prompt_id": seqs[i]["prompt_id"],
            "tokens": len(ours),
            "identical_to_target_greedy": ours == ref,
            "target_seconds": t_target,
            "spec_seconds": res.timings.get("total"),
            "speedup": t_target / res.timings["total"] if res.timings.get("total") else None,
            "counters": res.counters,
        })
        policy.reset() if hasattr(policy, "reset") else None
    doc = {"policy": str(export_dir), "rows": rows,
           "all_identical": all(r["identical_to_target_greedy"] for r in rows),
           "mean_speedup": (sum(r["speedup"] for r in rows if r["speedup"]) / max(1, len(rows))) if rows else None}
    atomic_write_json(out_path, doc)
    if not doc["all_identical"]:
        raise RuntimeError(f"online check: speculative output differs from target greedy output, see {out_path}")
    return {"online": str(out_path)}


def _strip_after_eos(ids: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids


def headline_table(report: dict) -> str:
    """Speedup of each policy over target only and over Static SL-opt, from eval's report.json."""
    rows = report.get("rows") or {}
    lines = ["| policy | latency/token (s) | speedup vs target | vs Static SL-opt |", "|---|---:|---:|---:|"]
    for row in rows.values():
        lat, sp, imp = row.get("latency_per_token"), row.get("speedup"), row.get("improvement_over_static_opt")
        if lat is None or sp is None:
            continue
        vs = "" if imp is None else f"{100 * imp:+.1f}%"
        lines.append(f"| {row.get('label')} | {lat:.4f} | {sp:.3f}x | {vs} |")
    for name, why in (report.get("skipped") or {}).items():
        lines.append(f"| {name} | skipped: {why} | | |")
    return "\n".join(lines)


def _replay_speedup_of_export(report: dict, export_dir: Path) -> float | None:
    """The eval report's replay speedup for the exported policy (its row is keyed by the policy name)."""
    from specstop.eval.report import row_key_for_policy

    try:
        name = json.loads((Path(export_dir) / "config.json").read_text())["name"]
    except (OSError, ValueError, KeyError):
        return None
    rows = report.get("rows") or {}
    key = row_key_for_policy(rows, name)
    return rows[key].get("speedup") if key else None


def write_run_report(cfg, runner: StageRunner, eval_dir: Path, online_path: Path, export_dir: Path,
                     train_metrics: dict, seconds: float) -> dict:
    run_dir = Path(cfg.run_dir)
    report = json.loads((eval_dir / "report.json").read_text()) if (eval_dir / "report.json").is_file() else {}
    online = json.loads(online_path.read_text()) if online_path.is_file() else None
    table = headline_table(report)
    summary = {
        "run_dir": str(run_dir),
        "report": str(run_dir / "report.md"),
        "eval_report": str(eval_dir / "report.md"),
        "export": str(export_dir),
        "stages": [dataclasses.asdict(r) for r in runner.results],
        "train_metrics": train_metrics,
        "online": online,
        "eval": report,
        "seconds": seconds,
    }
    md = [f"# specstop pipeline report: {run_dir}", "", "## Headline (replay, test split)", "", table, "",
          f"Full replay report: `{eval_dir / 'report.md'}`; export: `{export_dir}`.", ""]
    if online:
        md += ["## Online check (our decoder, greedy)", "",
               f"all outputs identical to the target's greedy output: **{online['all_identical']}**; "
               f"mean measured speedup over target-only `generate`: {online.get('mean_speedup') or float('nan'):.2f}x "
               f"on {len(online['rows'])} prompt(s)", ""]
        predicted = _replay_speedup_of_export(report, export_dir)
        if predicted is not None:
            md += [f"The replay predicted {predicted:.2f}x for this policy on the whole test split with the "
                   f"`{(report.get('cost_model') or {}).get('name')}` cost model; a gap between the two is the cost "
                   "model's error on this machine (the decoder's counts equal the replay's): measure it with "
                   "`specstop calibrate-cost` and `benchmarks/online_speedup.py --cost` (README, Tests and benchmarks).", ""]
    md += ["## Validation metrics per family", "", "| family | metrics |", "|---|---|"]
    for fam, m in train_metrics.items():
        keep = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in (m or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        md.append(f"| {fam} | {json.dumps(keep)[:400]} |")
    md += ["", "## Stages", "", runner.summary_table(), "", f"Total wall time: {seconds:.0f} s", ""]
    (run_dir / "report.md").write_text("\n".join(md))
    atomic_write_json(run_dir / "report.json", summary)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="pipeline YAML (configs/pipelines/*.yaml)")
    parser.add_argument("--run-dir", help="override the config's run_dir")
    parser.add_argument("--force", action="store_true", help="rerun every stage even if unchanged")


def run(args: argparse.Namespace) -> int:
    cfg = PipelineConfig.from_yaml(args.config)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    summary = run_pipeline(cfg, force=args.force)
    print()
    print("stages:")
    for st in summary["stages"]:
        print(f"  {st['name']:<22} {st['status']:<7} {st['seconds']:8.1f} s")
    print()
    print(headline_table(summary["eval"]))
    print()
    print(f"report: {summary['report']}")
    print(f"replay report: {summary['eval_report']}")
    print(f"export: {summary['export']}")
    print(f"wall time: {summary['seconds']:.0f} s")
    return 0

