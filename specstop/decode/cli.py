"""``specstop decode``: lossless speculative decoding of one prompt with any stopping policy."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from specstop.config_cli import TypedCommand, setting
from specstop.config_io import check_range
from specstop.errors import UserError
from specstop.pair.settings import PairSettings


@dataclass
class DecodeSettings(PairSettings):
    """What `specstop decode` runs: the pair, the prompt, the policy and how tokens are drawn."""

    prompt: str | None = setting(None, flags=("--prompt",))
    """The prompt text ('-' reads stdin)."""
    policy: str = setting("static:4", flags=("--policy",))
    """static:K | heuristic[:START] | confidence[:TAU] | an export folder | a hub id OWNER/NAME (an export
    pushed to the Hub; read from the Hugging Face cache when offline); token trees: mcsd:K1,K2,... (MCSD
    k-config, e.g. mcsd:4,2,2,1) | tree:N[,WIDTH[,DEPTH]] (best-first tree of N nodes); parallel: pearl
    (window round(t_target / t_draft)) | pearl:GAMMA; an export of a tuned token tree (specstop export
    --policy tree_opt), local or on the Hub, runs the tree decoder with its node head."""
    node_head: str | None = setting(None, flags=("--node-head",), metavar="CKPT")
    """tree:N only: grow the tree by this tree_node_mlp checkpoint's predicted path acceptance instead
    of the joint draft probability (still lossless)."""
    target_init: int | None = setting(None, flags=("--target-init",), metavar="T")
    """NOT LOSSLESS (changes the output, greedy included, for T >= 2): improved MCSD's
    target-initialized multi-candidate generation - each round starts from T tokens of the target's
    distribution and emits the one whose drafted continuation is accepted longest; mcsd:K1,K2,...
    policies only (T=1 is lossless)."""
    cost_model: str | None = setting(None, flags=("--cost-model",))
    """pearl: take the window from this cost model (preset or cost.json from calibrate-cost); null = a
    quick measurement on the workers' cores. A chain policy with price-free statistics (an export): the
    table live re-pricing scales (null = the export's own)."""
    pin_policy: bool = setting(False, flags=("--pin-policy",), negatable=False)
    """Run the policy exactly as exported: no live re-pricing of its threshold, SL_max or K from the step
    costs this run measures (live re-pricing is lossless either way)."""
    pearl_cores: str | None = setting(None, flags=("--pearl-cores",), metavar="D,T")
    """pearl on CPU: D cores for the draft, T for the target; null = a quarter for the draft."""
    pearl_no_pre_verify: bool = setting(False, flags=("--pearl-no-pre-verify",), negatable=False)
    """pearl ablation: no pre-verify."""
    pearl_no_post_verify: bool = setting(False, flags=("--pearl-no-post-verify",), negatable=False)
    """pearl ablation: no post-verify."""
    stop: str | None = setting(None, flags=("--stop",), metavar="POLICY")
    """pearl: end each window early when this stopping policy says stop (confidence:TAU | static:K |
    an export folder | a hub id OWNER/NAME); the rest of the window is not drafted, acceptance is unchanged (still lossless)."""
    max_new_tokens: int = setting(256, flags=("--max-new-tokens",))
    """Tokens to generate at most."""
    temperature: float = setting(0.0, flags=("--temperature",))
    """Sampling temperature; 0 = greedy."""
    top_k: int = setting(0, flags=("--top-k",))
    """Sampling: keep the k most likely tokens (0 disables)."""
    top_p: float = setting(1.0, flags=("--top-p",))
    """Sampling: nucleus mass (1.0 disables)."""
    seed: int = setting(0, flags=("--seed",))
    """Seed for sampling (draft samples, acceptance draws, resampling): the same seed gives the same output."""
    chat_template: bool = setting(True, flags=("--chat-template",))
    """Render the prompt with the tokenizer's chat template (--no-chat-template feeds it as is)."""
    system_prompt: str | None = setting(None, flags=("--system-prompt",))
    """System message for the chat template."""
    static_cache: bool = setting(False, flags=("--static-cache",))
    """Use a static KV cache (CUDA regime)."""
    compile: bool = setting(False, flags=("--compile",))
    """torch.compile both models (implies --static-cache)."""
    compile_draft: bool = setting(False, flags=("--compile-draft",))
    """torch.compile the draft's steps alone, over a static cache (a CPU's one-token draft steps lose
    most to kernel launches; benchmarks/compiled_draft_step.py measures whether it pays); the first
    request pays the compile."""
    allow_draft_mismatch: bool = setting(False, flags=("--allow-draft-mismatch",))
    """Load an export made for another draft/tokenizer."""
    levels: str | None = setting(None, flags=("--levels",), metavar="MODELS")
    """Multi-level speculation: the models between the draft and the target, smallest first, as a comma
    list (local folders or hub ids); --policy then gives one rule per gap, bottom first (e.g.
    static:2,static:6), or an export of a stack tuned by `specstop tune --levels` (whose models this
    replaces)."""


def command() -> TypedCommand:
    """The parser: every :class:`DecodeSettings` setting and ``--json``."""
    cmd = TypedCommand(DecodeSettings, prog="specstop decode",
                       description="lossless speculative decoding of one prompt with any stopping policy")
    cmd.add_argument("--json", action="store_true", help="print one JSON line: token ids, text, counters, timings")
    return cmd


def main(argv: list[str]) -> int:
    args, flags = command().parse(argv)
    if args.prompt is None:
        raise UserError("no prompt: pass --prompt TEXT ('-' reads it from stdin)")
    return run(args, as_json=flags.json)


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


def run(args: DecodeSettings, as_json: bool = False) -> int:
    from specstop.decode import TreeDecoder, parse_tree_policy
    from specstop.decode.chain import SpeculativeDecoder
    from specstop.export.runtime import StoppingPolicy
    from specstop.pair import load_named_pair
    from specstop.probs import DecodingConfig

    check_range("--max-new-tokens", args.max_new_tokens, low=1)
    shape = parse_tree_policy(args.policy)  # before loading models: a malformed spec fails at once
    pearl = _pearl_options(args)
    source = _export_folder(args.policy)  # an export folder, or a hub id's download in the HF cache
    from specstop.decode.levels_cli import stack_decoder, stack_request

    stack = stack_request(args, source)  # (models, rules) of a multi-level stack, else None
    if shape is None and pearl is None and source is None and stack is None:
        _check_policy_text(args.policy)  # before loading models
    exported = _tree_export(source)  # a tuned token tree (and its node head), else None
    if exported is not None:
        shape = parse_tree_policy(exported[0])
    node_head = _node_head(args, shape)
    if getattr(args, "target_init", None) is not None:
        from specstop.tree_policy import StaticTreeShape

        if not isinstance(shape, StaticTreeShape):
            raise UserError(f"--target-init grows a static k-config below the target's tokens; use --policy "
                            f"mcsd:K1,K2,... (got {args.policy!r}) or drop --target-init")
        check_range("--target-init", args.target_init, low=1)
    if exported is not None and exported[1] is not None:
        if node_head is not None:
            raise UserError(f"{args.policy} carries its own node head; drop --node-head")
        node_head = exported[1]
    if (shape is not None or pearl is not None) and (args.static_cache or args.compile or args.compile_draft):
        flag = "--compile" if args.compile else "--compile-draft" if args.compile_draft else "--static-cache"
        kind = "tree" if shape is not None else "parallel"
        raise UserError(f"{flag} is for chain policies; {kind} policy {args.policy} runs on a dynamic KV cache - drop {flag}")
    decoding = DecodingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    text = _read_stdin() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise UserError("--prompt is empty; give the text to continue ('-' reads it from stdin)")
    pair = load_named_pair(args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device,
                           draft_quant=args.draft_quant)
    from specstop.pair.context import check_fits

    if stack is not None:
        decoder = stack_decoder(pair, *stack, decoding)
    elif pearl is not None:
        decoder = _pearl_decoder(pair, decoding, *pearl, allow_draft_mismatch=args.allow_draft_mismatch)
    elif shape is not None:
        if node_head is not None:
            node_head.check_pair(pair)
        decoder = TreeDecoder(pair, shape, decoding, node_head=node_head, target_init=args.target_init)
        if (args.target_init or 0) >= 2:  # once the decoder has accepted T (it is at most the vocabulary)
            print(f"--target-init {args.target_init}: target-initialized generation is NOT lossless - the output can "
                  "differ from the target's own", file=sys.stderr)
    else:
        policy = StoppingPolicy.for_pair(str(source or args.policy), pair,
                                         allow_draft_mismatch=args.allow_draft_mismatch)
        cost = None
        if args.cost_model and not args.pin_policy:
            from specstop.eval.cost import load_cost_model

            try:
                cost = load_cost_model(args.cost_model)
            except (ValueError, TypeError) as err:
                raise UserError(f"--cost-model {args.cost_model}: {err}") from None
        decoder = SpeculativeDecoder(pair, policy, decoding, static_cache=args.static_cache, compile=args.compile,
                                     compile_draft=args.compile_draft, live_pricing=not args.pin_policy,
                                     cost_model=cost)
    prompt_ids = render(text, pair.tokenizer, args.chat_template, args.system_prompt)
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
    if as_json:
        print(json.dumps({"prompt_ids": prompt_ids, **result.to_dict()}))
    else:
        print(result.text)
        c, t = result.counters, result.timings
        print(
            f"[{c['policy']}] N={c['N']} N_target={c['N_target']} N_draft={c['N_draft']} "
            f"N_discarded={c['N_discarded']} {c['N'] / max(t['total'], 1e-9):.1f} tok/s",
            file=sys.stderr,
        )
        live = getattr(result, "live", None)
        if live:
            scales = ", ".join(f"{k} {v:.2f}x" for k, v in live["scales"].items())
            print(f"[live pricing] steps against the cost table: {scales}; {len(live['switches'])} re-pick(s); "
                  f"policy now {live['policy']} (--pin-policy keeps the exported one)", file=sys.stderr)
    return 0


def _read_stdin() -> str:
    """The prompt from stdin (``--prompt -``): UTF-8 text, or one line saying it is not."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"--prompt -: stdin is not UTF-8 text ({err.reason} at byte {err.start}); pipe the prompt as "
                        "UTF-8 (e.g. iconv -t UTF-8) or pass --prompt TEXT") from None


def _export_folder(policy: str):
    """The export folder ``--policy`` names: a local folder as is, a hub id (``owner/name``) downloaded into
    (or, offline, read from) the Hugging Face cache; None for policy texts (rules, trees, pearl)."""
    from pathlib import Path

    from specstop.export.hub import names_hub_repo, resolve_folder

    if Path(policy).is_dir():
        return Path(policy)
    return resolve_folder(policy) if names_hub_repo(policy) else None


def _check_policy_text(policy: str) -> None:
    """A chain rule's text, checked; an unknown one is refused naming every form decode runs."""
    from specstop.policy import CHAIN_POLICY_FORMS, parse_policy_string

    try:
        parse_policy_string(policy)
    except UserError as err:
        if not str(err).startswith("unknown policy"):
            raise
        raise UserError(f"unknown policy {policy!r}: use {CHAIN_POLICY_FORMS}; token trees mcsd:K1,K2,... or "
                        "tree:N[,WIDTH[,DEPTH]]; parallel pearl[:GAMMA]") from None


def _tree_export(folder):
    """``(tree policy text, node head or None)`` when ``folder`` is an export of a token tree, else None."""
    if folder is None:
        return None
    from specstop.decode.node_head import load_tree_export

    return load_tree_export(folder)


def _node_head(args: DecodeSettings, shape):
    """The ``--node-head`` scorer (None without the flag); refused in one line for other policies."""
    if getattr(args, "node_head", None) is None:
        return None
    from specstop.tree_policy import DynamicTreeShape

    if not isinstance(shape, DynamicTreeShape):
        raise UserError(f"--node-head steers dynamic trees; use --policy tree:N (got {args.policy!r}) or drop --node-head")
    from specstop.decode.node_head import load_node_head

    return load_node_head(args.node_head)


def _pearl_options(args: DecodeSettings):
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
