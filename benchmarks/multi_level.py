"""Tune multi-level speculation jointly: every pair of rules for the two gaps, replayed exactly and priced
with each model's forwards timed on this machine.

The stack is ML-SpecQD's: the pair's draft in --quant (weight-only, specstop.pair.quantize) drafts for the
target in --quant (the "self" draft), which drafts for the target. Steps:

1. time every model's forward by the tokens it feeds (specstop.measure.level_cost): the bottom draft's
   1-3 token steps, the middle model's and the target's verification blocks, at a decoding context of
   --data (or of the prompts), in turns, for --budget-s seconds;
2. record the three models' greedy tokens at every prefix the grid's rounds reach on the tuning prompts
   (specstop.measure.level_record; the target alone decodes each prompt first);
3. replay every combination of --bottom x --top rules on the record (specstop.eval.levels: the decoder's
   rounds, token for token) and price each forward by its rows: the predicted decode-phase speedup over
   the target alone, median over prompts.

Writes --out/level_cost.json (the timings; benchmarks/online_speedup.py --multi-level-cost prices its
--multi-level runs with it), --out/records.json and --out/tuned.json (every combination, best first), and
prints the ranking.

Example (the reference pair, a dataset's training prompts; then the best pair online, held-out prompts):
    python benchmarks/multi_level.py --pair qwen2.5-coder-0.5b-1.5b --data runs/quantized_none/data --split train \\
        --limit 12 --max-new-tokens 48 --bottom static:1,static:2,static:3,confidence:0.5,confidence:0.7 \\
        --top static:4,static:6,static:8,confidence:0.4,confidence:0.6 --dtype bfloat16 --out runs/levels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_speedup import add_prompt_flags, dataset_prompts, quantized_pairs, self_drafts, text_prompts  # noqa: E402

from specstop.script_args import (  # noqa: E402
    ScriptParser,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    result_dir,
    write_result,
)
from specstop.script_main import run_main  # noqa: E402

#: Block sizes timed per level past the table's dense start (the cost reads linearly between them).
SPARSE_ROWS = (10, 12, 16, 22)


def row_grid(largest: int, dense: int = 8) -> list[int]:
    """1..``dense`` then :data:`SPARSE_ROWS` up to ``largest`` (always including ``largest``)."""
    rows = [*range(1, min(dense, largest) + 1), *(n for n in SPARSE_ROWS if dense < n < largest)]
    return sorted({*rows, largest})


def rule_caps(rules: list[str]) -> int:
    """The largest number of tokens any of ``rules`` drafts in one round."""
    from specstop.policy import parse_policy_string

    return max(parse_policy_string(r).cap for r in rules)


def stack_models(pair, scheme: str) -> tuple[list, list[str]]:
    """``([bottom, middle, target], names)``: the pair's draft and the target, each quantized in ``scheme``,
    under the target."""
    bottom = quantized_pairs(pair, scheme)[0][1].draft
    middle = self_drafts(pair, scheme)[0][1].draft
    return [bottom, middle, pair.target], [f"{scheme} draft", f"self-{scheme}", "target"]


def to_markdown(ranked: list[dict], cost, top: int) -> str:
    lines = ["| bottom / top rules | predicted decode speedup | middle tokens/round | target tokens/round |",
             "|---|---:|---:|---:|"]
    for r in ranked[:top]:
        mid, tgt = r["tokens_per_round"]
        lines.append(f"| {' / '.join(r['policies'])} | {r['speedup']:.3f}x | {mid:.2f} | {tgt:.2f} |")
    lines += ["", "| model | " + " | ".join(f"{n} rows" for n in (1, 2, 4, 8)) + " |", "|---|" + "---:|" * 4]
    for i, name in enumerate(cost.names):
        lines.append(f"| {name} | " + " | ".join(f"{cost.seconds(i, n):.4f} s" for n in (1, 2, 4, 8)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    add_prompt_flags(ap, data_help="a specstop dataset: tune on its --split prompts (rendered ids)", split="train",
                     limit=12, limit_help="prompts to tune on")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the dataset's, else 48")
    ap.add_argument("--quant", default="int4", metavar="SCHEME", help="scheme of both lower levels (default int4)")
    ap.add_argument("--bottom", default="static:1,static:2,static:3,confidence:0.5,confidence:0.7",
                    help="rules of the bottom draft drafting for the middle model (comma list)")
    ap.add_argument("--top", default="static:4,static:6,static:8,confidence:0.4,confidence:0.6",
                    help="rules of the middle model drafting for the target (comma list)")
    ap.add_argument("--budget-s", type=nonnegative_float, default=90.0,
                    help="seconds of forward timing (default 90; 0: the fewest rounds)")
    ap.add_argument("--time-only", action="store_true",
                    help="only time the forwards (level_cost.json): a fresh timing for an online run, no tuning")
    ap.add_argument("--show", type=nonnegative_int, default=10, help="combinations to print (default 10)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True, type=result_dir(__file__, "tuned.json"),
                    help="folder for level_cost.json, records.json and tuned.json (created when the timing is done)")
    args = ap.parse_args(argv)

    from specstop.decode.chain import eos_token_ids
    from specstop.errors import UserError
    from specstop.eval.levels import level_combos, level_grid, save_records, tune_levels
    from specstop.measure.calibrate import build_context, context_from_data, machine_record
    from specstop.measure.level_cost import time_levels
    from specstop.measure.level_record import record_levels
    from specstop.pair import load_named_pair
    from specstop.pair.quantize import check_scheme

    try:
        grids = [level_grid(args.bottom), level_grid(args.top)]
        scheme = check_scheme(args.quant)
    except UserError as err:
        raise SystemExit(f"--bottom / --top / --quant: {err}") from None
    if scheme is None:
        raise SystemExit("--quant: give int8 or int4 (the lower levels are quantized copies)")
    out = Path(args.out)
    pair = load_named_pair(args.pair, dtype=args.dtype, device=args.device)
    if args.data:
        prompts, max_new, names = dataset_prompts(args.data, args.split, args.limit)
        context, context_tokens = context_from_data(args.data)
        context = context[:context_tokens]
    else:
        prompts, max_new = text_prompts(args, pair.tokenizer), 48
        names = [str(i) for i in range(len(prompts))]
        context = build_context(pair.tokenizer, [pair.tokenizer.decode(p) for p in prompts], 128)[:128]
    max_new = args.max_new_tokens or max_new
    models, level_names = stack_models(pair, scheme)
    rows = [[1, 2, 3], row_grid(rule_caps(grids[0]) + 2), row_grid(rule_caps(grids[1]) + 2)]
    cost = time_levels(models, level_names, context, rows, vocab_size=pair.vocab_size, budget_s=args.budget_s,
                       machine=machine_record(pair, len(context)))
    out.mkdir(parents=True, exist_ok=True)  # only now: a run that fails before leaves no empty folder
    cost.save(out / "level_cost.json")
    if args.time_only:
        print(to_markdown([], cost, 0))
        print(f"\nwrote {out}/level_cost.json ({cost.machine.get('cpu')}, {cost.machine['rounds']} rounds)")
        return 0
    combos = level_combos(grids)
    records = record_levels(models, list(zip(names, prompts)), max_new, combos, vocab_size=pair.vocab_size,
                            eos=eos_token_ids(pair))
    save_records(out / "records.json", records, {"pair": pair.name, "levels": level_names, "quant": scheme})
    ranked = tune_levels(records, grids, cost)
    doc = {"pair": pair.name, "levels": level_names, "quant": scheme, "prompts": names, "max_new_tokens": max_new,
           "best": ranked[0]["policies"], "ranked": ranked, "machine": cost.machine}
    write_result(out / "tuned.json", doc, __file__)
    print(f"\n{len(combos)} combinations on {len(records)} prompts x {max_new} tokens; {cost.machine.get('cpu')}, "
          f"{cost.machine.get('dtype')}, forwards timed in {cost.machine['rounds']} rounds")
    print(to_markdown(ranked, cost, args.show))
    print(f"\nbest: {' / '.join(ranked[0]['policies'])} (predicted {ranked[0]['speedup']:.3f}x); wrote {out}/")
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
