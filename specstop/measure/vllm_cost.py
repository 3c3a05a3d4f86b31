"""``specstop calibrate-cost --engine vllm``: draft and target costs measured inside vLLM.

vLLM lives in its own virtualenv (``make vllm-env``; ``--vllm-python`` or ``$SPECSTOP_VLLM_VENV`` names
another), so this module is both sides: :func:`calibrate_in_vllm` (any Python with specstop) starts
``python -m specstop.measure.vllm_cost --worker JOB OUT`` on vLLM's Python, which runs :func:`worker`:
one ``vllm.LLM`` with specstop's stop in its cost sweep (:data:`~specstop.decode.vllm_proposer.COST_SWEEP_KEY`),
greedy decoding of the prompts B at a time for each B of the batch grid, and the stop's
``engine_costs()``. The stop runs where the exports that the costs will price run it (:data:`PATHS`):
in vLLM's own batched draft runner (``runner``: ``specstop export --for vllm`` runs rules and learned
policies there, with a float or a ``draft_quant`` draft), or in the side-path proposer (``proposer``: the
heuristic schedule). Then vLLM's own draft-model runner (``speculative_config={"model": DRAFT,
"num_speculative_tokens": K}``), which runs a fixed K, and vLLM without speculation are timed per
decode step at each batch size (:func:`time_runner`, float drafts only), so the options vLLM runs
itself (a fixed K, the batch schedule) are priced with their own costs.
:func:`specstop.measure.engine_cost.cost_model_from_engine` turns both into the cost model written to
``--out``.

The engine settings are the serving benchmark's (``benchmarks/vllm_serving.py``): the single-process
executor, eager mode, every CPU of this process's affinity for vLLM's threads, no prefix caching.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specstop.errors import UserError

_REPO_ROOT = Path(__file__).resolve().parents[2]

#: Where the cost sweep runs specstop's stop: vLLM's batched draft-model runner (``worker_cls``,
#: :mod:`specstop.decode.vllm_worker`) or the side-path proposer (``custom_class``,
#: :mod:`specstop.decode.vllm_proposer`).
PATHS = ("runner", "proposer")


def vllm_python(explicit: str | None = None) -> str:
    """The Python that has vLLM: ``explicit``, else ``$SPECSTOP_VLLM_VENV/bin/python``, else the checkout's
    ``.venv-vllm``, else this Python.

    Raises:
        MissingInputError: ``explicit`` (``--vllm-python``) is not an executable program.
    """
    if explicit:
        from specstop.script_args import check_executable

        return check_executable(explicit, flag="--vllm-python",
                                fix="give the Python of vLLM's virtualenv (`make vllm-env` builds .venv-vllm)")
    venv = os.environ.get("SPECSTOP_VLLM_VENV")
    for cand in ([Path(venv) / "bin" / "python"] if venv else []) + [_REPO_ROOT / ".venv-vllm" / "bin" / "python"]:
        if cand.is_file():
            return str(cand)
    return sys.executable


def vllm_env(kv_cache_gib: float = 2.0) -> dict:
    """The environment vLLM's CPU build serves well in here: one process, all CPUs of this process's affinity
    for its threads (none reserved), ``kv_cache_gib`` of KV cache; ``VLLM_*`` already set win. Run from a
    checkout, the checkout goes first on PYTHONPATH, so vLLM's Python loads this specstop."""
    try:
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except AttributeError:
        cpus = f"0-{(os.cpu_count() or 1) - 1}"
    env = dict(os.environ)
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": cpus,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
                "TOKENIZERS_PARALLELISM": "false"}
    for k, v in defaults.items():
        env.setdefault(k, v)
    if (_REPO_ROOT / "pyproject.toml").is_file():  # a checkout: its code, not a copy installed in vLLM's venv
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def pair_folders(pair: str | None, draft: str | None, target: str | None, *, what: str) -> tuple[str, str] | None:
    """(draft, target) as vLLM loads them: a pair name's converted folders (or a folder with draft/ and
    target/), else ``draft`` and ``target`` as given (a local path expanded, else a hub id); None without
    either. ``what`` names the command in the error."""
    if pair:
        from specstop.pair.registry import converted_pair_dir

        root = Path(pair).expanduser()
        root = root if root.is_dir() else converted_pair_dir(pair)
        if not (root / "draft").is_dir() or not (root / "target").is_dir():
            raise UserError(f"{what} --pair {pair}: no draft/ and target/ under {root}; run `specstop fetch-pair {pair}`")
        return str(root / "draft"), str(root / "target")
    if draft and target:
        local = [Path(m).expanduser() for m in (draft, target)]
        return tuple(str(p) if p.exists() else m for p, m in zip(local, (draft, target)))  # type: ignore[return-value]
    return None


def engine_kwargs(dtype: str, max_model_len: int, max_num_seqs: int) -> dict:
    """``vllm.LLM`` arguments that start in seconds on CPU (no compilation) and serve requests as new ones."""
    return {"dtype": dtype, "enforce_eager": True, "compilation_config": {"mode": 0}, "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs, "seed": 0, "distributed_executor_backend": "uni",
            "enable_prefix_caching": False}


def shutdown_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine and free its models before the next one starts (best effort)."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; a later engine start reports real problems
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001
        pass


def decode_phase(outputs) -> tuple[int, float] | None:
    """``(tokens, seconds)`` of the decode phase of one ``llm.generate`` call: the tokens after each
    request's first, and the time from the last request's first token (every prefill done) to the last
    token. None without vLLM's per-request timestamps (an engine started with ``disable_log_stats=True``)."""
    stats = [getattr(o, "metrics", None) for o in outputs]
    if not stats or any(s is None or not getattr(s, "last_token_ts", 0.0) for s in stats):
        return None
    tokens = sum(max(len(o.outputs[0].token_ids) - 1, 0) for o in outputs)
    return tokens, max(s.last_token_ts for s in stats) - max(s.first_token_ts for s in stats)


class EngineSteps:
    """Times every engine step of a ``vllm.LLM`` on the single-process executor, with how many rows it decoded.

    It wraps the in-process engine client's ``get_output`` (one scheduler step: schedule, the target's
    forward, sampling, verification and the drafts for the next step). A step counts as a decode step
    once every request of the current ``generate`` call has its first token, so no prefill shares it.

    Attributes:
        steps: ``(seconds, rows, decode)`` per step since the last :meth:`begin`; rows: requests that
            got tokens in the step.
    """

    def __init__(self, llm):
        self._client = llm.llm_engine.engine_core
        self._inner = self._client.get_output
        self._client.get_output = self._timed
        self.steps: list[tuple[float, int, bool]] = []
        self._expected, self._seen = 0, set()

    def begin(self, requests: int) -> None:
        """Start timing a ``generate`` call of ``requests`` requests (forgets earlier steps)."""
        self.steps, self._expected, self._seen = [], int(requests), set()

    def _timed(self):
        decode = len(self._seen) >= self._expected
        t0 = time.perf_counter()
        out = self._inner()
        seconds = time.perf_counter() - t0
        rows = [o.request_id for o in out.outputs if o.new_token_ids]
        self._seen.update(rows)
        if rows:
            self.steps.append((seconds, len(rows), decode))
        return out

    def decode_steps(self, rows: int | None = None) -> list[float]:
        """Seconds of each decode step since :meth:`begin` (with exactly ``rows`` rows when given)."""
        return [s for s, r, d in self.steps if d and (rows is None or r == rows)]

    def close(self) -> None:
        """Restore the engine client's own ``get_output``."""
        self._client.get_output = self._inner


def time_runner(job: dict, prompts: list[dict]) -> dict:
    """vLLM's own draft-model runner at each K of ``job["runner_k"]`` (K = 0: vLLM without speculation)
    and each batch size of ``job["batch_sizes"]``: seconds per decode step, i.e. per verification of K
    drafted tokens in every row. Returns ``{"B": {"K": {"step_s", "starts", "requests", "steps", "min_s",
    "max_s"}}}``.

    Every engine step is timed on its own (:class:`EngineSteps`); an engine start's figure is the median
    of the decode steps in which all B rows decoded, so prefills and the tail of a batch whose rows
    finished at different steps are left out. The B rows are B different prompts, as a server's are.
    A step's cost moves from one engine start to the next on a CPU (by up to 40% for one row), so each
    K is started ``job["runner_starts"]`` times, the K taking turns, and ``step_s`` is the median over
    the starts (``starts`` keeps each start's own).
    """
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, ignore_eos=True)
    sizes = [int(b) for b in job.get("batch_sizes") or [1]]
    per_start: dict = {}
    for start in range(max(int(job.get("runner_starts") or 1), 1)):
        for k in job.get("runner_k") or []:
            conf = {"model": job["draft"], "num_speculative_tokens": int(k)} if k else None
            t0 = time.perf_counter()
            llm = LLM(model=job["target"], speculative_config=conf, disable_log_stats=False, **job["engine"])
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
            timer = EngineSteps(llm)
            for b in sizes:
                calls = len(prompts) if b == 1 else 2  # larger batches: fewer calls, as many rows
                steps = []
                for first in range(calls):
                    timer.begin(b)
                    llm.generate([prompts[(first + i) % len(prompts)] for i in range(b)], params, use_tqdm=False)
                    steps += timer.decode_steps(rows=b)
                if steps:
                    per_start.setdefault((b, k), []).append((steps, calls * b))
            timer.close()
            shutdown_engine(llm)
            del llm
            what = f"draft model K={k}" if k else "no speculation"
            print(f"[calibrate-cost] vLLM: {what} timed at batch sizes {','.join(map(str, sizes))}, engine start "
                  f"{start + 1} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out: dict = {}
    for (b, k), starts in per_start.items():
        medians = [float(statistics.median(steps)) for steps, _ in starts]
        pooled = [x for steps, _ in starts for x in steps]
        out.setdefault(str(b), {})[str(k)] = {
            "step_s": float(statistics.median(medians)), "starts": medians,
            "requests": sum(n for _, n in starts), "steps": len(pooled), "min_s": min(pooled), "max_s": max(pooled)}
    return out


def worker(job: dict) -> dict:
    """In vLLM's Python: the cost sweep on ``job`` (see the module doc); returns the engine costs and versions."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from specstop.decode.vllm_draft_runner import live_runners
    from specstop.decode.vllm_proposer import COST_SWEEP_KEY, SETTINGS_KEY, live_proposers
    from specstop.export.engines import vllm_proposer_config, vllm_runner_config

    grid = [int(k) for k in job["k_grid"]]
    # the policy decides at every step as in serving (its cost is part of a step); the sweep ignores its stops
    policy = {"kind": "confidence", "threshold": 0.4, "sl_max": max(grid)}
    cap, quant = max(max(grid), 1), job.get("draft_quant")
    runner = job.get("path", "runner") == "runner"
    if runner:
        spec = vllm_runner_config(job["draft"], policy, cap, draft_quant=quant)
    else:
        conf, extra = vllm_proposer_config(job["draft"], policy, cap, draft_quant=quant)
        spec = {"speculative_config": conf, "additional_config": extra}
    spec["additional_config"][SETTINGS_KEY][COST_SWEEP_KEY] = grid
    llm = LLM(model=job["target"], **spec, **job["engine"])
    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    for b in job["batch_sizes"]:
        for i in range(0, len(prompts), b):
            llm.generate(prompts[i:i + b], params, use_tqdm=False)
        print(f"[calibrate-cost] vLLM: batch size {b} timed ({time.perf_counter() - t0:.0f} s)", flush=True)
    stop = live_runners()[-1] if runner else live_proposers()[-1]
    costs = stop.engine_costs()
    quant_record = stop.draft_quant_record if runner else stop.stats.get("draft_quant")
    shutdown_engine(llm)
    del llm, stop
    # vLLM's own runner loads the draft as vLLM does (never quantized): timed only for a float draft.
    fixed_k = {} if quant else time_runner(job, prompts[: int(job.get("runner_prompts") or 4)])
    return {"costs": costs, "runner": fixed_k, "draft_quant": quant_record,
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}


def calibrate_in_vllm(draft: str, target: str, prompts: list[list[int]], *, k_grid: list[int], batch_sizes: list[int],
                      max_tokens: int, dtype: str, draft_quant: str | None, python: str | None, log_path: Path,
                      machine: dict, name: str, runner_k: list[int] | None = None, runner_starts: int = 1,
                      path: str = "runner"):
    """Run :func:`worker` in vLLM's Python and return ``(CostModel, raw worker result)``. ``runner_k``: the K
    at which vLLM's own draft-model runner is timed (0: without speculation); None: 0 and every K >= 1
    of ``k_grid``; [] or a quantized draft: not timed. ``runner_starts``: engine starts per K of that runner.
    ``path``: where the sweep runs specstop's stop (one of :data:`PATHS`).

    Raises:
        UserError: vLLM's Python cannot import vLLM, or the engine failed (the log's tail is in the message).
    """
    from specstop.measure.engine_cost import cost_model_from_engine

    exe = vllm_python(python)
    grid = sorted({0, *(int(k) for k in k_grid)})
    runner_k = grid if runner_k is None else sorted({int(k) for k in runner_k})
    longest = max(map(len, prompts)) + max_tokens + max(grid) + 16
    job = {"draft": draft, "target": target, "prompts": prompts, "k_grid": grid, "batch_sizes": batch_sizes,
           "max_tokens": max_tokens, "draft_quant": draft_quant, "runner_k": runner_k, "runner_starts": runner_starts,
           "path": path,
           "engine": engine_kwargs(dtype, -(-longest // 128) * 128, max(batch_sizes))}
    with tempfile.TemporaryDirectory(prefix="specstop_vllm_cost_") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # beside --out, whose folder save() makes later
        with open(log_path, "w") as log:
            proc = subprocess.Popen([exe, "-m", "specstop.measure.vllm_cost", "--worker", str(job_path), str(out_path)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=vllm_env(), bufsize=1)
            for line in proc.stdout:
                log.write(line)
                if line.startswith("[calibrate-cost]"):
                    print(line.rstrip(), flush=True)
            rc = proc.wait()
        if rc != 0 or not out_path.is_file():
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
            if "No module named 'vllm'" in tail:
                raise UserError(f"--engine vllm: {exe} has no vLLM; run `make vllm-env` or give --vllm-python")
            raise UserError(f"--engine vllm: the vLLM process exited with {rc} (log: {log_path}):\n{tail}")
        raw = json.loads(out_path.read_text())
    engine = f"vllm {raw['versions']['vllm']}"
    machine = {**machine, "dtype": dtype, "draft_quant": draft_quant, "vllm_path": path,
               "torch": raw["versions"]["torch"]}
    return cost_model_from_engine(raw["costs"], engine=engine, name=name, machine=machine,
                                  runner=raw.get("runner")), raw


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--worker":
        result = worker(json.loads(Path(argv[1]).read_text()))
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    print("usage: python -m specstop.measure.vllm_cost --worker JOB OUT (started by specstop calibrate-cost --engine vllm)")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
