"""Serving throughput in vLLM: no speculation, vLLM's draft model at static K, specstop's per-batch
schedule, and specstop's proposer (confidence rule, learned export), at B concurrent requests.

Greedy decoding of held-out prompts (default: the first ``--prompts`` tasks of MBPP's own test split,
``builtin:mbpp`` tasks 11-510; specstop's MBPP recipes train on tasks 601-974 and tune on 511-600),
rendered with the target's chat template as ``specstop generate`` renders them. At batch size B the prompts go to
``vllm.LLM.generate`` B at a time (one call per batch of B prompts submitted together; every prompt
once per batch size and repeat), and tokens/s is the generated tokens of all prompts over the wall
time of those calls (prefill included, as a client sees it). Methods (``--methods`` picks a subset):

* ``no_spec``: vLLM without speculation, the baseline (always run);
* ``draft_kK``: vLLM's draft-model proposer, ``{"method": "draft_model", "model": DRAFT,
  "num_speculative_tokens": K}`` for K in ``--k-grid`` (default 1,2,3,4,6; K = 4 is the usual
  default, and the grid finds the best static K per B);
* ``schedule``: vLLM's draft model with ``num_speculative_tokens_per_batch_size``, from the
  ``batch_schedule`` of ``--engines DIR``'s vllm.json or from ``--schedule B:K,...``;
* ``specstop_confidence``: specstop's proposer (``custom_class``) with a confidence rule:
  ``--confidence`` tau and ``--sl-max``, or ``--engines``' tuned ``confidence_opt`` option;
* ``specstop_learned``: specstop's proposer with a learned export (``--policy EXPORT_DIR``, or the
  learned option of ``--engines`` exported with ``--for hf,vllm``);
* ``specstop_heuristic``: ``--engines``' ``heuristic_opt`` through the proposer (only when named in
  ``--methods``);
* ``runner_confidence`` / ``runner_learned``: the same confidence rule / learned export inside vLLM's own
  batched draft-model runner (``worker_cls`` :mod:`specstop.decode.vllm_worker`): the draft runs as
  ``draft_kK``'s does, every request's draft stopped where the policy says, K capped at SL_max (and per
  batch size where ``--engines`` wrote per-batch caps for the option);
* ``<proposer or runner method>_int8`` / ``_int4``: the same with the draft's weights quantized as the
  proposer or the runner loads it (``--draft-quant``, ``specstop.pair.quantize``,
  :mod:`specstop.decode.vllm_draft_quant`); ``--proposer-schedule B:K,...`` caps every
  proposer and runner method's drafts per batch size (K = 0: no drafts there).

``--engines DIR`` (a ``specstop export --for vllm`` folder) is used by option name as written, with
the draft it names replaced by ``--draft`` (recorded in the output); its ``static_opt`` K joins the grid.

Timing design. A speculative config is per engine, so every method needs its own ``vllm.LLM``, and
only one engine fits in memory at a time. Restarting engines for every repeat would cost an engine
start per (method, repeat), so instead: ``--passes`` passes (default 2) over the methods, the method
order rotated between passes (pass p starts at method p x n_methods / passes), so drift in machine
load falls on all methods alike; in each pass every method starts its engine once, runs ``--warmup``
warm-up rounds (one call of the first B prompts at every B, ``--warmup-tokens`` tokens), then
``--repeats`` repeats, each over every B in an order rotated per repeat. Tokens/s per (method, B) is
the median over passes x repeats, with min-max and IQR. ``--passes N --repeats 1`` is fully
interleaved (an engine start per method and repeat). Prefix caching is off, so every request
prefills as a new request would. Each engine runs in a fresh vLLM process (``--process engine``)
unless ``--process pass`` runs a pass's engines one after another in one process.

Outputs. Greedy outputs of every method are compared with ``no_spec``'s at the same B, token for token,
over all passes and repeats; every differing prompt is listed with the position of the first difference,
both continuations as text, and the target's top-2 logit gap there (from an untimed pass of
``no_spec`` with vLLM's top-2 logprobs: the logprob gap equals the logit gap). vLLM's own counters
give drafts, drafted and accepted tokens per run. ``--out X.json`` gets the raw timings, settings,
CPU (lscpu model and flags), vLLM/torch/transformers versions and the summary; ``X.md`` the tables;
``X_logs/`` each vLLM process's log. For the proposer methods, the costs inside the engine as the proposer
timed them: seconds per drafted token, and seconds per target step by the block each row verified.
Before every vLLM process and after the last, the script times a fixed workload while no engine runs
(:mod:`specstop.measure.host_probe`); where those probes spread past 20%, the host changed speed under the
run, and the tables and a last line say its ratios are not comparable.

vLLM runs in its own virtualenv (``make vllm-env``): this script runs in any Python with specstop and
transformers (the project venv) and starts ``--vllm-python`` (default: ``$SPECSTOP_VLLM_VENV`` or
``.venv-vllm``'s python, else this Python) for the engines; run directly by ``.venv-vllm/bin/python``
it works the same. Engine settings that start in seconds on CPU: eager mode, compilation mode 0, the
single-process executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``),
all CPUs of this process's affinity (``VLLM_CPU_OMP_THREADS_BIND``, no reserved CPU),
``--kv-cache-gib`` of KV cache; ``--engine-arg KEY=JSON`` overrides any ``vllm.LLM`` argument. The
environment passes through (``VLLM_*`` set there win; ``LD_PRELOAD`` for the tcmalloc/libiomp vLLM's log
suggests is not set here).

    python benchmarks/vllm_serving.py --smoke --out vllm_smoke.json
    python benchmarks/vllm_serving.py --draft ~/.cache/specstop/pairs/qwen2.5-coder-0.5b-1.5b/draft \\
        --target ~/.cache/specstop/pairs/qwen2.5-coder-0.5b-1.5b/target --engines runs/engines \\
        --prompts 8 --max-new-tokens 64 --batch-sizes 1,2,4,8 --out runs/vllm_serving.json
    python benchmarks/vllm_serving.py --pair qwen2.5-coder-0.5b-1.5b --methods no_spec,draft_k4,specstop_confidence \\
        --batch-sizes 1,8 --passes 2 --repeats 1 --out runs/vllm_serving_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from specstop.measure.host_probe import DRIFT, drift, drift_line, probe

PROGRESS = "[vllm_serving]"
DEFAULT_K = 4  # vLLM's usual num_speculative_tokens for a draft model
PROPOSER_METHODS = ("specstop_confidence", "specstop_learned", "specstop_heuristic")
#: specstop's stop inside vLLM's own draft-model runner (a ``worker_cls``, the draft vLLM's own).
RUNNER_METHODS = ("runner_confidence", "runner_learned")
#: How a runner method's label names an engines file's per-batch caps.
FILE_CAPS = ", the file's per-batch cap "
#: The ``vllm.LLM`` arguments a method sets beside the engine's.
METHOD_ENGINE_ARGS = ("worker_cls", "async_scheduling")
ALL_METHODS = ("no_spec, draft_kK, schedule, specstop_confidence, specstop_learned, specstop_heuristic, "
               "runner_confidence, runner_learned")


# ====================================================================== the vLLM worker (vLLM's venv)
def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _rotated(items: list, shift: int) -> list:
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


def _top2(position_logprobs) -> list:
    """``[[token, logprob], [token, logprob]]``: the two most likely tokens of one position's logprobs."""
    items = [(int(tok), float(getattr(lp, "logprob", lp))) for tok, lp in position_logprobs.items()]
    items.sort(key=lambda t: -t[1])
    return [list(t) for t in items[:2]]


def _step_table(steps: list[tuple[float, int, bool]]) -> dict:
    """The engine's decode steps of a run by how many rows decoded in them: ``{rows: {"n", "seconds",
    "median_s"}}``, and the steps that held a prefill (``"prefill"``)."""
    table: dict = {}
    for seconds, rows, decode in steps:
        table.setdefault(str(rows) if decode else "prefill", []).append(seconds)
    return {key: {"n": len(v), "seconds": sum(v), "median_s": statistics.median(v)} for key, v in table.items()}


def _say(msg: str) -> None:
    print(f"{PROGRESS} {msg}", flush=True)


def worker(job: dict) -> dict:
    """Start each method's engine in turn (in this process), warm it up, time the repeats; see the module doc."""
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    from specstop.decode.vllm_proposer import live_proposers, spec_counters
    from specstop.measure.vllm_cost import EngineSteps, decode_phase, shutdown_engine

    result: dict = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                                 "transformers": transformers.__version__, "python": platform.python_version()},
                    "methods": {}}
    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    sizes = list(job["batch_sizes"])
    greedy = {"temperature": 0.0, "ignore_eos": bool(job["ignore_eos"])}
    # --temperature / --top-p: every request samples at that setting (seeded per request, so each method
    # draws from the same seeds); greedy by default
    decoding = {**greedy, "temperature": job.get("temperature", 0.0), "top_p": job.get("top_p", 1.0)}
    params = SamplingParams(max_tokens=job["max_tokens"], **decoding)
    warm = SamplingParams(max_tokens=job["warmup_tokens"], **decoding)
    for m in job["methods"]:
        name = m["name"]
        res: dict = {"runs": []}
        result["methods"][name] = res
        _say(f"{name}: starting the engine")
        t0 = time.perf_counter()
        try:
            extra = {k: m[k] for k in METHOD_ENGINE_ARGS if m.get(k) is not None}
            llm = LLM(model=job["target"], speculative_config=m.get("speculative_config"),
                      additional_config=m.get("additional_config") or {}, disable_log_stats=False, **job["engine"],
                      **extra)
        except Exception:  # noqa: BLE001 - reported in the output; the other methods still run
            res["error"] = traceback.format_exc()
            _say(f"{name}: the engine did not start")
            continue
        res["start_s"] = time.perf_counter() - t0
        timer = EngineSteps(llm)
        try:
            t0 = time.perf_counter()
            for _ in range(job["warmup"]):
                for b in sizes:
                    llm.generate(prompts[:b], warm, use_tqdm=False)
            res["warmup_s"] = time.perf_counter() - t0
            if m.get("reference_logprobs") and not decoding["temperature"]:  # untimed: the target's top-2, per B
                ref_params = SamplingParams(max_tokens=job["max_tokens"], logprobs=2, **greedy)
                res["reference"] = {}
                for b in sizes:
                    ids, top2 = [], []
                    for batch in _batches(prompts, b):
                        for o in llm.generate(batch, ref_params, use_tqdm=False):
                            ids.append(list(o.outputs[0].token_ids))
                            top2.append([_top2(p) for p in (o.outputs[0].logprobs or [])])
                    res["reference"][str(b)] = {"outputs": ids, "top2": top2}
            for r in range(job["repeats"]):
                for b in _rotated(sizes, job["b_shift"] + r):
                    before = spec_counters(llm)
                    walls, outs, phases, steps = [], [], [], []
                    for j, batch in enumerate(_batches(prompts, b)):
                        timer.begin(len(batch))
                        each = params if not decoding["temperature"] else [
                            params.clone() for _ in batch]  # a seed per request: the same draws for every method
                        if decoding["temperature"]:
                            for i, sp in enumerate(each):
                                sp.seed = 1000 * r + j * b + i
                        t = time.perf_counter()
                        got = llm.generate(batch, each, use_tqdm=False)
                        walls.append(time.perf_counter() - t)
                        outs += [list(o.outputs[0].token_ids) for o in got]
                        phases.append(decode_phase(got))
                        steps += timer.steps
                    after = spec_counters(llm)
                    tokens = sum(len(o) for o in outs)
                    # The decode phase alone (every prefill done): what the engine files' predictions price.
                    decode = None if None in phases else {"tokens": sum(p[0] for p in phases),
                                                          "seconds": sum(p[1] for p in phases)}
                    res["runs"].append({"repeat": r, "batch_size": b, "wall_s": sum(walls), "batch_wall_s": walls,
                                        "tokens": tokens, "outputs": outs, "decode": decode,
                                        "steps": _step_table(steps),
                                        "spec": {k: after[k] - before[k] for k in after}})
                    _say(f"{name}: B={b} repeat {r}: {tokens} tokens in {sum(walls):.2f} s "
                         f"({tokens / max(sum(walls), 1e-9):.2f} tok/s)")
            proposers = live_proposers()
            if proposers:  # specstop's proposer ran: the engine's own step costs as it saw them
                res["engine_costs"] = proposers[-1].engine_costs()
            if m.get("worker_cls"):  # specstop's stop in vLLM's runner: its rounds, draft lengths, live pricing
                from specstop.decode.vllm_draft_runner import live_runners

                runner = live_runners()[-1]
                res["runner_stats"] = {**runner.stops.stats, "live": runner.stops.live_record(),
                                       "draft_kv": dict(runner.draft_kv),
                                       "gate": runner.gate.record() if runner.gate is not None else None,
                                       "draft_quant": runner.draft_quant_record}
        except Exception:  # noqa: BLE001
            res["error"] = traceback.format_exc()
            _say(f"{name}: failed")
        t0 = time.perf_counter()
        shutdown_engine(llm)
        res["shutdown_s"] = time.perf_counter() - t0
    return result


# ====================================================================== the driver
def _parse_ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise SystemExit(f"{what} must hold integers >= 1, got {text!r}")
    return out


def parse_schedule(text: str) -> list[list[int]]:
    """``"1:4,4:2,8:1"`` -> vLLM's ``num_speculative_tokens_per_batch_size`` (ranges start at each B, the first
    at 1; batch sizes above the last B keep its K), as ``specstop export --for vllm`` writes it."""
    pairs = []
    for part in text.split(","):
        try:
            b, k = (int(v) for v in part.split(":"))
        except ValueError:
            raise SystemExit(f"--schedule takes B:K pairs, e.g. 1:4,4:2,8:1; got {part!r}") from None
        if b < 1 or k < 0:
            raise SystemExit(f"--schedule: batch sizes must be >= 1 and K >= 0, got {part!r}")
        pairs.append((b, k))
    pairs.sort()
    ranges = []
    for i, (b, k) in enumerate(pairs):
        lo = 1 if i == 0 else b
        hi = pairs[i + 1][0] - 1 if i + 1 < len(pairs) else b
        ranges.append([lo, hi, k])
    return ranges


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from specstop.script_args import (
        ScriptParser,
        check_result_path,
        existing_dir,
        existing_path,
        nonnegative_float,
        nonnegative_int,
        positive_float,
        positive_int,
        python_executable,
        result_file,
        unit_interval,
    )

    p = ScriptParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--draft", help="draft model folder (or hub id)")
    g.add_argument("--target", help="target model folder (or hub id)")
    g.add_argument("--pair", help="instead of --draft/--target: a known pair name (its converted folders in the cache) "
                                  "or a folder holding draft/ and target/")
    g.add_argument("--dtype", default="bfloat16", help="vLLM dtype of the target (the draft runs in it too)")
    g = p.add_argument_group("prompts and decoding")
    g.add_argument("--prompts", type=positive_int, default=8, help="number of held-out prompts (a multiple of the largest B)")
    g.add_argument("--prompt-source", default="builtin:mbpp", help="specstop prompt source")
    g.add_argument("--template", default="mbpp", help="prompt template")
    g.add_argument("--split-scheme", default="mbpp", help="split scheme (mbpp: MBPP's own task_id split)")
    g.add_argument("--split", default="test", help="the held-out split the prompts come from (its first N)")
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per prompt")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens (default: stop at EOS)")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0,
                   help="sample every request at this temperature (seeded per request; default 0: greedy, outputs compared)")
    g.add_argument("--top-p", type=unit_interval, default=1.0, help="top-p of sampled requests")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {ALL_METHODS} (default: every method the inputs allow, "
                        "without specstop_heuristic); no_spec always runs")
    g.add_argument("--k-grid", default="1,2,3,4,6", help="static K of vLLM's draft model (draft_kK methods)")
    g.add_argument("--engines", type=existing_path, default=None,
                   help="a `specstop export --for vllm` folder: its batch_schedule, confidence_opt, learned and "
                        "heuristic_opt options (by name; the draft replaced by --draft), static_opt's K joins the grid")
    g.add_argument("--schedule", default=None, help="a batch schedule B:K,... for the schedule method (overrides --engines')")
    g.add_argument("--confidence", type=unit_interval, default=0.4,
                   help="specstop_confidence's tau (stop after a draft token whose probability is below it); "
                        "--engines' confidence_opt replaces it")
    g.add_argument("--sl-max", type=positive_int, default=8, help="specstop_confidence's cap on a draft (vLLM's num_speculative_tokens)")
    g.add_argument("--policy", type=existing_dir, default=None, help="a learned specstop export folder (specstop_learned)")
    g.add_argument("--draft-quant", default="none",
                   help="specstop proposer and runner draft weights: a comma list of none, int8, int4 (one method per "
                        "scheme, named METHOD_int4 etc.; specstop.pair.quantize)")
    g.add_argument("--proposer-schedule", default=None,
                   help="B:K,... (as --schedule): a per-batch-size cap on the drafts of every specstop proposer "
                        "and runner method (K = 0: no drafts at those B)")
    g.add_argument("--no-speculation-gate", action="store_true",
                   help="runner methods draft wherever their caps allow (specstop's gate otherwise skips the draft "
                        "at batch sizes where it measures that drafting does not pay)")
    g = p.add_argument_group("timing")
    g.add_argument("--batch-sizes", default="1,2,4,8", help="B: concurrent requests per generate call")
    g.add_argument("--passes", type=positive_int, default=2, help="passes over the methods, the order rotated between them")
    g.add_argument("--repeats", type=positive_int, default=2, help="timed repeats per engine start (each over every B)")
    g.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="warm-up rounds per engine start (each: one call per B)")
    g.add_argument("--warmup-tokens", type=positive_int, default=16, help="tokens per warm-up request")
    g.add_argument("--process", choices=("engine", "pass"), default="engine",
                   help="engine: a fresh vLLM process per engine start; pass: one process runs a pass's engines "
                        "in turn (saves vLLM's import per engine; memory of an earlier engine may linger)")
    g = p.add_argument_group("engine")
    g.add_argument("--vllm-python", type=python_executable, default=None, help="the Python with vLLM (default: $SPECSTOP_VLLM_VENV/bin/python, "
                                                       ".venv-vllm/bin/python, else this Python)")
    g.add_argument("--kv-cache-gib", type=positive_float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE (unless set in the environment)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="vLLM max_model_len (default: the longest prompt + max new tokens + the largest K, rounded up)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="an extra or overriding vllm.LLM argument (repeatable), e.g. enforce_eager=false")
    p.add_argument("--dry-run", action="store_true", help="print the methods and their settings, run nothing")
    p.add_argument("--smoke", action="store_true",
                   help="seconds-scale run on a tiny random pair vLLM can serve (built in a temporary folder unless "
                        "--draft/--target are given): 2 prompts x 8 tokens, B = 1,2, one pass, one process; no_spec, K = 2, "
                        "a schedule (1:2,2:1), confidence (SL_max 4); flags given override these")
    p.add_argument("--out", type=result_file(__file__), default=None,
                   help="the JSON (default vllm_serving.json; the tables go to the same name with .md, logs to NAME_logs/)")
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.out is None and not args.worker:  # the default is checked like a given path
        args.out = str(check_result_path("vllm_serving.json", __file__))
    for name in ("engines", "policy", "out"):  # checked as given; used as paths
        if getattr(args, name) is not None:
            setattr(args, name, Path(getattr(args, name)))
    if args.smoke:
        _smoke_defaults(args, argv)
    return args


def _smoke_defaults(args: argparse.Namespace, argv: list[str]) -> None:
    """--smoke: small settings, unless given on the command line."""
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    small = {"--prompts": ("prompts", 2), "--max-new-tokens": ("max_new_tokens", 8), "--batch-sizes": ("batch_sizes", "1,2"),
             "--k-grid": ("k_grid", "2"), "--passes": ("passes", 1), "--repeats": ("repeats", 1),
             "--warmup-tokens": ("warmup_tokens", 4), "--process": ("process", "pass"), "--dtype": ("dtype", "float32"),
             "--kv-cache-gib": ("kv_cache_gib", 1.0), "--schedule": ("schedule", "1:2,2:1"),
             "--sl-max": ("sl_max", 4), "--draft-quant": ("draft_quant", "none,int4"),
             "--proposer-schedule": ("proposer_schedule", "1:4,2:0")}
    for flag, (dest, value) in small.items():
        if flag not in given:
            setattr(args, dest, value)


def resolve_models(args: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    from specstop.errors import UserError
    from specstop.measure.vllm_cost import pair_folders

    try:
        folders = pair_folders(args.pair, args.draft, args.target, what="")
    except UserError as err:
        raise SystemExit(str(err).strip()) from None
    if folders is not None:
        return folders
    if args.smoke:
        from specstop.testing import save_vllm_tiny_pair

        pair = save_vllm_tiny_pair(tmp / "tiny_pair")
        return str(pair / "draft"), str(pair / "target")
    raise SystemExit("give --draft and --target (or --pair, or --smoke)")


def load_prompts(args: argparse.Namespace, target: str) -> tuple[list[list[int]], list[str]]:
    """The first ``--prompts`` prompts of the held-out split, rendered with the target's chat template: (ids, prompt ids)."""
    from transformers import AutoTokenizer

    from specstop.prompts import PromptSetConfig, load_prompt_set, render_prompt

    tok = AutoTokenizer.from_pretrained(target)
    recs = [r for r in load_prompt_set(PromptSetConfig(source=args.prompt_source, template=args.template,
                                                       split_scheme=args.split_scheme)) if r.split == args.split]
    if len(recs) < args.prompts:
        raise SystemExit(f"the {args.split} split of {args.prompt_source} has {len(recs)} prompts, fewer than --prompts {args.prompts}")
    recs = recs[: args.prompts]
    return [render_prompt(r.text, tok, chat_template=True, prompt_id=r.prompt_id) for r in recs], [r.prompt_id for r in recs]


def _with_draft(option: dict, draft: str, named: str | None) -> tuple[dict | None, dict | None, dict | None]:
    """(speculative_config, additional_config, replaced) of an engines-file option, its draft set to ``draft``."""
    conf = json.loads(json.dumps(option.get("speculative_config"))) if option.get("speculative_config") else None
    extra = json.loads(json.dumps(option.get("additional_config"))) if option.get("additional_config") else None
    old = None
    if conf is not None and conf.get("method") == "custom_class":
        settings = (extra or {}).get("specstop") or {}
        old = settings.get("draft")
        settings["draft"] = draft
    elif conf is not None:
        old = conf.get("model")
        conf["model"] = draft
    replaced = {"from": old, "to": draft} if old is not None and old != draft else None
    if replaced and named and old != named:
        replaced["note"] = f"the file names the draft {named!r}"
    return conf, extra, replaced


def _runner_caps(option: dict | None) -> tuple[list | None, str]:
    """An engines-file option's per-batch caps for specstop's stop in vLLM's runner (the ranges
    ``export --for vllm`` wrote when the option runs there; None otherwise) and the words for a label."""
    conf = (option or {}).get("speculative_config") or {}
    ranges = conf.get("num_speculative_tokens_per_batch_size") if (option or {}).get("worker_cls") else None
    if not ranges:
        return None, ""
    return ranges, FILE_CAPS + ", ".join(f"B {lo}-{hi}: {k}" for lo, hi, k in ranges)


def _engines_file(args: argparse.Namespace) -> dict:
    """``--engines``' vllm.json ({} without --engines)."""
    if args.engines is None:
        return {}
    path = args.engines / "vllm.json" if args.engines.is_dir() else args.engines
    if not path.is_file():
        raise SystemExit(f"--engines {args.engines}: no vllm.json (write it with `specstop export --for vllm`)")
    return json.loads(path.read_text())


def _predicted_b1(option: dict) -> dict:
    """An engines-file option's predicted speedup, by batch size (its tuning is for batch size 1)."""
    speed = (option.get("predicted") or {}).get("speedup")
    return {"1": speed} if speed else {}


def _predicted_static(option: dict, k: int, tuned_k: int | None) -> dict | None:
    """vLLM's draft model at a fixed ``k``: the engines file's price for that K (``predicted_by_k``, where
    vLLM's own runner was timed), else static_opt's own prediction at its K."""
    by_k = option.get("predicted_by_k") or {}
    if str(k) in by_k:
        return {"1": by_k[str(k)]}
    return _predicted_b1(option) if k == tuned_k else None


def _cap_by_batch(method: dict, schedule: list[list[int]]) -> None:
    """``--proposer-schedule`` on one method: vLLM's ``num_speculative_tokens_per_batch_size``, each K at most
    the method's ``num_speculative_tokens``, and its label says so."""
    from specstop.export.engines.vllm import capped_schedule

    conf = method["speculative_config"]
    conf["num_speculative_tokens_per_batch_size"] = capped_schedule(schedule, conf["num_speculative_tokens"])
    # it replaces an engines file's caps, which the label named
    method["label"] = (method["label"].split(FILE_CAPS)[0] + ", per-batch cap (--proposer-schedule) "
                       + ", ".join(f"B {lo}-{hi}: {k}" for lo, hi, k in schedule))


def _proposer_variants(methods: list[dict], args: argparse.Namespace) -> list[dict]:
    """``--proposer-schedule`` applied to every specstop proposer and runner method, then one copy of each proposer
    and runner per ``--draft-quant`` scheme (named ``<method>_<scheme>``; "none" keeps the method itself). Predictions
    stay only on the methods that run the draft the engines file's cost model timed."""
    from specstop.pair.quantize import check_scheme

    schedule = parse_schedule(args.proposer_schedule) if args.proposer_schedule else None
    schemes = [check_scheme(q) for q in args.draft_quant.split(",") if q.strip()] or [None]
    # The engines file's predictions hold for the draft its cost model timed (calibrate-cost --draft-quant).
    priced = ((_engines_file(args).get("cost_model") or {}).get("machine") or {}).get("draft_quant")
    out = []
    for m in methods:
        if schedule and m["name"] in RUNNER_METHODS:  # vLLM passes its per-batch K to the runner as the cap
            _cap_by_batch(m, schedule)
        if args.no_speculation_gate and m["name"] in RUNNER_METHODS:
            m["additional_config"]["specstop"]["speculation_gate"] = False
            m["label"] += ", no speculation gate"
        if m["name"] not in PROPOSER_METHODS + RUNNER_METHODS:
            if priced and m.get("predicted"):
                m["predicted"] = None  # vLLM's own float draft runs these, not the timed quantized one
            out.append(m)
            continue
        if schedule and m["name"] in PROPOSER_METHODS:
            _cap_by_batch(m, schedule)
        for scheme in schemes:
            if scheme is None:
                if priced:
                    m["predicted"] = None
                out.append(m)
                continue
            v = json.loads(json.dumps(m))
            v["name"], v["label"] = f"{m['name']}_{scheme}", f"{m['label']}, {scheme} draft"
            if scheme != priced:
                v["predicted"] = None
            v["additional_config"]["specstop"]["draft_quant"] = scheme
            if m["name"] in ("specstop_learned", "runner_learned"):
                v["additional_config"]["specstop"]["allow_draft_mismatch"] = True
            out.append(v)
    return out


def build_methods(args: argparse.Namespace, draft: str) -> list[dict]:
    """Every method to run: ``{"name", "label", "speculative_config", "additional_config", "source"}``."""
    from specstop.export.engines import vllm_proposer_config, vllm_runner_config
    from specstop.policy import PolicySpec

    methods = [{"name": "no_spec", "label": "vLLM, no speculation", "speculative_config": None, "source": "baseline"}]
    engines, engine_draft = {}, None
    if args.engines is not None:
        engines = _engines_file(args)
        engine_draft = engines.get("draft")
    options = engines.get("options") or {}
    user_grid = _parse_ints(args.k_grid, "--k-grid")
    tuned_k = (options.get("static_opt") or {}).get("policy", {}).get("k")
    for k in sorted(set(user_grid) | ({int(tuned_k)} if tuned_k else set())):
        note = []
        if k == DEFAULT_K:
            note.append("vLLM's usual default")
        if k == tuned_k:
            note.append("specstop's tuned static_opt")
        methods.append({"name": f"draft_k{k}", "label": f"vLLM draft model, K = {k}" + (f" ({', '.join(note)})" if note else ""),
                        "speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": k},
                        "source": "--k-grid" if k in user_grid else "--engines static_opt",
                        "predicted": _predicted_static(options.get("static_opt") or {}, k, tuned_k)})
    sched = None
    if args.schedule:
        ranges = parse_schedule(args.schedule)
        k_max = max(r[2] for r in ranges)
        if k_max == 0:
            raise SystemExit("--schedule: K is 0 at every batch size; that is no_spec")
        sched = {"speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": k_max,
                                        "num_speculative_tokens_per_batch_size": ranges}, "source": "--schedule"}
    elif engines.get("batch_schedule"):
        conf, _, replaced = _with_draft(engines["batch_schedule"], draft, engine_draft)
        if conf is None:
            print(f"{PROGRESS} --engines' batch schedule runs no speculation at any batch size: no schedule method")
        else:
            sched = {"speculative_config": conf, "source": "--engines batch_schedule", "draft_replaced": replaced,
                     "predicted": {str(r["batch_size"]): r.get("predicted_speedup")
                                   for r in engines["batch_schedule"].get("by_batch_size", [])}}
    if sched:
        ranges = sched["speculative_config"]["num_speculative_tokens_per_batch_size"]
        methods.append({"name": "schedule", "label": "vLLM draft model, per-batch schedule "
                        + ", ".join(f"B {lo}-{hi}: K {k}" for lo, hi, k in ranges), **sched})
    conf_opt = options.get("confidence_opt")
    if conf_opt:
        _, _, replaced = _with_draft(conf_opt, draft, engine_draft)
        pol = conf_opt.get("policy") or {}
        spec = PolicySpec.from_dict(pol)
        what = f"confidence tau = {spec.threshold:.4g}, SL_max {spec.cap} (tuned confidence_opt)"
        origin = {"source": "--engines confidence_opt", "draft_replaced": replaced, "predicted": _predicted_b1(conf_opt)}
    else:
        spec = PolicySpec(kind="confidence", threshold=float(args.confidence), sl_max=int(args.sl_max))
        what = f"confidence tau = {args.confidence:g}, SL_max {args.sl_max}"
        origin = {"source": "--confidence"}
    conf, extra = vllm_proposer_config(draft, spec.to_dict(), spec.cap)
    methods.append({"name": "specstop_confidence", "label": f"specstop proposer, {what}", "speculative_config": conf,
                    "additional_config": extra, **origin})
    caps, caps_words = _runner_caps(conf_opt)
    methods.append({"name": "runner_confidence", "label": f"specstop stop in vLLM's draft runner, {what}{caps_words}",
                    **vllm_runner_config(draft, spec.to_dict(), spec.cap, schedule=caps), **origin})
    learned = [(n, o) for n, o in options.items() if (o.get("policy") or {}).get("kind") == "predictor"]
    export, origin, caps, caps_words = None, {}, None, ""
    if args.policy is not None:
        export, origin = args.policy.expanduser().resolve(), {"source": "--policy"}
    elif learned:
        name, opt = learned[0]
        caps, caps_words = _runner_caps(opt)
        export = Path(opt["additional_config"]["specstop"]["policy"])
        origin = {"source": f"--engines {name}", "draft_replaced": _with_draft(opt, draft, engine_draft)[2],
                  "predicted": _predicted_b1(opt)}
    if export is not None:
        from specstop.export.runtime import StoppingPolicy

        spec = StoppingPolicy.from_pretrained(export).spec
        conf, extra = vllm_proposer_config(draft, str(export), spec.cap)
        methods.append({"name": "specstop_learned", "label": f"specstop proposer, learned {spec.label} "
                        f"(SL_max {spec.cap})", "speculative_config": conf, "additional_config": extra, **origin})
        methods.append({"name": "runner_learned", "label": f"specstop stop in vLLM's draft runner, learned "
                        f"{spec.label} (SL_max {spec.cap}){caps_words}",
                        **vllm_runner_config(draft, str(export), spec.cap, schedule=caps), **origin})
    if options.get("heuristic_opt"):
        conf, extra, replaced = _with_draft(options["heuristic_opt"], draft, engine_draft)
        pol = options["heuristic_opt"].get("policy") or {}
        methods.append({"name": "specstop_heuristic", "label": f"specstop proposer, heuristic start {pol.get('start')}, "
                        f"SL_max {pol.get('sl_max')} (tuned heuristic_opt)", "speculative_config": conf,
                        "additional_config": extra, "source": "--engines heuristic_opt", "draft_replaced": replaced})
    methods = _proposer_variants(methods, args)
    available = [m["name"] for m in methods]
    if args.methods:
        wanted = [w.strip() for w in args.methods.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in available]
        if unknown:
            raise SystemExit(f"--methods: {unknown} not available here; available: {available}")
        keep = {"no_spec", *wanted}
    else:
        keep = set(available) - {"specstop_heuristic"}
    return [m for m in methods if m["name"] in keep]


def host_info() -> dict:
    info: dict = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        info["affinity"] = sorted(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
        info["cpu_model"] = fields.get("Model name")
        info["cpu_flags"] = fields.get("Flags", "").split()
        info["lscpu"] = {k: fields[k] for k in ("Architecture", "CPU(s)", "Thread(s) per core", "Core(s) per socket",
                                                "Vendor ID", "Hypervisor vendor", "L2 cache", "L3 cache") if k in fields}
    except (OSError, subprocess.SubprocessError):
        from specstop.pair.hardware import cpu_flags, cpu_model_name

        info["cpu_model"], info["cpu_flags"] = cpu_model_name(), sorted(cpu_flags())
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def _host_probe(when: str) -> dict:
    """The host's speed now (:func:`specstop.measure.host_probe.probe`, timed here while no engine runs), said."""
    figures = {"when": when, **probe()}
    print(f"{PROGRESS} host probe {when}: stream {figures['stream_ms']:.1f} ms, gemm {figures['gemm_ms']:.1f} ms",
          flush=True)
    return figures


def run_worker(python: str, job: dict, workdir: Path, tag: str, env: dict) -> tuple[dict | None, str | None, float]:
    """One vLLM process running ``job``; returns (its result, an error, wall seconds). Its log goes to workdir/tag.log."""
    job_path, out_path, log_path = workdir / f"{tag}.job.json", workdir / f"{tag}.out.json", workdir / f"{tag}.log"
    job_path.write_text(json.dumps(job))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", str(job_path), str(out_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(PROGRESS):
                print(line.rstrip(), flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0 or not out_path.is_file():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        return None, f"the vLLM process exited with {rc} (log: {log_path}):\n{tail}", wall
    result = json.loads(out_path.read_text())
    out_path.unlink()
    job_path.unlink()
    return result, None, wall


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _decode_tok_s(runs: list[dict]) -> list[float]:
    """Decode-phase tok/s of each run (tokens after the first, from the last first token on); [] where vLLM
    gave no per-request timestamps."""
    return [r["decode"]["tokens"] / r["decode"]["seconds"] for r in runs
            if (r.get("decode") or {}).get("seconds", 0) > 0]


def _decode_row(runs: list[dict], base: float | None) -> dict:
    tps = _decode_tok_s(runs)
    if not tps:
        return {}
    med = statistics.median(tps)
    return {"decode_tok_s": {"median": med, "min": min(tps), "max": max(tps), "n": len(tps)},
            "decode_speedup": med / base if base else None}


def _steps_row(runs: list[dict], b: int) -> dict | None:
    """The engine's decode steps over ``runs`` at batch size ``b``: the median step with all ``b`` rows
    (what a prediction for ``b`` rows prices), how many there were, and the share of decode time spent
    in steps with fewer rows (requests that finished early); None without step timings."""
    tables = [r["steps"] for r in runs if r.get("steps")]
    if not tables:
        return None
    full = [t[str(b)]["median_s"] for t in tables if str(b) in t]
    decode_s = sum(v["seconds"] for t in tables for key, v in t.items() if key != "prefill")
    partial_s = sum(v["seconds"] for t in tables for key, v in t.items() if key not in ("prefill", str(b)))
    return {"full_median_s": statistics.median(full) if full else None,
            "full_steps": sum(t[str(b)]["n"] for t in tables if str(b) in t),
            "partial_steps": sum(v["n"] for t in tables for key, v in t.items() if key not in ("prefill", str(b))),
            "partial_share": partial_s / decode_s if decode_s else None}


def summarize(record: dict, tokenizer) -> dict:
    """Per method and B: tok/s statistics, speedup over no_spec, acceptance, and the output comparison."""
    from specstop.decode.vllm_proposer import SPEC_METRICS

    sizes = record["settings"]["batch_sizes"]
    by = {}
    for run in record["runs"]:
        by.setdefault((run["method"], run["batch_size"]), []).append(run)
    ref_pass = record.get("reference") or {}
    summary: dict = {}
    base_med, base_decode = {}, {}
    for b in sizes:
        runs = by.get(("no_spec", b), [])
        if runs:
            base_med[b] = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
            if decode := _decode_tok_s(runs):
                base_decode[b] = statistics.median(decode)
    for m in record["methods"]:
        name = m["name"]
        rows = {}
        for b in sizes:
            runs = by.get((name, b), [])
            if not runs:
                continue
            tps = [r["tokens"] / r["wall_s"] for r in runs]
            q1, q3 = _quartiles(tps)
            med = statistics.median(tps)
            spec = {k: sum(r["spec"][k] for r in runs) for k in SPEC_METRICS.values()}
            predicted = (m.get("predicted") or {}).get(str(b))
            row = {"tok_s": {"median": med, "min": min(tps), "max": max(tps), "q1": q1, "q3": q3, "n": len(tps),
                             "all": tps},
                   "speedup": med / base_med[b] if b in base_med else None,
                   "predicted_speedup": predicted,
                   **_decode_row(runs, base_decode.get(b)),
                   "tokens": [r["tokens"] for r in runs],
                   "steps": _steps_row(runs, b),
                   "spec": spec,
                   "accepted_per_draft": spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else None,
                   "draft_len": spec["draft_tokens"] / spec["drafts"] if spec["drafts"] else None,
                   "acceptance": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None}
            base_runs = by.get(("no_spec", b), [])
            if base_runs and not record["settings"].get("temperature"):  # sampled outputs differ by design
                ref = base_runs[0]["outputs"]
                n = len(ref)
                differing = []
                for i in range(n):
                    outs = [r["outputs"][i] for r in runs]
                    bad = next((o for o in outs if o != ref[i]), None)
                    if bad is None:
                        continue
                    pos = _first_difference(ref[i], bad)
                    entry = {"prompt": i, "prompt_id": record["settings"]["prompt_ids"][i], "position": pos,
                             "runs_differing": sum(o != ref[i] for o in outs), "runs": len(outs),
                             "no_spec_tokens": ref[i][pos:pos + 8], "method_tokens": bad[pos:pos + 8]}
                    if tokenizer is not None:
                        entry["context"] = tokenizer.decode(ref[i][max(0, pos - 12):pos])
                        entry["no_spec_text"] = tokenizer.decode(ref[i][pos:pos + 8])
                        entry["method_text"] = tokenizer.decode(bad[pos:pos + 8])
                    refb = ref_pass.get(str(b))
                    if refb and refb["outputs"][i][:pos + 1] == ref[i][:pos + 1] and pos < len(refb["top2"][i]):
                        top = refb["top2"][i][pos]
                        if len(top) == 2:
                            entry["target_top2"] = top
                            entry["target_top2_logit_gap"] = top[0][1] - top[1][1]
                    differing.append(entry)
                row["identical"] = n - len(differing)
                row["prompts"] = n
                row["differing"] = differing
            rows[str(b)] = row
        summary[name] = rows
    return summary


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _method_by_b(record: dict, cell) -> list[str]:
    """A table with a row per method and a column per batch size: ``cell(method, b, summary row or {})``."""
    sizes = record["settings"]["batch_sizes"]
    lines = ["| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for m in record["methods"]:
        row_of = record["summary"].get(m["name"], {})
        lines.append(f"| {m['name']} | " + " | ".join(cell(m, b, row_of.get(str(b)) or {}) for b in sizes) + " |")
    return lines


def runner_k(method: dict, b: int) -> int | None:
    """The K vLLM's own runner drafts at ``b`` rows for ``method`` (0 without speculation); None for
    specstop's proposer and specstop's stop in vLLM's runner, whose drafts vary."""
    conf = method.get("speculative_config")
    if conf is None:
        return 0
    if conf.get("method") == "custom_class" or method.get("worker_cls"):
        return None
    for lo, hi, k in conf.get("num_speculative_tokens_per_batch_size") or []:
        if lo <= b <= hi:
            return int(k)
    return int(conf.get("num_speculative_tokens", 0))


def _steps_markdown(record: dict) -> list[str]:
    """The engine's own decode steps per method and B, beside the cost model's for vLLM's runner."""
    summary, sizes = record["summary"], record["settings"]["batch_sizes"]
    if not any((summary.get(m["name"], {}).get(str(b)) or {}).get("steps") for m in record["methods"] for b in sizes):
        return []
    calibrated = record.get("runner_steps") or {}

    def cell(m: dict, b: int, row: dict) -> str:
        st = row.get("steps")
        if not st or st["full_median_s"] is None:
            return "-"
        k = runner_k(m, b)
        cal = ((calibrated.get(str(b)) or {}).get(str(k)) or {}).get("step_s") if k is not None else None
        return (f"{st['full_median_s'] * 1e3:.0f} ({st['full_steps']})" + (f" [{cal * 1e3:.0f}]" if cal else "")
                + f", {_fmt(st['partial_share'], '.0%')}")

    lines = ["", "Decode steps as the engine timed them (each engine step on its own): the median step in which "
             "all B rows decoded, in ms, with the number of such steps; in brackets the cost model's step for "
             "vLLM's runner at that B and K where calibrate-cost timed it; then the share of decode time spent "
             "in steps with fewer rows (requests that finished early):", ""]
    lines += _method_by_b(record, cell)
    return lines


def _decoding_words(settings: dict) -> str:
    """``greedy`` or ``sampled at T=0.7, top-p 0.9 (a seed per request)``: how the requests decoded."""
    from specstop.export.by_decoding import describe

    decoding = {"temperature": settings.get("temperature") or 0.0, "top_p": settings.get("top_p", 1.0)}
    words = describe(decoding)
    return words if words == "greedy" else f"sampled at {words} (a seed per request)"


def _probe_markdown(host_probe: dict | None) -> list[str]:
    """The host probes of a run, and a warning where they spread past the limit."""
    if not host_probe or not host_probe.get("probes"):
        return []
    probes = host_probe["probes"]
    moved = drift_line(probes, host_probe.get("limit", DRIFT))
    lines = ["", "## Host speed", "",
             "A fixed workload timed in the benchmark's process while no engine ran "
             "(`specstop.measure.host_probe`: a one-row bf16 product streaming 256 MiB of weights, and a 1024-row one), ms:",
             "", "| when | stream | gemm |", "|---|---:|---:|"]
    lines += [f"| {p['when']} | {p['stream_ms']:.1f} | {p['gemm_ms']:.1f} |" for p in probes]
    lines += ["", f"**Not comparable:** {moved}." if moved else
              f"The probes stayed within {100 * host_probe.get('limit', DRIFT):.0f}% of each other."]
    return lines


def markdown(record: dict) -> str:
    s, summary, sizes = record["settings"], record["summary"], record["settings"]["batch_sizes"]
    host, versions = record["host"], record.get("versions") or {}
    flags = " ".join(f for f in host.get("cpu_flags", []) if f.startswith(("avx", "amx", "fma", "f16c")))
    lines = [
        "# vLLM serving benchmark",
        "",
        f"- target `{s['target']}`, draft `{s['draft']}`, dtype {s['dtype']}",
        f"- {len(s['prompt_ids'])} held-out prompts ({s['prompt_source']}, {s['split']} split: {', '.join(s['prompt_ids'])}), "
        f"{s['max_new_tokens']} new tokens each, {_decoding_words(s)}{', EOS ignored' if s['ignore_eos'] else ', stop at EOS'}",
        f"- B = {', '.join(map(str, sizes))}: B prompts per `LLM.generate` call, every prompt once per B and repeat",
        f"- {record['design']}",
        f"- CPU: {host.get('cpu_model')}, {len(host.get('affinity', [])) or host.get('cpus')} CPUs used, "
        f"{host.get('mem_gib')} GiB; flags: {flags}",
        f"- vLLM {versions.get('vllm')}, torch {versions.get('torch')}, transformers {versions.get('transformers')}",
        "",
        "tok/s = generated tokens / wall time of the generate calls (prefill included); median over "
        f"{s['passes']} pass(es) x {s['repeats']} repeat(s), spread min-max and IQR; speedup = median / no_spec's median "
        "at the same B; identical = prompts whose greedy output equals no_spec's at the same B in every run.",
        "",
        "| method | B | tok/s (median) | min-max | IQR | speedup | identical | accepted/draft | draft len |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {m["name"]: m["label"] for m in record["methods"]}
    for m in record["methods"]:
        name = m["name"]
        for b in sizes:
            row = summary.get(name, {}).get(str(b))
            if row is None:
                lines.append(f"| {name} | {b} | failed | | | | | | |")
                continue
            t = row["tok_s"]
            ident = f"{row['identical']}/{row['prompts']}" if "identical" in row else "-"
            lines.append(f"| {name} | {b} | {t['median']:.2f} | {t['min']:.2f}-{t['max']:.2f} | {t['q1']:.2f}-{t['q3']:.2f} "
                         f"| {_fmt(row['speedup'], '.3f')} | {ident} | {_fmt(row['accepted_per_draft'])} | {_fmt(row['draft_len'])} |")
    lines += ["", "Speedup over no speculation (median tok/s ratio):", ""]
    lines += _method_by_b(record, lambda m, b, row: _fmt(row.get("speedup"), ".3f"))
    predicted = [(m["name"], b, summary[m["name"]][str(b)]) for m in record["methods"] for b in sizes
                 if (summary.get(m["name"], {}).get(str(b)) or {}).get("predicted_speedup")]
    decode = [(m["name"], b, summary[m["name"]][str(b)]) for m in record["methods"] for b in sizes
              if (summary.get(m["name"], {}).get(str(b)) or {}).get("decode_speedup")]
    if decode:
        lines += ["", "The decode phase alone (generated tokens after each request's first, timed from the last first "
                  "token to the last token, vLLM's own per-request timestamps; prefill left out): median tok/s and "
                  "speedup over no_spec's decode phase:", ""]
        lines += _method_by_b(record, lambda m, b, row: f"{row['decode_tok_s']['median']:.2f} "
                              f"({_fmt(row.get('decode_speedup'), '.3f')}x)" if row.get("decode_tok_s") else "-")
    if predicted:
        lines += ["", "Predicted (the engines file's replay, priced by its cost model; the decode phase, since "
                  "prefill is not priced) against measured:", "",
                  "| method | B | predicted | measured, decode phase | decode / predicted | measured, with prefill |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, b, row in predicted:
            p, got, dec = row["predicted_speedup"], row["speedup"], row.get("decode_speedup")
            lines.append(f"| {name} | {b} | {p:.3f} | {_fmt(dec, '.3f')} | {_fmt(dec / p if dec else None, '.3f')} "
                         f"| {_fmt(got, '.3f')} |")
        if record.get("priced_by"):
            lines.append(f"\nPriced by: {record['priced_by']}")
    lines += _steps_markdown(record)
    if record.get("best_static_k"):
        lines += ["", "Best static K per B (vLLM draft model, highest median tok/s): "
                  + ", ".join(f"B={b}: K={v['k']} ({v['speedup']:.3f}x)" for b, v in record["best_static_k"].items())]
    lines += ["", "Methods:", ""] + [f"- `{n}`: {lab}" for n, lab in labels.items()]
    diffs = [(m["name"], b, d) for m in record["methods"] for b in sizes
             for d in (summary.get(m["name"], {}).get(str(b)) or {}).get("differing", [])]
    lines += ["", "## Outputs that differ from no_spec", ""]
    if record["settings"].get("temperature"):
        lines.append(f"Sampled at T = {record['settings']['temperature']:g}, top-p {record['settings']['top_p']:g}: "
                     "outputs are not compared token for token (sampling differs by design); that speculative "
                     "sampling keeps the target's law is checked by chi-square in tests/test_vllm_engine.py.")
    elif not diffs:
        lines.append("None: every method's greedy output equals vLLM's without speculation at every B, in every run.")
    for name, b, d in diffs:
        gap = f", target top-2 logit gap {d['target_top2_logit_gap']:.4f}" if "target_top2_logit_gap" in d else ""
        lines.append(f"- `{name}` B={b} prompt {d['prompt_id']}: first difference at token {d['position']} "
                     f"({d['runs_differing']}/{d['runs']} runs){gap}; after {d.get('context', '')!r}: no_spec "
                     f"{d.get('no_spec_text', d['no_spec_tokens'])!r} vs {d.get('method_text', d['method_tokens'])!r}")
    base_diff = record.get("no_spec_across_b") or []
    if base_diff:
        lines += ["", "no_spec itself differs between batch sizes (batched kernels): "
                  + "; ".join(f"B={d['batch_size']} prompt {d['prompt_id']} at token {d['position']}" for d in base_diff)]
    if record.get("engine_costs"):
        lines += ["", "## Costs inside the engine, as specstop's proposer timed them", "",
                  "Seconds per drafted token at B rows (catch-up feeds and the policy included), and seconds "
                  "from one draft call to the next where every row verified L tokens (the target's forward, "
                  "sampling and vLLM's step), medians with sample counts:", ""]
        for name, entries in record["engine_costs"].items():
            for e in entries:
                draft = ", ".join(f"B={b}: {v * 1e3:.1f} ms ({e['samples']['draft'][b]})" for b, v in e["draft_per_token"].items())
                target = ", ".join(f"{k}: {v * 1e3:.0f} ms ({e['samples']['target'][k]})" for k, v in e["target_step"].items())
                lines.append(f"- `{name}` pass {e['pass']}: draft per token {draft or '-'}; target step {target or '-'}")
    if record.get("runner_stats"):
        lines += ["", "## specstop's stop in vLLM's draft runner", "",
                  "Per engine start: batched draft rounds, draft forwards, rows per draft length, the policy each "
                  "decoding setting ran, live re-pricing's switches, steps that skipped the draft (tokens fed "
                  "again to catch its cache up) and the speculation gate per batch size (ms per token drafting / "
                  "skipping, rounds of each, rounds held back by the draft's prefill or catch-up) with its price of a "
                  "token fed to the draft:", ""]
        for name, entries in record["runner_stats"].items():
            for e in entries:
                lengths = ", ".join(f"{k}: {v}" for k, v in sorted(e["lengths"].items(), key=lambda kv: int(kv[0])))
                switches = sum(len(r.get("switches", [])) for r in (e.get("live") or {}).values())
                kv = e.get("draft_kv") or {}
                gate = e.get("gate") or {}
                gate = "; ".join([f"B={b}: {g['draft_ms_per_token']} / {g['skip_ms_per_token']} ms, "
                                  f"{g['rounds_drafting']} / {g['rounds_skipping']}, held {g['rounds_held']}"
                                  for b, g in gate.get("by_batch", {}).items()]
                                 + ([f"feed {gate['feed_ms_per_token']} ms per token"] if gate else []))
                quant = e.get("draft_quant")
                quant = (f"; {quant['scheme']} draft: {quant['layers']} layers packed, blocks from "
                         f"{quant['prefill_rows']} rows on vLLM's float GEMM (timed ms packed / float: "
                         f"{quant['timed_ms']})" if quant else "")
                lines.append(f"- `{name}` pass {e['pass']}: {e['rounds']} rounds, {e['steps']} draft forwards, "
                             f"lengths {{{lengths}}}, settings {e['settings']}, {switches} live switch(es), "
                             f"{kv.get('skipped_steps', 0)} skipped steps ({kv.get('caught_up_tokens', 0)} tokens "
                             f"caught up), gate {gate or 'off'}{quant}")
    if record.get("errors"):
        lines += ["", "## Failed", ""] + [f"- `{n}` (pass {e['pass']}): {e['error'].strip().splitlines()[-1]}"
                                           for n, errs in record["errors"].items() for e in errs]
    lines += _probe_markdown(record.get("host_probe"))
    lines += ["", "Engine starts (s): " + ", ".join(f"{e['method']} {e['start_s']:.1f}" for e in record["engine_starts"]
                                                    if e.get("start_s") is not None)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(worker(job)))
        return 0
    sizes = _parse_ints(args.batch_sizes, "--batch-sizes")
    out = args.out.expanduser()
    logs = out.with_name(out.stem + "_logs")
    tmp_holder = tempfile.TemporaryDirectory(prefix="vllm_serving_")
    tmp = Path(tmp_holder.name)
    try:
        draft, target = resolve_models(args, tmp)
        methods = build_methods(args, draft)
        prompts, prompt_ids = load_prompts(args, target)
        if len(prompts) % max(sizes):
            print(f"{PROGRESS} note: {len(prompts)} prompts is not a multiple of B = {max(sizes)}: the last batch is smaller")
        k_max = max((m["speculative_config"] or {}).get("num_speculative_tokens", 0) for m in methods)
        max_len = args.max_model_len or -(-(max(map(len, prompts)) + args.max_new_tokens + k_max + 16) // 128) * 128
        engine = {"dtype": args.dtype, "enforce_eager": True, "compilation_config": {"mode": 0}, "max_model_len": max_len,
                  "max_num_seqs": max(sizes), "seed": 0, "distributed_executor_backend": "uni",
                  "enable_prefix_caching": False}
        for item in args.engine_arg:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--engine-arg takes KEY=JSON, got {item!r}")
            try:
                engine[key] = json.loads(value)
            except json.JSONDecodeError:
                engine[key] = value
        names = [m["name"] for m in methods]
        orders = [_rotated(names, p * len(names) // args.passes) for p in range(args.passes)]
        design = (f"{args.passes} pass(es) over the methods in rotated order ({' | '.join(', '.join(o) for o in orders)}); "
                  f"per pass each method starts its engine once ({'a fresh vLLM process per engine' if args.process == 'engine' else 'one vLLM process per pass'}), "
                  f"runs {args.warmup} warm-up round(s) ({args.warmup_tokens} tokens, one call per B), then {args.repeats} "
                  "timed repeat(s), each over every B in a rotated order; prefix caching off")
        print(f"{PROGRESS} {len(methods)} methods x {args.passes} pass(es), B = {sizes}, {len(prompts)} prompts x "
              f"{args.max_new_tokens} tokens; max_model_len {max_len}")
        for m in methods:
            print(f"{PROGRESS}   {m['name']}: {m['label']}")
        if args.dry_run:
            print(json.dumps([{k: m.get(k) for k in ("name", "speculative_config", "additional_config")} for m in methods],
                             indent=1))
            return 0
        from specstop.measure.vllm_cost import vllm_env, vllm_python

        python = vllm_python(args.vllm_python)
        env = vllm_env(args.kv_cache_gib)
        logs.mkdir(parents=True, exist_ok=True)
        by_name = {m["name"]: m for m in methods}
        base = {"target": target, "engine": engine, "prompts": prompts, "batch_sizes": sizes, "max_tokens": args.max_new_tokens,
                "temperature": args.temperature, "top_p": args.top_p,
                "ignore_eos": args.ignore_eos, "warmup": args.warmup, "warmup_tokens": args.warmup_tokens,
                "repeats": args.repeats}
        runs, starts, errors, versions, reference, probes = [], [], {}, None, None, []
        engine_costs: dict[str, list] = {}
        runner_stats: dict[str, list] = {}
        t_all = time.perf_counter()
        for p, order in enumerate(orders):
            groups = [[n] for n in order] if args.process == "engine" else [order]
            for gi, group in enumerate(groups):
                job = {**base, "b_shift": p * args.repeats,
                       "methods": [{"name": n, "speculative_config": by_name[n]["speculative_config"],
                                    "additional_config": by_name[n].get("additional_config"),
                                    **{k: by_name[n].get(k) for k in METHOD_ENGINE_ARGS},
                                    "reference_logprobs": n == "no_spec" and p == 0} for n in group]}
                print(f"{PROGRESS} pass {p + 1}/{args.passes}: {', '.join(group)}", flush=True)
                probes.append(_host_probe(f"before pass {p + 1} {'+'.join(group)}"))
                result, err, wall = run_worker(python, job, logs, f"pass{p + 1}_{gi:02d}_{'+'.join(group)}"[:120], env)
                if err:
                    for n in group:
                        errors.setdefault(n, []).append({"pass": p + 1, "error": err})
                    print(f"{PROGRESS} {err}", flush=True)
                    continue
                versions = versions or result["versions"]
                for n in group:
                    res = result["methods"][n]
                    starts.append({"method": n, "pass": p + 1, "start_s": res.get("start_s"), "warmup_s": res.get("warmup_s"),
                                   "shutdown_s": res.get("shutdown_s"), "process_s": wall if len(group) == 1 else None})
                    if res.get("error"):
                        errors.setdefault(n, []).append({"pass": p + 1, "error": res["error"]})
                        print(f"{PROGRESS} {n} failed: {res['error'].strip().splitlines()[-1]}", flush=True)
                    if res.get("reference"):
                        reference = res["reference"]
                    if res.get("engine_costs"):
                        engine_costs.setdefault(n, []).append({"pass": p + 1, **res["engine_costs"]})
                    if res.get("runner_stats"):
                        runner_stats.setdefault(n, []).append({"pass": p + 1, **res["runner_stats"]})
                    for r in res["runs"]:
                        runs.append({"method": n, "pass": p + 1, **r, "tok_s": r["tokens"] / max(r["wall_s"], 1e-9)})
        probes.append(_host_probe("after the last engine"))
        record = {
            "benchmark": "vllm_serving",
            "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
            "design": design,
            "host": host_info(),
            "versions": versions,
            "vllm_python": python,
            "env": {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k in ("LD_PRELOAD", "OMP_NUM_THREADS")},
            "settings": {"draft": draft, "target": target, "dtype": args.dtype, "prompt_source": args.prompt_source,
                         "template": args.template, "split": args.split, "prompt_ids": prompt_ids,
                         "prompt_lengths": [len(x) for x in prompts], "max_new_tokens": args.max_new_tokens,
                         "ignore_eos": args.ignore_eos, "temperature": args.temperature, "top_p": args.top_p,
                         "batch_sizes": sizes, "passes": args.passes, "repeats": args.repeats,
                         "warmup": args.warmup, "warmup_tokens": args.warmup_tokens, "process": args.process,
                         "engine": engine, "method_orders": orders, "smoke": args.smoke},
            "methods": methods,
            "engine_starts": starts,
            "engine_costs": engine_costs,
            "runner_stats": runner_stats,
            "priced_by": _engines_file(args).get("priced_by"),
            "runner_steps": ((((_engines_file(args).get("cost_model") or {}).get("fit") or {}).get("vllm_runner") or {})
                             .get("step_s")),
            "runs": runs,
            "host_probe": {"probes": probes, "drift": drift(probes), "limit": DRIFT},
            "reference": reference,
            "errors": errors,
            "total_s": time.perf_counter() - t_all,
        }
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target)
        except Exception:  # noqa: BLE001 - the texts are a convenience; positions and ids are kept regardless
            tokenizer = None
        record["summary"] = summarize(record, tokenizer)
        best = {}
        for b in sizes:
            cands = [(row["tok_s"]["median"], int(name[len("draft_k"):]), row.get("speedup"))
                     for name, rows in record["summary"].items() if name.startswith("draft_k")
                     for bb, row in rows.items() if bb == str(b)]
            if cands:
                med, k, speedup = max(cands)
                best[str(b)] = {"k": k, "tok_s": med, "speedup": speedup}
        record["best_static_k"] = best
        base_runs = [r for r in runs if r["method"] == "no_spec" and r["repeat"] == 0 and r["pass"] == 1]
        first = {r["batch_size"]: r["outputs"] for r in base_runs}
        across = []
        if sizes[0] in first:
            for b, outs in first.items():
                for i, (a, o) in enumerate(zip(first[sizes[0]], outs)):
                    if a != o:
                        across.append({"batch_size": b, "vs_batch_size": sizes[0], "prompt_id": prompt_ids[i],
                                       "position": _first_difference(a, o)})
        record["no_spec_across_b"] = across
        # Raw outputs: no_spec's once per B; every method's runs keep their outputs only where they differ.
        record["no_spec_outputs"] = {str(b): o for b, o in first.items()}
        for r in runs:
            ref = first.get(r["batch_size"])
            r["outputs_identical"] = r["outputs"] == ref if ref is not None else None
            if r["outputs_identical"]:
                del r["outputs"]
        from specstop.outputs import atomic_write_text
        from specstop.script_args import write_result

        write_result(out, record, __file__, indent=1)
        md = atomic_write_text(out.with_suffix(".md"), markdown(record))
        print(md.read_text())
        print(f"{PROGRESS} wrote {out} and {md} (logs: {logs}); {record['total_s']:.0f} s in all")
        moved = drift_line(probes)
        if moved:
            print(f"{PROGRESS} warning: {moved}", flush=True)
        return 1 if errors else 0
    finally:
        tmp_holder.cleanup()


if __name__ == "__main__":
    from specstop.script_main import run_main

    run_main(main, __file__)
