"""Run vLLM's offline engine on token-id prompts, once per speculative setting: ``python _vllm_runner.py JOB OUT``.

Started by tests/test_vllm_engine.py with ``.venv-vllm/bin/python`` (vLLM lives in its own venv).
JOB (JSON): ``{"target", "prompts": [[ids]], "max_tokens", "batched_max_tokens": [per prompt] (optional: the
batched pass's own lengths, so that its requests finish at different steps), "engine": {LLM kwargs}, "runs": [{"name",
"speculative_config", "additional_config", "worker_cls", "async_scheduling", "command"}], "sampled": {...}}``;
a run's ``command`` (a ``vllm serve`` line) is parsed by vLLM's own serve parser and reported as
``parsed_command`` (model, speculative and additional config, worker class, async scheduling). Every run
starts one engine (in this process: the
caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), decodes greedily the prompts one at a time (batch
size 1) and then all at once (batch size len(prompts)), and shuts the engine down. With ``sampled``
(``{"prompt", "max_tokens", "groups": [{"n", "temperature", "top_p"}]}``) it then decodes every group's ``n``
sampled requests of one prompt (request i of a group with seed i), all in one call. OUT (JSON):
``{name: {"batch1": [[ids]], "batched": [[ids]], "spec": {"batch1": counters, "batched": counters},
"samples": [[[ids]] per group], "runner": stats, "runner_batch1": stats, "start_s", "generate_s", "error"}}``;
spec counters are vLLM's own (drafts, draft tokens, accepted tokens) for that pass; ``runner``: specstop's
draft runner's counters (rows per draft length and per reason their draft ended, the policy each decoding
setting ran; ``runner_batch1``: the same after the batch-size-1 pass), ``draft_kv``: steps that
skipped the draft and tokens fed again to catch its cache up, ``gate``: the speculation gate's record,
``draft_quant``: the quantized draft's layers and timed crossover, or None).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from specstop.decode.vllm_proposer import spec_counters
from specstop.measure.vllm_cost import shutdown_engine


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def parse_serve_command(command: str) -> dict:
    """What ``vllm serve`` makes of a command line: its model and the speculative/additional config
    (vLLM's own serve parser and EngineArgs; nothing is started)."""
    import shlex

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(command)
    assert argv[:2] == ["vllm", "serve"], argv
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    args.model = args.model_tag or args.model
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return {"model": engine_args.model, "speculative_config": engine_args.speculative_config,
            "additional_config": engine_args.additional_config or None,
            "worker_cls": None if engine_args.worker_cls == "auto" else engine_args.worker_cls,
            "async_scheduling": engine_args.async_scheduling}


def sample(llm, job: dict) -> list[list]:
    """``job["sampled"]``'s requests, every group's in one call (request i of a group with seed i): per group,
    its requests' token ids."""
    from vllm import SamplingParams

    s = job["sampled"]
    prompt = {"prompt_token_ids": list(s["prompt"])}
    params = [SamplingParams(temperature=g["temperature"], top_p=g.get("top_p", 1.0), max_tokens=s["max_tokens"],
                             seed=i, ignore_eos=True) for g in s["groups"] for i in range(g["n"])]
    ids = [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    out, at = [], 0
    for g in s["groups"]:
        out.append(ids[at: at + g["n"]])
        at += g["n"]
    return out


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    lengths = job.get("batched_max_tokens") or [job["max_tokens"]] * len(prompts)
    batched = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    results = {}
    for spec in job["runs"]:
        res: dict = {}
        results[spec["name"]] = res
        if spec.get("command"):
            try:
                res["parsed_command"] = parse_serve_command(spec["command"])
            except Exception:  # noqa: BLE001
                res["error"] = traceback.format_exc()
                continue
        t0 = time.perf_counter()
        try:
            extra = {k: spec[k] for k in ("worker_cls", "async_scheduling") if spec.get(k) is not None}
            llm = LLM(model=job["target"], speculative_config=spec.get("speculative_config"),
                      additional_config=spec.get("additional_config") or {}, disable_log_stats=False,
                      **job.get("engine", {}), **extra)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            res["error"] = traceback.format_exc()
            continue
        res["start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            before = spec_counters(llm)
            res["batch1"] = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
            mid = spec_counters(llm)
            if spec.get("worker_cls"):
                from specstop.decode.vllm_draft_runner import live_runners

                res["runner_batch1"] = json.loads(json.dumps(live_runners()[-1].stops.stats))
            res["batched"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, batched, use_tqdm=False)]
            res["spec"] = {"batch1": _delta(mid, before), "batched": _delta(spec_counters(llm), mid)}
            if job.get("sampled"):
                res["samples"] = sample(llm, job)
            if spec.get("worker_cls"):
                from specstop.decode.vllm_draft_runner import live_runners

                runner = live_runners()[-1]
                res["runner"] = {**runner.stops.stats, "draft_kv": dict(runner.draft_kv),
                                 "gate": None if runner.gate is None else runner.gate.record(),
                                 "draft_quant": runner.draft_quant_record}
        except Exception:  # noqa: BLE001
            res["error"] = traceback.format_exc()
        res["generate_s"] = time.perf_counter() - t0
        shutdown_engine(llm)
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    out = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=1)
