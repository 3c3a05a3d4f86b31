"""``specstop decode``: lossless speculative decoding of one prompt with any stopping policy."""

from __future__ import annotations

import argparse
import json
import sys

from specstop.config_io import check_range
from specstop.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", help="known pair name or a folder with draft/ and target/")
    parser.add_argument("--draft", help="draft model folder or hub id (with --target, instead of --pair)")
    parser.add_argument("--target", help="target model folder or hub id")
    parser.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    parser.add_argument(
        "--policy",
        default="static:4",
        help="static:K | heuristic[:START] | confidence[:TAU] | an export folder (default static:4)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 disables")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--json", action="store_true", help="print one JSON line: token ids, text, counters, timings")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as is")
    parser.add_argument("--system-prompt", default=None, help="system message for the chat template")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--static-cache", action="store_true", help="use a static KV cache (CUDA regime)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models (implies --static-cache)")
    parser.add_argument(
        "--allow-draft-mismatch", action="store_true", help="load an export made for another draft/tokenizer"
    )


def render(text: str, tokenizer, chat_template: bool, system_prompt: str | None = None) -> list[int]:
    """Prompt ids via specstop.prompts.render_prompt (falls back to the chat template directly)."""
    try:
        from specstop.prompts import render_prompt
    except ImportError:  # pragma: no cover - the prompts package is optional for the decoder
        render_prompt = None
    if render_prompt is not None:
        return render_prompt(text, tokenizer, chat_template, system_prompt)
    if not chat_template:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def run(args: argparse.Namespace) -> int:
    from specstop.export.decoder import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig

    check_range("--max-new-tokens", args.max_new_tokens, low=1)
    decoding = DecodingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise UserError("--prompt is empty; give the text to continue ('-' reads it from stdin)")
    pair = load_named_pair(args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device)
    policy = StoppingPolicy.load(
        args.policy,
        draft_identity=pair.draft_identity,
        tokenizer_hash=pair.tokenizer_hash,
        allow_draft_mismatch=args.allow_draft_mismatch,
        device=pair.draft_device,
    )
    decoder = SpeculativeDecoder(pair, policy, decoding, static_cache=args.static_cache, compile=args.compile)
    prompt_ids = render(text, pair.tokenizer, not args.no_chat_template, args.system_prompt)
    result = decoder.generate(prompt_ids, args.max_new_tokens, seed=args.seed)
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, **result.to_dict()}))
    else:
        print(result.text)
        c, t = result.counters, result.timings
        print(
            f"[{c['policy']}] N={c['N']} N_target={c['N_target']} N_draft={c['N_draft']} "
            f"N_discarded={c['N_discarded']} {c['N'] / max(t['total'], 1e-9):.1f} tok/s",
            file=sys.stderr,
        )
    return 0
