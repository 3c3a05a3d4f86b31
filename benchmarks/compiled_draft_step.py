"""Does a compiled draft step pay on this CPU? One-token decode steps, eager against ``torch.compile``.

By default the chain decoder steps the draft eagerly with a DynamicCache: every step launches every
layer's kernels from Python (``compile_draft`` / ``--compile-draft`` runs it compiled instead). This
script times the same one-token steps two ways, on one model of a pair (the draft, or the
target as its own draft), optionally with its linear layers in weight-only int8/int4
(:func:`specstop.pair.quantize.quantize_weights`):

* **eager**: ``model(token, past_key_values=DynamicCache)``, as the decoders run it by default;
* **compiled**: the forward under ``torch.compile(dynamic=False)`` over a ``StaticCache`` (fixed shapes, so
  one graph serves every step), the launch overhead the compiler can remove.

Each repeat prefills ``--context`` random tokens, then decodes ``--steps`` greedy tokens; the two ways
alternate within every repeat (the first alternating), after one untimed warm-up each (the compile).
Medians over repeats with min-max, and compiled / eager side by side.

    python benchmarks/compiled_draft_step.py --pair qwen2.5-coder-0.5b-1.5b --quant none,int4 --steps 24 --repeats 5

Found on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX), torch 2.13.0, bf16, 100 tokens of context, per
step eager / compiled: the reference draft 73.7 / 65.7 ms (0.891), int8 43.0 / 37.2 ms (0.864), int4
26.1 / 21.0 ms (0.802); the target as its own draft 175 / 166 ms (0.947), int4 58.0 / 51.8 ms (0.894);
28-39 s to compile, the same greedy tokens. docs/results/quantized_drafts.md has what that is worth.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specstop.script_args import ScriptParser, positive_int, result_file, write_result
from specstop.script_main import run_main


def _time_steps(step, prefill, steps: int) -> tuple[float, list[int]]:
    """(seconds per step, the tokens) over ``steps`` greedy one-token steps after a prefill."""
    token = prefill()
    tokens = []
    t0 = time.perf_counter()
    for i in range(steps):
        token = step(token, i)
        tokens.append(token)
    seconds = (time.perf_counter() - t0) / steps
    return seconds, [int(t) for t in tokens]


def measure(model, *, context: int, steps: int, repeats: int, vocab: int) -> dict:
    """``{"eager": [s, ...], "compiled": [s, ...], "compile_s": s, "same_tokens": bool}``: seconds per step, one
    entry per repeat, and whether both ways decoded the same greedy tokens."""
    import torch
    from transformers import DynamicCache, StaticCache

    prompt = torch.randint(min(100, vocab - 1), vocab, (1, context), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(context)
    state: dict = {}
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 1)

    def prefill_eager():
        state["cache"] = DynamicCache()
        return model(prompt, past_key_values=state["cache"], use_cache=True).logits[:, -1:].argmax(-1)

    def step_eager(token, i):
        return model(token, past_key_values=state["cache"], use_cache=True).logits[:, -1:].argmax(-1)

    def forward_static(token, position):
        return model(token, past_key_values=cache, cache_position=position, use_cache=True).logits

    compiled = torch.compile(forward_static, dynamic=False)

    def prefill_static():
        cache.reset()
        return forward_static(prompt, positions)[:, -1:].argmax(-1)

    def step_compiled(token, i):
        return compiled(token, torch.tensor([context + i]))[:, -1:].argmax(-1)

    ways = {"eager": (step_eager, prefill_eager), "compiled": (step_compiled, prefill_static)}
    out: dict = {name: [] for name in ways}
    tokens: dict = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        _time_steps(step_compiled, prefill_static, 2)  # the compile
        out["compile_s"] = time.perf_counter() - t0
        _time_steps(step_eager, prefill_eager, 2)
        for rep in range(repeats):
            for name in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
                seconds, tokens[name] = _time_steps(*ways[name], steps)
                out[name].append(seconds)
    out["same_tokens"] = tokens["eager"] == tokens["compiled"]
    return out


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    ap.add_argument("--model", choices=("draft", "target"), default="draft",
                    help="which model of the pair steps (target: the target as its own draft)")
    ap.add_argument("--quant", default="none", help="comma list of none, int8, int4 (weight-only linear layers)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=positive_int, default=100, help="prefill tokens before the steps")
    ap.add_argument("--steps", type=positive_int, default=24, help="one-token steps per repeat")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed repeats of each way, alternating")
    ap.add_argument("--json", type=result_file(__file__), default=None, help="write the measurements here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from specstop.pair.hardware import cpu_flags, cpu_model_name
    from specstop.pair.quantize import check_scheme, quantize_weights
    from specstop.pair.registry import resolve_pair

    schemes = [s.strip() for s in args.quant.split(",") if s.strip()]
    for s in schemes:
        if s != "none":
            check_scheme(s)
    resolved = resolve_pair(args.pair)
    folder = resolved.draft if args.model == "draft" else resolved.target
    flags = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    print(f"{cpu_model_name()} ({', '.join(flags)}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model} {folder}, {args.dtype}, context {args.context}, {args.steps} steps x {args.repeats} repeats")
    results = {}
    for scheme in schemes:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
        if scheme != "none":
            quantize_weights(model, scheme)
        m = measure(model, context=args.context, steps=args.steps, repeats=args.repeats, vocab=model.config.vocab_size)
        eager, comp = statistics.median(m["eager"]), statistics.median(m["compiled"])
        results[scheme] = {**m, "eager_median_s": eager, "compiled_median_s": comp, "compiled_over_eager": comp / eager}
        print(f"{scheme}: eager {eager * 1e3:.2f} ms [{min(m['eager']) * 1e3:.2f}-{max(m['eager']) * 1e3:.2f}], "
              f"compiled {comp * 1e3:.2f} ms [{min(m['compiled']) * 1e3:.2f}-{max(m['compiled']) * 1e3:.2f}] per step: "
              f"compiled / eager {comp / eager:.3f} (compile {m['compile_s']:.0f} s); same greedy tokens: "
              f"{'yes' if m['same_tokens'] else 'no'}", flush=True)
        del model
    if args.json:
        write_result(args.json, {"args": vars(args), "cpu": cpu_model_name(), "results": results}, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
