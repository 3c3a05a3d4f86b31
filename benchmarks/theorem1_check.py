"""Theorem 1 (Yin et al.) on real decoding runs: E[rejections] = sum of E[TV(p_i, q_i)] over the
positions that received a draft proposal, for speculative sampling with unbounded draft length.

Our decoder runs at the given temperature / top-k with ``static:max_new`` (every round drafts to the
length cap), over prompts x seeds. Per run, rejections are counted from the decoder's own rounds
(a round with n < K accepted ended in a rejection), and the right-hand side is the sum of TV(p_i, q_i)
at the positions that were proposed (each round: its n accepted positions plus the rejected one),
with p and q from one teacher-forced pass of each model over prompt + output. The report is the mean
difference per run with a 95% interval (runs are independent).

    python benchmarks/theorem1_check.py --pair qwen2.5-coder-0.5b-1.5b --prompts builtin:alpaca \\
        --template alpaca --limit 8 --seeds 4 --max-new-tokens 24 --temperature 1.0 --top-k 50
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from specstop.script_args import (
    ScriptParser,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    result_file,
    write_result,
)
from specstop.script_main import run_main


def proposed_positions(round_lengths: list[int], accepted: list[int]) -> list[int]:
    """Response positions that received a draft proposal, from the decoder's per-round (K, n)."""
    out, s = [], 0
    for k, n in zip(round_lengths, accepted):
        if k == 0:  # a target-only step: nothing proposed
            s += 1
            continue
        proposed = n + (1 if n < k else 0)
        out.extend(range(s, s + proposed))
        s += n + 1
    return out


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True)
    ap.add_argument("--prompts", default="builtin:alpaca")
    ap.add_argument("--template", default="alpaca")
    ap.add_argument("--limit", type=positive_int, default=8)
    ap.add_argument("--seeds", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=24)
    ap.add_argument("--temperature", type=nonnegative_float, default=1.0)
    ap.add_argument("--top-k", type=nonnegative_int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=result_file(__file__), default=None)
    args = ap.parse_args(argv)

    from specstop.decode.chain import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig, logits_to_probs, tv_distance
    from specstop.prompts import PromptSetConfig, load_prompt_set, render_prompt

    pair = load_named_pair(args.pair, dtype=args.dtype)
    recs = load_prompt_set(PromptSetConfig(source=args.prompts, template=args.template, split_scheme="all:test"))
    prompts = [render_prompt(r.text, pair.tokenizer, True) for r in recs[: args.limit]]
    dec_cfg = DecodingConfig(temperature=args.temperature, top_k=args.top_k)
    dec = SpeculativeDecoder(pair, StoppingPolicy.from_string(f"static:{args.max_new_tokens}"), dec_cfg)
    diffs, rows = [], []
    for pi, ids in enumerate(prompts):
        for seed in range(args.seeds):
            res = dec.generate(ids, args.max_new_tokens, seed=seed)
            rej = sum(n < k for k, n in zip(res.round_lengths, res.accepted_per_round))
            pos = proposed_positions(res.round_lengths, res.accepted_per_round)
            seq = torch.tensor([ids + res.token_ids], device=pair.target_device)
            with torch.no_grad():
                tl = pair.target(input_ids=seq).logits[0]
                dl = pair.draft(input_ids=seq.to(pair.draft_device)).logits[0].to(tl.device)
            rowsel = [len(ids) - 1 + i for i in pos]
            p = logits_to_probs(tl[rowsel], dec_cfg, pair.vocab_size)
            q = logits_to_probs(dl[rowsel], dec_cfg, pair.vocab_size)
            tv = float(tv_distance(p, q).sum())
            diffs.append(rej - tv)
            rows.append({"prompt": pi, "seed": seed, "rejections": rej, "sum_tv": tv, "proposed": len(pos)})
            print(f"prompt {pi} seed {seed}: rejections {rej}, sum TV {tv:.2f} over {len(pos)} proposed positions",
                  file=sys.stderr)
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else float("nan")
    half = 1.96 * sd / math.sqrt(n)
    rej_mean = sum(r["rejections"] for r in rows) / n
    tv_mean = sum(r["sum_tv"] for r in rows) / n
    print(f"runs {n}: mean rejections {rej_mean:.3f}, mean sum TV {tv_mean:.3f}, difference {mean:+.3f} "
          f"[{mean - half:+.3f}, {mean + half:+.3f}] (95%); "
          f"{'consistent with' if abs(mean) <= half else 'NOT consistent with'} Theorem 1")
    if args.out:
        write_result(args.out, {"args": vars(args), "runs": rows, "mean_difference": mean, "ci95": half,
                                "mean_rejections": rej_mean, "mean_sum_tv": tv_mean}, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
