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
        help="static:K | heuristic[:START] | confidence[:TAU] | an export folder (default static:4); token trees: "
        "mcsd:K1,K2,... (MCSD k-config, e.g. mcsd:4,2,2,1) | tree:N[,WIDTH[,DEPTH]] (best-first tree of N nodes); "
        "parallel: pearl (window round(t_target / t_draft)) | pearl:GAMMA; an export of a tuned token tree "
        "(specstop export --policy tree_opt) runs the tree decoder",
    )
    parser.add_argument(
        "--node-head", default=None, metavar="CKPT",
        help="tree:N only: grow the tree by this tree_node_mlp checkpoint's predicted path acceptance "
        "instead of the joint draft probability (still lossless)",
    )
    parser.add_argument(
        "--target-init", type=int, default=None, metavar="T",
        help="NOT LOSSLESS (changes the output, greedy included, for T >= 2): improved MCSD's target-initialized "
        "multi-candidate generation - each round starts from T tokens of the target's distribution and emits the "
        "one whose drafted continuation is accepted longest; mcsd:K1,K2,... policies only (T=1 is lossless)",
    )
    parser.add_argument(
        "--cost-model", default=None,
        help="pearl: take the window from this cost model (preset or cost.json from calibrate-cost); "
        "default: a quick measurement on the workers' cores",
    )
    parser.add_argument("--pearl-cores", default=None, metavar="D,T",
                        help="pearl on CPU: D cores for the draft, T for the target (default: a quarter for the draft)")
    parser.add_argument("--pearl-no-pre-verify", action="store_true", help="pearl ablation: no pre-verify")
    parser.add_argument("--pearl-no-post-verify", action="store_true", help="pearl ablation: no post-verify")
    parser.add_argument(
        "--stop", default=None, metavar="POLICY",
        help="pearl: end each window early when this stopping policy says stop (confidence:TAU | static:K | an "
        "export folder); the rest of the window is not drafted, acceptance is unchanged (still lossless)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 disables")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--json", action="store_true", help="print one JSON line: token ids, text, counters, timings")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as is")
    parser.add_argument("--system-prompt", default=None, help="system message for the chat template")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (the pair's fastest on this machine, timed once and cached)")
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
    from specstop.decode import TreeDecoder, parse_tree_policy
    from specstop.export.decoder import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy, check_policy_inputs
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig

    check_range("--max-new-tokens", args.max_new_tokens, low=1)
    shape = parse_tree_policy(args.policy)  # before loading models: a malformed spec fails at once
    pearl = _pearl_options(args)
    exported = _tree_export(args.policy)  # an export folder of a tuned token tree
    if exported is not None:
        shape = parse_tree_policy(exported[0])
    node_head = _node_head(args, shape)
    if getattr(args, "target_init", None) is not None:
        from specstop.decode.tree_shape import StaticTreeShape

        if not isinstance(shape, StaticTreeShape):
            raise UserError(f"--target-init grows a static k-config below the target's tokens; use --policy "
                            f"mcsd:K1,K2,... (got {args.policy!r}) or drop --target-init")
        check_range("--target-init", args.target_init, low=1)
        if args.target_init >= 2:
            print(f"--target-init {args.target_init}: target-initialized generation is NOT lossless - the output can "
                  "differ from the target's own", file=sys.stderr)
    if exported is not None and exported[1] is not None:
        if node_head is not None:
            raise UserError(f"{args.policy} carries its own node head; drop --node-head")
        node_head = exported[1]
    if (shape is not None or pearl is not None) and (args.static_cache or args.compile):
        flag = "--compile" if args.compile else "--static-cache"
        kind = "tree" if shape is not None else "parallel"
        raise UserError(f"{flag} is for chain policies; {kind} policy {args.policy} runs on a dynamic KV cache - drop {flag}")
    decoding = DecodingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise UserError("--prompt is empty; give the text to continue ('-' reads it from stdin)")
    pair = load_named_pair(args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device)
    from specstop.pair.context import check_fits

    if pearl is not None:
        decoder = _pearl_decoder(pair, decoding, *pearl, allow_draft_mismatch=args.allow_draft_mismatch)
    elif shape is not None:
        if node_head is not None:
            node_head.check_pair(pair)
        decoder = TreeDecoder(pair, shape, decoding, node_head=node_head, target_init=args.target_init)
    else:
        policy = StoppingPolicy.load(
            args.policy,
            draft_identity=pair.draft_identity,
            tokenizer_hash=pair.tokenizer_hash,
            allow_draft_mismatch=args.allow_draft_mismatch,
            device=pair.draft_device,
        )
        check_policy_inputs(policy, pair.draft_identity.hidden_size, args.policy)
        decoder = SpeculativeDecoder(pair, policy, decoding, static_cache=args.static_cache, compile=args.compile)
    prompt_ids = render(text, pair.tokenizer, not args.no_chat_template, args.system_prompt)
    check_fits(
        pair, len(prompt_ids) + args.max_new_tokens,
        f"the prompt ({len(prompt_ids)} tokens) plus --max-new-tokens {args.max_new_tokens}",
        "shorten the prompt or lower --max-new-tokens",
    )
    try:
        if pearl is not None:
            print(decoder.start().gamma_source, file=sys.stderr)  # the window and where it came from
        result = decoder.generate(prompt_ids, args.max_new_tokens, seed=args.seed)
    finally:
        if pearl is not None:
            decoder.close()  # the worker processes end here (generate ends them itself on errors)
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


def _tree_export(policy: str):
    """``(tree policy text, node head or None)`` when ``policy`` is an export folder of a token tree, else None."""
    from pathlib import Path

    if not Path(policy).is_dir():
        return None
    from specstop.export.runtime import load_tree_export

    return load_tree_export(policy)


def _node_head(args: argparse.Namespace, shape):
    """The ``--node-head`` scorer (None without the flag); refused in one line for other policies."""
    if getattr(args, "node_head", None) is None:
        return None
    from specstop.decode.tree_shape import DynamicTreeShape

    if not isinstance(shape, DynamicTreeShape):
        raise UserError(f"--node-head steers dynamic trees; use --policy tree:N (got {args.policy!r}) or drop --node-head")
    from specstop.decode.node_head import load_node_head

    return load_node_head(args.node_head)


def _pearl_options(args: argparse.Namespace):
    """``(spec, cores, cost)`` for ``--policy pearl[:GAMMA]`` (None for other policies), every problem a
    one-line error before any model is loaded."""
    from specstop.decode.pearl_spec import PearlSpec, parse_pearl_policy, split_cores

    spec = parse_pearl_policy(args.policy)
    pearl_flags = [f for f, on in (("--pearl-cores", args.pearl_cores is not None),
                                   ("--pearl-no-pre-verify", args.pearl_no_pre_verify),
                                   ("--pearl-no-post-verify", args.pearl_no_post_verify),
                                   ("--stop", args.stop is not None),
                                   ("--cost-model", args.cost_model is not None)) if on]
    if spec is None:
        if pearl_flags:
            raise UserError(f"{pearl_flags[0]} is read by --policy pearl only; drop it or use --policy pearl")
        return None
    if spec.gamma is not None and args.cost_model is not None:
        raise UserError(f"--policy {args.policy} fixes the window; drop --cost-model or use --policy pearl")
    stop = args.stop
    if stop is not None:
        from specstop.decode.pearl_server import load_stop_policy

        # The form now (a malformed rule, a heuristic); the export's draft check once the pair is loaded.
        load_stop_policy(stop, allow_draft_mismatch=True)
    spec = PearlSpec(spec.gamma, not args.pearl_no_pre_verify, not args.pearl_no_post_verify, stop=stop)
    cost = None
    if args.cost_model is not None:
        from specstop.eval.tune_cli import load_cost_model_arg

        cost = load_cost_model_arg(args.cost_model)
    import torch

    on_cuda = str(args.device).startswith("cuda") if args.device else torch.cuda.is_available()
    cores = None if on_cuda else split_cores(args.pearl_cores)  # CUDA runs the models on streams/devices
    return spec, cores, cost


def _pearl_decoder(pair, decoding, spec, cores, cost, *, allow_draft_mismatch: bool = False):
    """The PEARL decoder (workers not started yet); ``gamma_source`` says where its window comes from."""
    from specstop.decode.pearl import PearlDecoder

    line = None
    if cost is not None:
        from specstop.eval.pearl import pearl_gamma

        spec = spec.with_gamma(pearl_gamma(cost))
        line = (f"PEARL window gamma={spec.gamma} = round(t_target {cost.single_step * 1e3:.1f} ms / t_draft "
                f"{cost.draft_step * 1e3:.1f} ms) from cost model {cost.name}")
    elif spec.gamma is not None:
        line = f"PEARL window gamma={spec.gamma} as given"
    decoder = PearlDecoder(pair, spec, decoding, cores=cores, allow_draft_mismatch=allow_draft_mismatch)
    decoder.gamma_source = line  # None: measured when the workers start
    return decoder
