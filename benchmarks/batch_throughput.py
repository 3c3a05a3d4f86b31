"""Batch throughput benchmark: batched speculative decoding at B = 1, 2, 4, 8 beside no speculation, with
the cost model's prediction next to every measured figure (specstop/decode/batched.py,
specstop/eval/batch_schedule.py).

At each batch size B the prompts are decoded in consecutive batches of B (rows leave the batch as they
finish; the batch is not refilled) by:

    target              no speculation: the batched target alone through the same decoder (max_draft=0)
    static:K            every K of --k (a static K for the whole batch)
    schedule K=k        the tuned schedule's K at this B (--tuned's batch_schedule; the static:k run)
    threshold           the tuned confidence threshold + SL_max at this B (per-sequence stopping)
    batch-1 K=k         the static K the schedule chose at B = 1 (the static:k run)

Throughput is generated tokens per second over the whole batch in the decode phase (both models'
prompt prefill left out: the cost model prices rounds). Every method first runs once on a short
generation (warm-up); then --repeats times, all (B, method) pairs in a shuffled order (interleaved, so
drift and background load hit all alike); the table gives the median and the spread over repeats.

Predictions, beside each measured figure:

    pred (replay)       --data: the exact replay of the same prompts at the same budget (their recorded
                        rounds), grouped in the same batches and priced round by round by the cost model's
                        batch section at the rows still decoding - a prediction made without decoding
    pred (own rounds)   the decoder's own batch rounds priced the same way (checks the costs alone)
    serving             the tuned schedule's steady-state prediction (a full batch of B running sequences),
                        for the rows the schedule names

Speedups are over the target alone at the same B (measured over measured, predicted over predicted).
A measured / predicted pair more than 10% apart is flagged (*).

Inputs: the pair, a cost model with a batch section (``specstop calibrate-cost --batch-grid 1,2,4,8``),
a tuned.json with a batch_schedule (``specstop tune`` with that cost model), and held-out prompts
(``--data DATASET --split test``, or ``--prompt``/``--prompts`` without the replay prediction).

Example (the reference pair; see docs/decoders.md "Batched decoding and schedules"):
    python benchmarks/batch_throughput.py --pair qwen2.5-coder-0.5b-1.5b --dtype auto \\
        --cost cost.json --tuned tuned.json --data data/mbpp_greedy --split test --limit 16 --out batch.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_speedup import add_prompt_flags, dataset_prompts, text_prompts  # noqa: E402

from specstop.script_args import ScriptParser, existing_file, positive_int, result_file, write_result  # noqa: E402
from specstop.script_main import run_main  # noqa: E402

FLAG = 0.10


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag} needs integers >= 1, got {text!r}")
    return vals


def schedule_entries(tuned: dict) -> dict[int, dict]:
    sched = tuned.get("batch_schedule")
    if not sched:
        raise SystemExit("--tuned has no batch_schedule: run `specstop tune` with a cost model measured by "
                         "`specstop calibrate-cost --batch-grid 1,2,4,8`")
    return {int(e["batch_size"]): e for e in sched["entries"]}


def plan(batch_sizes, ks, entries) -> dict[int, dict[str, str]]:
    """``{B: {method name: policy string}}``; schedule and batch-1 rows name the static run they reuse."""
    b1 = entries.get(1) or entries[min(entries)]
    out = {}
    for b in batch_sizes:
        e = entries.get(b)
        methods = {"target": "target"}
        wanted = set(ks) | {b1["k"]} | ({e["k"]} if e else set())
        for k in sorted(k for k in wanted if k > 0):
            methods[f"static:{k}"] = f"static:{k}"
        if e and e.get("threshold"):
            methods["threshold"] = "confidence:{threshold}:{sl_max}".format(**e["threshold"])
        out[b] = methods
    return out


def make_policy(text: str):
    from specstop.export.runtime import StoppingPolicy
    from specstop.policy import PolicySpec

    if text == "target":
        return StoppingPolicy.from_string("static:1")
    if text.startswith("confidence:"):
        _, tau, sl = text.split(":")
        return StoppingPolicy.from_spec(PolicySpec(kind="confidence", threshold=float(tau), sl_max=int(sl)))
    return StoppingPolicy.from_string(text)


def run_batches(decoder, prompts, b, max_new, *, baseline: bool) -> dict:
    """Decode ``prompts`` in consecutive batches of ``b``; decode-phase seconds, tokens and batch rounds."""
    seconds, tokens, round_k, round_rows, outs = 0.0, 0, [], [], []
    for i in range(0, len(prompts), b):
        res = decoder.generate(prompts[i : i + b], max_new, max_draft=0 if baseline else None)
        seconds += res.decode_seconds
        tokens += sum(len(t) for t in res.token_ids)
        round_k += res.batch["round_k"]
        round_rows += res.batch["round_rows"]
        outs += res.token_ids
    return {"seconds": seconds, "tokens": tokens, "round_k": round_k, "round_rows": round_rows, "outputs": outs}


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--cost", required=True, type=existing_file,
                    help="cost.json with a batch section (calibrate-cost --batch-grid)")
    ap.add_argument("--tuned", required=True, type=existing_file, help="tuned.json with a batch_schedule (specstop tune)")
    add_prompt_flags(ap, data_help="a specstop dataset: decode its --split prompts; enables the replay prediction",
                     split="test", limit=16, limit_help="prompts to decode at every B")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--k", default="1,2,3,4,5,6", help="static K values to run at every B")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the dataset's (else 64)")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="order of the interleaved runs")
    ap.add_argument("--out", type=result_file(__file__), help="write the table and every run as JSON here")
    args = ap.parse_args(argv)

    from specstop.data_gen.storage import read_manifest
    from specstop.decode import BatchedSpeculativeDecoder
    from specstop.eval.batch_schedule import batch_section, prompt_rounds
    from specstop.eval.cost import load_cost_model
    from specstop.eval.same_prompts import applies, load_for_prompts
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig

    batch_sizes, ks = _ints(args.batch_sizes, "--batch-sizes"), _ints(args.k, "--k")
    cost = load_cost_model(args.cost)
    try:
        batch_section(cost)
    except ValueError as err:
        raise SystemExit(f"--cost {args.cost}: {err}") from None
    tuned = json.loads(Path(args.tuned).read_text())
    entries = schedule_entries(tuned)
    pair = load_named_pair(args.pair, dtype=args.dtype, device=args.device)
    names = None
    if args.data:
        prompts, max_new, names = dataset_prompts(args.data, args.split, args.limit)
    else:
        args.limit = args.limit or None
        prompts, max_new = text_prompts(args, pair.tokenizer), 64
    max_new = args.max_new_tokens or max_new
    methods = plan(batch_sizes, ks, entries)
    policies = {text: make_policy(text) for m in methods.values() for text in m.values()}

    replay = {}
    if names is not None and applies(read_manifest(args.data)["generation"], max_new):
        data = load_for_prompts(args.data, args.split, names, max_new)
        for text, pol in policies.items():
            spec = pol.spec
            rounds = prompt_rounds(data, spec) if text != "target" else [
                [(0, 1)] * int(n) for n in data.lengths]
            replay[text] = (rounds, spec)

    # Warm-up, then interleaved repeats of every (B, policy).
    decoders = {text: BatchedSpeculativeDecoder(pair, pol, DecodingConfig()) for text, pol in policies.items()}
    jobs = [(b, text) for b in batch_sizes for text in dict.fromkeys(methods[b].values())]
    if replay:  # what the lead-in costs: the run is long on a CPU at the dataset's budget
        from specstop.eval.batch_schedule import fixed_batch_seconds

        est = args.repeats * sum(fixed_batch_seconds(replay[t][0], b, cost, "static" if t == "target" else replay[t][1])[0]
                                 for b, t in jobs)
        print(f"predicted decoding time: {est / 60:.1f} min for {len(jobs)} (batch size, policy) pairs x "
              f"{args.repeats} repeats (prefill and warm-up not included)")
    t0 = time.perf_counter()
    for b, text in jobs:
        run_batches(decoders[text], prompts[:b], b, min(4, max_new), baseline=text == "target")
    print(f"warm-up: {time.perf_counter() - t0:.1f} s for {len(jobs)} (batch size, policy) pairs")
    runs: dict[tuple[int, str], list[dict]] = {job: [] for job in jobs}
    rng = random.Random(args.seed)
    for rep in range(args.repeats):
        order = list(jobs)
        rng.shuffle(order)
        for b, text in order:
            runs[(b, text)].append(run_batches(decoders[text], prompts, b, max_new, baseline=text == "target"))
        print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)")

    def measured(b, text):
        kind = "static" if text == "target" else policies[text].spec
        return summarize(runs[(b, text)], cost, text, kind, replay.get(text), b)

    def static_text(k):
        return f"static:{k}" if k else "target"

    rows = []
    b1 = entries.get(1) or entries[min(entries)]
    for b in batch_sizes:
        base, e = measured(b, "target"), entries.get(b)
        for name, text in methods[b].items():
            rows.append(row_record(b, name, text, measured(b, text), base, e))
        if e:
            rows.append(row_record(b, f"schedule K={e['k']}", static_text(e["k"]), measured(b, static_text(e["k"])),
                                   base, e, serving=e["predicted_speedup"]))
        rows.append(row_record(b, f"batch-1 K={b1['k']}", static_text(b1["k"]), measured(b, static_text(b1["k"])),
                               base, e, serving=(e or {}).get("predicted_speedup_by_k", {}).get(str(b1["k"]))))
    print()
    print(f"pair {pair.name}: {pair.target_identity.dtype} ({pair.dtype_record().get('reason')}), device "
          f"{pair.target_device}; {len(prompts)} prompts x {max_new} tokens, {args.repeats} repeats")
    print(cost.provenance_line())
    print(to_markdown(rows))
    if args.out:
        doc = {"args": vars(args), "pair": pair.to_dict(), "cost": cost.name,
               "batch_schedule": tuned.get("batch_schedule"), "rows": rows,
               "runs": {f"{b} {t}": [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
                        for (b, t), rs in runs.items()}}
        write_result(args.out, doc, __file__)
        print(f"-> {args.out}")
    return 0


def summarize(reps: list[dict], cost, text: str, kind, replayed, b: int) -> dict:
    """Median throughput over repeats, its spread, and the predicted throughput of the same work: the
    run's own batch rounds priced, and (``replayed`` = (rounds per prompt, spec)) the replay's."""
    from specstop.eval.batch_schedule import fixed_batch_seconds, priced_rounds

    tput = [r["tokens"] / r["seconds"] for r in reps]
    first = reps[0]
    out = {"throughput": statistics.median(tput), "throughput_runs": tput, "tokens": first["tokens"],
           "pred_rounds_tput": first["tokens"] / priced_rounds(first["round_k"], first["round_rows"], cost, kind)}
    if replayed is not None:
        sec, tok = fixed_batch_seconds(replayed[0], b, cost, kind)
        out["pred_replay_tput"] = tok / sec
    return out


def row_record(b, name, text, r, base, entry, serving=None) -> dict:
    rec = {"batch_size": b, "method": name, "policy": text, "tokens": r["tokens"],
           "throughput": r["throughput"], "throughput_runs": r["throughput_runs"],
           "spread": [min(r["throughput_runs"]), max(r["throughput_runs"])],
           "speedup": r["throughput"] / base["throughput"],
           "pred_speedup_rounds": r["pred_rounds_tput"] / base["pred_rounds_tput"],
           "pred_throughput_rounds": r["pred_rounds_tput"]}
    if "pred_replay_tput" in r and "pred_replay_tput" in base:
        rec["pred_throughput_replay"] = r["pred_replay_tput"]
        rec["pred_speedup_replay"] = r["pred_replay_tput"] / base["pred_replay_tput"]
    if name == "threshold" and entry and entry.get("threshold"):
        serving = entry["threshold"]["predicted_speedup"]
    if name.startswith("static:") and entry:
        serving = entry["predicted_speedup_by_k"].get(name.split(":")[1], serving)
    if name == "target":
        serving = 1.0
    rec["serving_prediction"] = serving
    pred = rec.get("pred_speedup_replay", rec["pred_speedup_rounds"])
    rec["flag"] = abs(rec["speedup"] / pred - 1) > FLAG if name != "target" else (
        abs(rec["throughput"] / rec.get("pred_throughput_replay", rec["pred_throughput_rounds"]) - 1) > FLAG)
    return rec


def to_markdown(rows) -> str:
    lines = ["| B | method | tok/s (median) | spread | speedup | pred (replay) | pred (own rounds) | serving | |",
             "|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['method']} | {r['throughput']:.2f} | {r['spread'][0]:.2f}-{r['spread'][1]:.2f} "
            f"| {r['speedup']:.3f} | {f(r.get('pred_speedup_replay'), '{:.3f}')} | {r['pred_speedup_rounds']:.3f} "
            f"| {f(r.get('serving_prediction'), '{:.3f}')} | {'*' if r['flag'] else ''} |")
    lines.append("")
    lines.append("speedup: over the target alone at the same B; the target rows give its predicted tok/s instead: "
                 "pred columns there are "
                 + "; ".join(f"B={r['batch_size']}: {f(r.get('pred_throughput_replay'))} (replay) / "
                             f"{r['pred_throughput_rounds']:.2f} (own rounds) tok/s"
                             for r in rows if r["method"] == "target")
                 + f". * = measured and predicted more than {FLAG:.0%} apart.")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main, __file__)
