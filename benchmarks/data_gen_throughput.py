"""Labeled tokens/s of `specstop generate` against plain ``target.generate`` (not a timed test).

For each batch size the same prompts are run through

* ``generate``: the target's batched greedy ``generate`` alone (the floor any labeling pays);
* ``labels``: responses + teacher-forced target/draft passes + all token labels (hidden states,
  mixing and rollouts off) - the goal is <= 1.3x the time of ``generate``;
* ``+hidden``: also the draft's hidden states; ``+rollouts``: also greedy rollouts after every
  mismatch (eval splits); ``+mixing``: hidden states and one token-mixing draft pass (train split).

Examples::

    python benchmarks/data_gen_throughput.py --pair tiny --n 16 --batch-sizes 1,8
    python benchmarks/data_gen_throughput.py --pair qwen2.5-coder-0.5b-1.5b \\
        --prompts builtin:mbpp --template mbpp --n 16 --batch-sizes 1,8
    python benchmarks/data_gen_throughput.py --pair qwen2.5-coder-0.5b-1.5b --random-init \\
        --device cuda --n 512 --batch-sizes 1,8,32,64,128,256
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass

import torch

from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.responses import PreparedPrompt, generate_responses
from specstop.data_gen.shard import BatchTables, label_batch
from specstop.script_args import ScriptParser, positive_int, positive_int_list, result_file, write_result
from specstop.script_main import run_main


@dataclass
class _Rec:
    prompt_id: str
    text: str
    split: str
    source_index: int
    meta: dict


def load_bench_pair(name: str, *, random_init: bool, device: str, dtype: str):
    """``tiny`` (in-memory test pair), or a pair name/folder; random weights from the configs if asked."""
    from specstop.pair import load_named_pair, pair_from_models, resolve_pair
    from specstop.pair.loader import load_tokenizer, resolve_dtype

    if name == "tiny":
        from specstop.testing import tiny_pair

        pair = tiny_pair()
        pair.draft.to(device)
        pair.target.to(device)
        return pair
    if not random_init:
        return load_named_pair(name, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    res = resolve_pair(name)
    torch_dtype = resolve_dtype(dtype, device)
    models = []
    for path in (res.draft, res.target):
        cfg = AutoConfig.from_pretrained(path)
        # Throughput does not depend on the weights: build the architecture with random init.
        models.append(AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype).to(device).eval())
    tok = load_tokenizer(res.target)
    return pair_from_models(models[0], models[1], tok, draft_name=res.draft, target_name=res.target, name=res.name)


def bench_prompts(args, tokenizer) -> list[PreparedPrompt]:
    if args.prompts:
        from specstop.prompts import PromptSetConfig, load_prompt_set, render_prompt

        recs = load_prompt_set(PromptSetConfig(source=args.prompts, template=args.template, split_scheme="all:test"))
        recs = recs[: args.n]
        return [PreparedPrompt(r, render_prompt(r.text, tokenizer, True)) for r in recs]
    base = "Write a Python function that returns the {}th Fibonacci number, with a docstring and tests."
    out = []
    for i in range(args.n):
        text = base.format(i + 3)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(PreparedPrompt(_Rec(f"b{i}", text, "test", i, {}), [int(t) for t in ids]))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generate(pair, prompts, cfg, bs, device) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for s in range(0, len(prompts), bs):
        n += sum(len(r.ids) for r in generate_responses(pair, prompts[s : s + bs], cfg.generation, 0))
    _sync(device)
    return time.perf_counter() - t0, n


def time_labels(pair, prompts, cfg, bs, device, split) -> tuple[float, int]:
    tables = BatchTables()
    t0 = time.perf_counter()
    for s in range(0, len(prompts), bs):
        label_batch(pair, prompts[s : s + bs], split, cfg, tables)
    _sync(device)
    return time.perf_counter() - t0, tables.response_tokens


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="tiny", help="'tiny', a known pair name or a pair folder")
    ap.add_argument("--prompts", help="prompt file (JSONL); default: synthetic coding prompts")
    ap.add_argument("--template", default="field:prompt", help="template for --prompts (e.g. mbpp)")
    ap.add_argument("--n", type=positive_int, default=16, help="number of prompts")
    ap.add_argument("--batch-sizes", type=positive_int_list, default="1,8")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--random-init", action="store_true", help="random weights from the pair's configs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--variants", default="labels,+hidden,+rollouts,+mixing")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="run generate and every variant this many times, interleaved; report the fastest")
    ap.add_argument("--json", type=result_file(__file__), help="also write the results here")
    args = ap.parse_args(argv)

    pair = load_bench_pair(args.pair, random_init=args.random_init, device=args.device, dtype=args.dtype)
    prompts = bench_prompts(args, pair.tokenizer)
    base = DataGenConfig()
    base.generation.max_new_tokens = args.max_new_tokens
    base.labels.rollouts.splits = []
    base.labels.mixing.splits = []
    variants = {}
    for v in args.variants.split(","):
        c = copy.deepcopy(base)
        split = "test"
        if v in ("+hidden", "+mixing"):
            c.labels.hidden_states = True
        if v == "+rollouts":
            c.labels.rollouts.splits = ["test"]
        if v == "+mixing":
            c.labels.mixing.splits = ["train"]
            split = "train"
        variants[v] = (c, split)

    # Warm up kernels / allocator once so the first timed batch size is not penalised.
    label_batch(pair, prompts[:1], "test", base, BatchTables())
    rows = []
    print(f"pair={pair.name} device={args.device} prompts={len(prompts)} max_new_tokens={args.max_new_tokens}"
          f" random_init={args.random_init}")
    print(f"{'batch':>5} {'variant':>10} {'seconds':>9} {'tokens':>7} {'tok/s':>9} {'x generate':>10}")
    for bs in args.batch_sizes:
        for c, _ in variants.values():
            c.generation.batch_size = bs
        base.generation.batch_size = bs
        # Interleaved repeats, fastest kept: other load on the machine only ever adds time.
        best: dict[str, tuple[float, int]] = {}
        for _ in range(max(1, args.repeats)):
            t, n = time_generate(pair, prompts, base, bs, args.device)
            best["generate"] = min(best.get("generate", (t, n)), (t, n))
            for v, (c, split) in variants.items():
                t, n = time_labels(pair, prompts, c, bs, args.device, split)
                best[v] = min(best.get(v, (t, n)), (t, n))
        t_gen, n_gen = best["generate"]
        rows.append({"batch_size": bs, "variant": "generate", "seconds": t_gen, "tokens": n_gen,
                     "tokens_per_s": n_gen / t_gen, "ratio": 1.0})
        print(f"{bs:>5} {'generate':>10} {t_gen:>9.2f} {n_gen:>7} {n_gen / t_gen:>9.1f} {1.0:>10.2f}")
        for v in variants:
            t, n = best[v]
            # Per-token time ratio (responses are identical for greedy, so n == n_gen).
            ratio = (t / max(n, 1)) / (t_gen / max(n_gen, 1))
            rows.append({"batch_size": bs, "variant": v, "seconds": t, "tokens": n, "tokens_per_s": n / t,
                         "ratio": ratio})
            print(f"{bs:>5} {v:>10} {t:>9.2f} {n:>7} {n / t:>9.1f} {ratio:>10.2f}")
        sys.stdout.flush()
    if args.json:
        write_result(args.json, {"args": vars(args), "results": rows}, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
