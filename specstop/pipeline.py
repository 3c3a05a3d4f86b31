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
from dataclasses import asdict, dataclass, field
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
        cost_model: ``calibrate`` (default: measure this machine with ``calibrate-cost`` at the
            dataset's decoding context), a path to a cost.json, or a preset name (reports then say
            in their first line that it is not this machine).
        calibrate_budget: seconds of measuring for ``calibrate``.
        force_cost: price with a measured cost table even when it fails its check (erratic or
            unordered K; :mod:`specstop.eval.cost_check`); otherwise tune refuses it.
        tune_args / eval_args: extra arguments for ``specstop tune`` / ``specstop eval``.
        online_prompts / online_repeats / online_max_new_tokens: the online check (real decoding,
            interleaved and repeated: :mod:`specstop.eval.online`) over the first test prompts;
            0 prompts disables it; max_new_tokens None = the dataset's.
        online_budget: seconds for the online check; when set, prompts and then tokens are cut until
            the cost model's estimate fits (:mod:`specstop.eval.online_budget`). None: as configured.
        online_hf_default: include HF's default assisted generation in the online check.
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
    cost_model: str = "calibrate"
    calibrate_budget: float = 60.0
    force_cost: bool = False
    tune_args: list[str | int | float] = field(default_factory=list)
    eval_args: list[str | int | float] = field(default_factory=list)
    online_prompts: int = 8
    online_repeats: int = 2
    online_max_new_tokens: int | None = None
    online_hf_default: bool = True
    online_budget: float | None = None
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
        check_range("online_repeats", self.online_repeats, low=1)
        check_range("calibrate_budget", self.calibrate_budget, low=0, low_open=True)
        check_range("online_max_new_tokens", self.online_max_new_tokens, low=1)
        check_range("online_budget", self.online_budget, low=0, low_open=True)
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
            from specstop.train.launch import run_train

            # Multi-device runs train in a child process: Lightning relaunches the command per rank.
            run_train(["--config", fam.config, "--data.data_dir", str(data_dir),
                       "--trainer.default_root_dir", str(root), *fam.args])
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
        # Measured where decoding runs: same pair, dtype and device, the evaluation data's context length.
        cost_path = run_dir / "cost.json"
        runner.run(
            "calibrate",
            {"pair": [cfg.pair, cfg.draft, cfg.target], "dtype": cfg.dtype, "device": cfg.device,
             "budget": cfg.calibrate_budget},
            ["fetch", "data", "test_data"],
            lambda: (_cli(["calibrate-cost", *_pair_args(cfg), "--dtype", cfg.dtype, "--out", str(cost_path),
                           "--data", str(eval_data), "--budget", str(cfg.calibrate_budget),
                           *(["--device", cfg.device] if cfg.device else [])]) or {"cost": str(cost_path)}),
            # A table that failed its check is measured again on a rerun (unless it is to be used anyway).
            outputs_exist=lambda o: Path(o.get("cost", "")).is_file() and (cfg.force_cost or _cost_passes(o["cost"])),
        )
        cost_arg = str(cost_path)

    # 5. tune on validation
    tuned = run_dir / "tuned.json"
    tune_argv = ["tune", "--data", str(data_dir), "--cost-model", cost_arg, "--out", str(tuned), *cfg.tune_args]
    if cfg.force_cost:
        tune_argv.append("--force-cost")
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
    eval_argv = ["eval", "--data", str(eval_data), "--tuned", str(tuned), "--out", str(eval_dir), "--overwrite",
                 *cfg.eval_args]  # --overwrite: a rerun stage replaces its own report
    if cfg.force_cost:
        eval_argv.append("--force-cost")
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
            {"n": cfg.online_prompts, "repeats": cfg.online_repeats, "max_new_tokens": cfg.online_max_new_tokens,
             "dtype": cfg.dtype, "hf_default": cfg.online_hf_default, "budget": cfg.online_budget},
            ["export", "eval", "calibrate"],
            lambda: online_check(cfg, eval_data, export_dir, tuned, eval_dir / "report.json", cost_arg, online_path),
            outputs_exist=lambda o: Path(o.get("online", "")).is_file(),
        )

    summary = write_run_report(cfg, runner, eval_dir, online_path, export_dir, train_metrics, time.perf_counter() - t_start)
    return summary


def online_check(cfg: PipelineConfig, data_dir: Path, export_dir: Path, tuned_path: Path, report_path: Path,
                 cost_arg: str, out_path: Path) -> dict:
    """Real decoding of the first test prompts (:mod:`specstop.eval.online`): the exported policy, Static
    SL-opt, the tuned confidence policy and HF's default assisted generation against the target alone;
    measured speedups beside the cost model's and the replay's predictions; greedy outputs checked."""
    import gc

    from specstop.data_gen.storage import load_table, read_manifest
    from specstop.eval import online
    from specstop.eval.cost import load_cost_model
    from specstop.eval.online_budget import size_online_check
    from specstop.eval.report import row_key_for_policy
    from specstop.eval.same_prompts import applies as same_prompts_apply
    from specstop.eval.same_prompts import replay_policies
    from specstop.export.decoder import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair.registry import load_named_pair
    from specstop.policy import PolicySpec
    from specstop.probs import DecodingConfig

    split = "test"
    seqs = load_table(data_dir, "sequences", split)
    if len(seqs) == 0:
        split, seqs = None, load_table(data_dir, "sequences")
    prompts = [list(seqs[i]["prompt_ids"]) for i in range(min(cfg.online_prompts, len(seqs)))]
    gen = read_manifest(data_dir)["generation"]
    max_new = cfg.online_max_new_tokens or int(gen["max_new_tokens"])
    tuned = json.loads(Path(tuned_path).read_text())
    rows = json.loads(Path(report_path).read_text()).get("rows") or {} if Path(report_path).is_file() else {}
    cost = load_cost_model(cost_arg)
    # Expected speedups for the estimate: the replay's for the tuned methods, 1 for the rest.
    expected = [1.0, replay_speedup_of(rows, str(tuned.get("best")))]
    expected += [replay_speedup_of(rows, n) for n in ("static_opt", "confidence_opt") if n in tuned.get("policies", {})]
    expected += [1.0] * int(cfg.online_hf_default and not float(gen.get("temperature") or 0.0))
    size = size_online_check(cost, [len(p) for p in prompts], max_new_tokens=max_new, repeats=cfg.online_repeats,
                             speedups=expected, budget_s=cfg.online_budget)
    log.info("%s", size.line())
    prompts, max_new = prompts[: size.prompts], size.max_new_tokens
    prompt_names = [str(seqs[i]["prompt_id"]) for i in range(len(prompts))]
    pair = load_named_pair(cfg.pair, draft=cfg.draft, target=cfg.target, dtype=cfg.dtype, device=cfg.device)
    # Decode as the dataset describes: greedy, or sampled at its temperature / top-k / top-p (then the
    # outputs are samples, so the token-for-token check against the target does not apply).
    decoding = DecodingConfig(temperature=float(gen.get("temperature") or 0.0), top_k=int(gen.get("top_k") or 0),
                              top_p=float(gen.get("top_p") or 1.0))
    greedy = decoding

    def replay_of(name: str) -> float | None:
        key = row_key_for_policy(rows, name)
        return rows[key].get("speedup") if key else None

    export = StoppingPolicy.from_pretrained(str(export_dir), draft_identity=pair.draft_identity,
                                            tokenizer_hash=pair.tokenizer_hash, device=pair.draft_device)
    policies = {f"export {export.label}": (export, export.config.get("name") or "")}
    for name in ("static_opt", "confidence_opt"):
        if name in tuned.get("policies", {}) and name != export.config.get("name"):
            spec = PolicySpec.from_dict(tuned["policies"][name]["spec"])
            policies[f"{name} ({spec.label})"] = (StoppingPolicy.from_spec(spec), name)
    same = {}
    if split is not None and same_prompts_apply(gen, max_new):
        # The like-for-like prediction: the replay of exactly these prompts at this budget.
        same = replay_policies(data_dir, split, prompt_names, max_new, {k: p for k, (p, _) in policies.items()}, cost)
    methods = [online.decoder_method("target", SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1"), greedy),
                                     max_draft=0, kind="baseline")]
    for label, (pol, tuned_name) in policies.items():
        methods.append(online.decoder_method(label, SpeculativeDecoder(pair, pol, greedy), spec=pol.spec,
                                             replay_speedup=replay_of(tuned_name), same_prompts=same.get(label)))
    if cfg.online_hf_default and decoding.greedy:
        methods.append(online.hf_assisted_method("HF assisted (defaults)", pair))
    meas = online.measure(prompts, methods, max_new_tokens=max_new, repeats=cfg.online_repeats)
    flips = online.greedy_flips(pair, prompts, meas, "target") if decoding.greedy else []
    static = next((m.name for m in methods if m.name.startswith("static_opt")), None)
    summary = online.summarize(meas, methods, baseline="target", cost=cost, flips=flips,
                               sampled=not decoding.greedy, reference=static)
    summary.update({"policy": str(export_dir), "dtype": pair.dtype_record(), "cost_model": cost.name,
                    "size": {**asdict(size), "line": size.line()},
                    "cost_provenance": cost.provenance_line(),
                    "markdown": f"{size.line()}\n\n{online.to_markdown(summary)}"})
    atomic_write_json(out_path, summary)
    del pair, methods
    gc.collect()
    bad = [f for f in flips if f["top2_gap"] >= 0.5 or pair_dtype_is_float32(summary)]
    if bad:
        raise RuntimeError(f"online check: speculative output differs from the target's greedy output beyond "
                           f"near-ties ({len(bad)} case(s)), see {out_path}")
    return {"online": str(out_path)}


def _cost_passes(path: str) -> bool:
    """Does the calibrated table at ``path`` pass its check (:mod:`specstop.eval.cost_check`)?"""
    from specstop.eval.cost import load_cost_model
    from specstop.eval.cost_check import table_problems

    try:
        return not table_problems(load_cost_model(path))
    except ValueError:
        return False


def replay_speedup_of(rows: dict, name: str) -> float:
    """The eval report's replayed speedup of tuned policy ``name`` (1.0 when it has none)."""
    from specstop.eval.report import row_key_for_policy

    key = row_key_for_policy(rows, name) if rows else None
    return float(rows[key].get("speedup") or 1.0) if key else 1.0


def pair_dtype_is_float32(summary: dict) -> bool:
    """In float32 verification and single steps agree exactly, so any greedy flip is a bug."""
    return (summary.get("dtype") or {}).get("dtype") == "float32"


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


def _provenance(report: dict) -> str:
    """The eval report's cost model in one line (says so when it is a preset, not this machine)."""
    from specstop.eval.cost import CostModel

    c = report.get("cost_model")
    return CostModel.from_dict(c).provenance_line() if c else "No eval report yet."


def family_metrics_table(train_metrics: dict) -> str:
    """One row per trained family: its label, the rows it was scored on and the validation metrics."""
    cols = ("auroc", "ap", "f1", "ece", "kl")
    lines = ["| family | label | table (rows) | monitor (best) | " + " | ".join(c.upper() for c in cols) + " |",
             "|---|---|---|---|" + "---:|" * len(cols)]
    for fam, m in train_metrics.items():
        m = m or {}
        v = m.get("validation") or {}
        best = m.get("best_score")
        lines.append(
            f"| {fam} | {m.get('label', '-')} | {v.get('table', '-')} ({v.get('rows', '-')}) | "
            f"{m.get('monitor', '-')} ({'-' if best is None else f'{best:.4f}'}) | "
            + " | ".join("-" if v.get(c) is None else f"{v[c]:.4f}" for c in cols) + " |"
        )
    return "\n".join(lines)


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
    md = [f"# specstop pipeline report: {run_dir}", "", f"**{_provenance(report)}**", "",
          "## Headline (replay, test split)", "", table, "",
          f"Full replay report: `{eval_dir / 'report.md'}`; export: `{export_dir}`.", ""]
    if online:
        md += [f"## Online check (real decoding, {'sampled' if online.get('sampled') else 'greedy'})", "",
               f"dtype: {(online.get('dtype') or {}).get('dtype')} ({(online.get('dtype') or {}).get('reason')}); "
               "decoding is lossless relative to the target in this dtype (bf16 near-ties can flip between "
               "batched verification and single-token steps; listed below).", "",
               online.get("markdown", ""), ""]
    md += ["## Validation metrics per family (best checkpoint)", "", family_metrics_table(train_metrics), ""]
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
        peak = f"  peak {st['peak_rss'] / 1e9:5.1f} GB" if st.get("peak_rss") else ""
        print(f"  {st['name']:<22} {st['status']:<7} {st['seconds']:8.1f} s{peak}")
    print()
    print(_provenance(summary["eval"]))
    print()
    print(headline_table(summary["eval"]))
    print()
    if summary.get("online"):
        print("Online check:")
        print(summary["online"].get("markdown", ""))
        print()
    print(f"report: {summary['report']}")
    print(f"replay report: {summary['eval_report']}")
    print(f"export: {summary['export']}")
    print(f"wall time: {summary['seconds']:.0f} s")
    return 0

