"""Online speedup benchmark: the same prompts, side by side in one run, repeated.

Methods (each greedy unless --temperature > 0):
    target            target.generate alone
    hf-default        HF assisted generation, its defaults (constant 20 + confidence 0.4)
    hf-heuristic      HF assisted generation, heuristic schedule (start 5, +2/-1; no confidence stop)
    ours:<policy>     specstop's SpeculativeDecoder with each --policy (static:K, heuristic, confidence:T, export dirs)
    hf+<policy>       (with --hf-policies) HF assisted generation driven by the same policies

Reports per method the median tokens/s over prompts x repeats, the ratio to the target alone, mean
tokens per round, how many greedy outputs differ from the target's own, and for our decoder the
predictor's overhead per draft step as a share of a draft forward.

Predictions next to the measurements (speculative methods of our decoder):
    --replay-report R   the eval report's replay speedup for the same policy (rows of R's report.json);
                        fair when the prompts are the replayed ones: use --data DIR --split test, which
                        feeds the dataset's own prompt ids with its max_new_tokens.
    --cost C            the cost model (preset name or cost.json from `specstop calibrate-cost`) applied to
                        this run's own counters (rounds, drafted tokens): isolates the cost model's error
                        from the replay's (the decoder's greedy counts equal the replay's, tests check it).

Example (tiny pair, seconds):
    python -m specstop.testing  # or: python -c "from specstop.testing import save_tiny_pair; save_tiny_pair('/tmp/tiny')"
    python benchmarks/online_speedup.py --pair /tmp/tiny --prompt "hello" --prompt "def f(x):" \
        --policy static:3 --policy heuristic --max-new-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def dataset_prompts(args) -> tuple[list[list[int]], int | None]:
    """Prompt ids (already rendered) of a specstop dataset's split, and its max_new_tokens."""
    from specstop.data_gen.storage import load_table, read_manifest

    seqs = load_table(args.data, "sequences", args.split or "test")
    if len(seqs) == 0:
        raise SystemExit(f"{args.data} has no {args.split or 'test'} prompts")
    ids = [list(r) for r in seqs["prompt_ids"]]
    if args.limit:
        ids = ids[: args.limit]
    return ids, read_manifest(args.data)["generation"]["max_new_tokens"]


def read_prompts(args) -> list[str]:
    texts = list(args.prompt or [])
    if args.prompts:
        path = Path(args.prompts)
        raw = path.read_text()
        if path.suffix == ".json":
            items = json.loads(raw)
        else:
            items = [json.loads(line) if line.lstrip().startswith("{") else line for line in raw.splitlines() if line.strip()]
        for it in items:
            if isinstance(it, dict):
                # Held-out prompt records: prefer an explicit split filter.
                if args.split and it.get("split") not in (None, args.split):
                    continue
                texts.append(it.get(args.field) or it.get("prompt_text") or it.get("text") or it.get("prompt"))
            else:
                texts.append(str(it))
    if args.limit:
        texts = texts[: args.limit]
    if not texts:
        raise SystemExit("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE (.json/.jsonl/.txt)")
    return texts


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def set_hf_assistant(draft, *, num_tokens: int, schedule: str, confidence: float | None) -> None:
    gc = draft.generation_config
    gc.num_assistant_tokens = num_tokens
    gc.num_assistant_tokens_schedule = schedule
    gc.assistant_confidence_threshold = confidence


@torch.no_grad()
def run_hf(pair, ids, max_new, gen_kwargs, assistant=None, policy=None):
    from specstop.export.hf_assist import use_policy

    x = torch.tensor([ids], device=pair.target_device)
    sync(pair.target_device)
    t0 = time.perf_counter()
    info = {}
    if policy is not None:
        with use_policy(pair.target, policy, vocab_size=pair.vocab_size) as info:
            out = pair.target.generate(x, assistant_model=assistant, max_new_tokens=max_new, **gen_kwargs)
    else:
        kw = {"assistant_model": assistant} if assistant is not None else {}
        out = pair.target.generate(x, max_new_tokens=max_new, **kw, **gen_kwargs)
    sync(pair.target_device)
    dt = time.perf_counter() - t0
    toks = out[0, len(ids) :].tolist()
    rounds = len(info["generator"].round_lengths) if info.get("generator") else None
    return toks, dt, rounds, None


@torch.no_grad()
def run_target(pair, ids, max_new, gen_kwargs):
    """Target alone; also times one prefill forward over the prompt, so the decode phase can be
    compared without the prompt's cost (on a CPU a 200-token prefill costs as much as ~10 tokens)."""
    x = torch.tensor([ids], device=pair.target_device)
    sync(pair.target_device)
    t0 = time.perf_counter()
    pair.target(input_ids=x, logits_to_keep=1)
    sync(pair.target_device)
    prefill = time.perf_counter() - t0
    toks, dt, rounds, _ = run_hf(pair, ids, max_new, gen_kwargs)
    return toks, dt, rounds, prefill


@torch.no_grad()
def first_flip(pair, prompt_ids: list[int], ref: list[int], out: list[int], method: str, prompt: int) -> dict:
    """Where ``out`` first departs from the target's own greedy ``ref``, and the target's top-2 logit
    gap there (one full forward over the shared prefix). In float32 there are no flips; in bf16 the
    decoder's batched verification and generate's single-token steps use different kernels, so a
    flip is expected only where the top two logits (nearly) tie."""
    j = next((t for t, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    x = torch.tensor([prompt_ids + ref[:j]], device=pair.target_device)
    logits = pair.target(input_ids=x).logits[0, -1, : pair.vocab_size].float()
    top2 = logits.topk(2).values
    return {"method": method, "prompt": prompt, "token": j, "target_token": ref[j] if j < len(ref) else None,
            "method_token": out[j] if j < len(out) else None, "top2_gap": float(top2[0] - top2[1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    ap.add_argument("--prompt", action="append", help="a prompt text (repeatable)")
    ap.add_argument("--prompts", help="prompts file: .json list, .jsonl records or .txt lines")
    ap.add_argument("--data", help="a specstop dataset: decode its --split prompts (rendered ids) at its max_new_tokens")
    ap.add_argument("--field", default="prompt_text", help="record field holding the text")
    ap.add_argument("--split", default=None, help="keep records of this split only (e.g. test)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--policy", action="append", default=None, help="our decoder's policies (repeatable)")
    ap.add_argument("--hf-policies", nargs="*", default=None, metavar="NAME",
                    help="also run HF assisted generation driven by these policies (names as in --policy; none = all)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF assisted baselines")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the dataset's (--data), else 128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--static-cache", action="store_true", help="our decoder with a static KV cache")
    ap.add_argument("--compile", action="store_true", help="our decoder compiled (CUDA; implies --static-cache)")
    ap.add_argument("--full-warmup", action="store_true",
                    help="warm up with max_new_tokens (default 8 tokens; use with --compile, whose shapes vary)")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--replay-report", help="eval report.json with the replay's predicted speedups")
    ap.add_argument("--cost", help="cost model (preset or cost.json) to predict each run from its own counters")
    ap.add_argument("--flip-epsilon", type=float, default=0.5,
                    help="a greedy flip whose top-2 target logit gap is below this counts as a near-tie (bf16)")
    ap.add_argument("--out", help="write all measurements as JSON here")
    args = ap.parse_args(argv)

    from specstop.export.decode_cli import render
    from specstop.export.decoder import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig

    pair = load_named_pair(args.pair, dtype=args.dtype, device=args.device)
    if args.data:
        prompts, data_max_new = dataset_prompts(args)
        args.max_new_tokens = args.max_new_tokens or data_max_new
    else:
        prompts = [render(t, pair.tokenizer, not args.no_chat_template) for t in read_prompts(args)]
    args.max_new_tokens = args.max_new_tokens or 128
    cost = None
    if args.cost:
        from specstop.eval.cost import load_cost_model

        cost = load_cost_model(args.cost)
    decoding = DecodingConfig(temperature=args.temperature)
    gen_kwargs = {"do_sample": False} if decoding.greedy else {"do_sample": True, "temperature": args.temperature}
    gen_kwargs["suppress_tokens"] = list(range(pair.vocab_size, pair.target_identity.logits_size)) or None
    policies = {}
    for spec in args.policy or ["static:4", "heuristic"]:
        pol = StoppingPolicy.load(spec, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash, device=pair.draft_device)
        policies[Path(spec).name if Path(spec).is_dir() else spec] = pol

    methods: dict[str, callable] = {"target": lambda ids: run_target(pair, ids, args.max_new_tokens, gen_kwargs)}
    if not args.no_hf:
        def hf_default(ids):
            set_hf_assistant(pair.draft, num_tokens=20, schedule="constant", confidence=0.4)
            return run_hf(pair, ids, args.max_new_tokens, gen_kwargs, assistant=pair.draft)

        def hf_heuristic(ids):
            set_hf_assistant(pair.draft, num_tokens=5, schedule="heuristic_transient", confidence=None)
            return run_hf(pair, ids, args.max_new_tokens, gen_kwargs, assistant=pair.draft)

        methods["hf-default"] = hf_default
        methods["hf-heuristic"] = hf_heuristic
    stats: dict[str, dict] = {}
    for name, pol in policies.items():
        dec = SpeculativeDecoder(pair, pol, decoding, static_cache=args.static_cache, compile=args.compile)

        def ours(ids, dec=dec, name=name):
            res = dec.generate(ids, args.max_new_tokens, seed=0)
            st = stats.setdefault(f"ours:{name}", {"draft": 0.0, "predictor": 0.0, "target": 0.0, "steps": 0, "rounds": 0,
                                                   "target_only": 0, "N": 0})
            st["draft"] += res.timings["draft"]
            st["predictor"] += res.timings["predictor"]
            st["target"] += res.timings["target"]
            st["steps"] += res.counters["N_draft"]
            st["rounds"] += res.counters["N_target"]
            st["target_only"] += res.round_lengths.count(0)
            st["N"] += res.counters["N"]
            return res.token_ids, res.timings["total"], res.counters["rounds"], res.timings["prefill"]

        methods[f"ours:{name}"] = ours
        if args.hf_policies is not None and (not args.hf_policies or name in args.hf_policies):
            methods[f"hf+{name}"] = lambda ids, pol=pol: run_hf(pair, ids, args.max_new_tokens, gen_kwargs, assistant=pair.draft, policy=pol)

    # Warm up every method once (allocator, kernels, compilation) before timing; a short run is
    # enough on a CPU, where a full-length warm-up would double the benchmark's time.
    full = args.max_new_tokens
    args.max_new_tokens = full if args.full_warmup else min(full, 8)  # the method closures read it per call
    for fn in methods.values():
        fn(prompts[0])
    args.max_new_tokens = full
    stats.clear()
    rows = {m: {"tok_s": [], "decode_tok_s": [], "runs": [], "tokens": 0, "rounds": 0, "mismatch": 0} for m in methods}
    ref_out: dict[int, list[int]] = {}
    flips: list[dict] = []
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for m, fn in methods.items():  # side by side: every method on the same prompt in turn
                toks, dt, rounds, prefill = fn(ids)
                r = rows[m]
                r["tok_s"].append(len(toks) / max(dt, 1e-9))
                r["runs"].append({"prompt": i, "repeat": rep, "tokens": len(toks), "seconds": dt, "prefill": prefill})
                if prefill is not None:  # decode phase only: everything after the prompt's prefill
                    r["decode_tok_s"].append(len(toks) / max(dt - prefill, 1e-9))
                r["tokens"] += len(toks)
                r["rounds"] += rounds or 0
                if m == "target":
                    ref_out.setdefault(i, toks)
                elif decoding.greedy and rep == 0 and toks != ref_out.get(i):
                    r["mismatch"] += 1
                    flips.append(first_flip(pair, prompts[i], ref_out[i], toks, m, i))
            print(f"repeat {rep + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)} done", file=sys.stderr)

    replay = {}
    if args.replay_report:
        from specstop.eval.report import row_key_for_policy

        rep_rows = json.loads(Path(args.replay_report).read_text()).get("rows") or {}
        for name, pol in policies.items():
            # An export is replayed under its tuned policy's name, whatever its folder is called.
            key = row_key_for_policy(rep_rows, pol.config.get("name") or name)
            if key is not None:
                replay[name] = rep_rows[key].get("speedup")

    base = statistics.median(rows["target"]["tok_s"])
    decode_base = statistics.median(rows["target"]["decode_tok_s"])

    def aggregate(runs: list[dict], decode: bool) -> float | None:
        """Total tokens / total seconds: the replay's definition (summed cost over summed tokens)."""
        if decode and any(x["prefill"] is None for x in runs):
            return None
        secs = sum(x["seconds"] - (x["prefill"] if decode else 0.0) for x in runs)
        return sum(x["tokens"] for x in runs) / max(secs, 1e-9)

    agg_base = aggregate(rows["target"]["runs"], False)
    agg_decode_base = aggregate(rows["target"]["runs"], True)
    print(f"\npair {pair.name}, {len(prompts)} prompts x {args.repeats} repeats, max_new_tokens {args.max_new_tokens}, "
          f"T={args.temperature}, device {pair.target_device}, dtype {pair.target_identity.dtype}")
    print(f"{'method':<28}{'tok/s (median)':>15}{'speedup':>9}{'decode':>8}{'sum':>7}{'sum dec':>8}{'tok/round':>10}"
          f"{'greedy diffs':>13}{'pred/draft':>11}{'replay':>8}{'cost model':>11}")
    table = []
    for m, r in rows.items():
        med = statistics.median(r["tok_s"])
        decode = statistics.median(r["decode_tok_s"]) / decode_base if r["decode_tok_s"] else None
        agg = aggregate(r["runs"], False) / agg_base
        agg_dec = aggregate(r["runs"], True)
        agg_dec = agg_dec / agg_decode_base if agg_dec is not None else None
        per_round = r["tokens"] / r["rounds"] if r["rounds"] else float("nan")
        st = stats.get(m)
        overhead = st["predictor"] / st["draft"] if st and st["draft"] > 0 else None
        pred = replay.get(m.split(":", 1)[-1]) if m.startswith("ours:") else None
        model = None
        if cost is not None and st and st["N"]:
            model = cost.target_only_per_token / float(cost.latency_per_token(st["rounds"], st["steps"], st["N"], st["target_only"]))
        phases = None
        if st and st["rounds"]:
            # Measured per-phase costs, to compare with the cost model's t_draft and t_target + b (K + 1).
            phases = {"draft_per_step": st["draft"] / max(st["steps"], 1), "target_per_round": st["target"] / st["rounds"],
                      "drafted_per_round": st["steps"] / st["rounds"]}
        table.append({"method": m, "tok_s_median": med, "speedup": med / base, "decode_speedup": decode,
                      "sum_speedup": agg, "sum_decode_speedup": agg_dec, "runs": r["runs"],
                      "tokens_per_round": per_round,
                      "greedy_mismatches": r["mismatch"], "predictor_share_of_draft": overhead, "replay_speedup": pred,
                      "cost_model_speedup": model, "phases": phases, "tok_s": r["tok_s"]})
        print(f"{m:<28}{med:>15.1f}{med / base:>8.2f}x{'' if decode is None else f'{decode:.2f}x':>8}{agg:>6.2f}x"
              f"{'' if agg_dec is None else f'{agg_dec:.2f}x':>8}"
              f"{per_round:>10.2f}{r['mismatch']:>13}"
              f"{'' if overhead is None else f'{100 * overhead:.1f}%':>11}{'' if pred is None else f'{pred:.2f}x':>8}"
              f"{'' if model is None else f'{model:.2f}x':>11}")
    for f in flips:
        near = f["top2_gap"] < args.flip_epsilon
        print(f"greedy flip: {f['method']} prompt {f['prompt']} token {f['token']}: top-2 logit gap {f['top2_gap']:.4f} "
              f"({'near-tie' if near else 'NOT a near-tie'}: epsilon {args.flip_epsilon})")
    print("speedup / decode = ratios of median tok/s; sum / sum dec = total tokens over total seconds (the replay's\n"
          "definition); decode = each method's prompt prefill taken out (target alone: one timed prefill forward);\n"
          "replay / cost model predict the decode phase (they do not model prefill); tok/round = emitted tokens per\n"
          "target forward (n + 1); pred/draft = policy time per draft step / draft forward time")
    print(f"target alone: {1.0 / base:.4f} s/token measured" + (f", {cost.target_only_per_token:.4f} in the cost model" if cost else ""))
    for row in table:
        if row["phases"]:
            ph = row["phases"]
            print(f"  {row['method']}: draft {ph['draft_per_step']:.4f} s/step, target {ph['target_per_round']:.4f} s/round "
                  f"at {ph['drafted_per_round']:.2f} drafted/round")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cost": cost.to_dict() if cost else None,
                                              "target_s_per_token": 1.0 / base, "flips": flips,
                                              "flip_epsilon": args.flip_epsilon, "rows": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
