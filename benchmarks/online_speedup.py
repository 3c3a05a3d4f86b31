"""Online speedup benchmark: real decoding, side by side, repeated, with a spread (see specstop/measure/online.py).

Decoding: greedy, or sampled as --data's dataset was (its temperature / top-k / top-p), or as --temperature,
--top-k and --top-p say. Sampled runs decode repeat r with seed r in every method, time per token is pooled
over the seeds, each seed's speedup is shown as a range, and the replay of a sampled dataset (realisations
of the acceptance draws along each prompt's recorded sample) predicts tokens per round and speedup; HF's
methods run greedy only.

Methods:
    target              baseline: the target alone through our decoder's loop (max_draft=0; prefill timed)
    target (HF generate) --hf-target: the target alone through HF generate
    hf-default          --hf-default: HF assisted generation with its defaults (20 tokens, constant, confidence 0.4)
    hf-heuristic        --hf-heuristic: HF assisted generation, heuristic schedule (start 5, +2/-1)
    ... (stock)         --hf-stock: HF's defaults and the target alone on a second copy of the pair loaded
                        with plain from_pretrained (no specstop fast paths): what stock transformers gives
    ours:<policy>       our SpeculativeDecoder with each --policy (static:K, heuristic, confidence:T, an export
                        folder, or tuned:NAME for a policy of --tuned FILE, e.g. tuned:static_opt)
    ours <tree>         our TreeDecoder for --policy mcsd:K1,K2,... / tree:N[,W[,D]] (token trees; no replay;
                        with --cost each run is priced round by round: t_target(nodes) + draft forwards x t_draft)
    ours pearl[:G]      our PearlDecoder for --policy pearl / pearl:G (draft and target in parallel worker
                        processes on split cores; gamma from --cost when given, else measured); with --data and
                        --cost, PEARL's timing model on the same prompts (priced with the cost file's measured
                        core split when calibrate-cost recorded one) is its prediction
    ours pearl[:G]+<stop> --pearl-stop POLICY (repeatable): each PEARL policy again, its windows ended early by
                        POLICY (confidence:T, static:K, an export folder, or tuned:NAME for a rule of --tuned,
                        e.g. tuned:confidence_opt), on the same workers and window as plain PEARL (no prediction)
    hf+<policy>         --hf-policies: HF assisted generation driven by our policies (our hook)
    ours <policy> (live) --live: each --policy that carries price-free statistics (an export, or tuned:NAME)
                        again with live re-pricing on (specstop.decode.live_pricing: its threshold, SL_max or K
                        re-picked as the steps it times move); "ours <policy>" itself runs pinned, as tuned,
                        so the replay predicts it. The live run's switches are printed; its prediction is
                        the live one (its own rounds at the prices it paid)
    ours[int4] <policy> --draft-quant int8,int4: each rule --policy again with the draft's weights in weight-only
                        int8 / int4 (specstop.pair.quantize; the same target, in the same run), priced with
                        --quant-cost int4=COST and replayed on --quant-data int4=DATA (that draft's own
                        calibration and dataset; without them no prediction); learned exports are left out (their
                        features are the float draft's; an export trained with the int4 draft runs on it instead)
    ours[self-int4] <policy> --self-draft int4: each rule --policy again with the target quantized as its own
                        draft (specstop.pair.loader.self_draft); --quant-cost / --quant-data self-int4=...
    ours[compiled] <policy> --compile-draft: each rule --policy again (and each quantized variant, as
                        ours[int4+compiled] ...) with the draft's steps under torch.compile over a static cache;
                        priced with --quant-cost compiled=COST / int4+compiled=COST (calibrate-cost
                        --compile-draft) and replayed on the same draft's dataset
    ours[int4 / self-int4] LO/HI --multi-level LO/HI (repeatable): multi-level speculation
                        (specstop.decode.multilevel): the pair's draft in --multi-level-quant drafts for the
                        target in that scheme under policy LO, which drafts for the target under policy HI;
                        each level's tokens per round reported; with --multi-level-cost (a level_cost.json of
                        benchmarks/multi_level.py) the stack's tokens on the run's prompts are recorded first
                        and its exact replay, priced with those timings, is the prediction (greedy)

Reported per method: median over prompts of per-prompt speedups with a bootstrap 90% interval (end to
end and decode-only), tokens per round, measured seconds per round beside the cost model's
K * t_draft + t_target(K) for the same rounds (--cost), the cost model's prediction from the run's own
K histogram, the replay of the same prompts at the same budget (--data with --cost; its rounds compared
K for K with the decoder's), the eval report's whole-split replay (--replay-report, shown only), every
method against --reference paired per prompt beside the replay's paired ratio, flags where measured and
predicted differ by more than 10%, and every greedy difference from the target with its top-2 logit gap.
With --retime the drafts' steps and the target's verification are also timed between prompts
(specstop.measure.in_run_cost), every prediction is priced again with those timings, and both are shown.

Example (the reference pair, this machine's calibration, a dataset's held-out prompts):
    specstop calibrate-cost --pair qwen2.5-coder-0.5b-1.5b --data runs/quickstart/data --out cost.json
    python benchmarks/online_speedup.py --pair qwen2.5-coder-0.5b-1.5b --data runs/quickstart/data --split test \\
        --policy static:2 --policy static:4 --policy static:8 --policy runs/quickstart/export \\
        --hf-default --cost cost.json --replay-report runs/quickstart/eval/report.json --out online.json
Sampled, as a T = 1 dataset was made (configs/pipelines/sampled.yaml with --data.generation.temperature 1.0):
    python benchmarks/online_speedup.py --pair qwen2.5-coder-0.5b-1.5b --data runs/sampled_t10/data --split test \
        --repeats 3 --policy runs/sampled_t10/export --policy static:2 --cost runs/sampled_t10/cost.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specstop.script_args import (
    ScriptParser,
    existing_dir,
    existing_file,
    existing_path,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    result_file,
    unit_interval,
    write_result,
)
from specstop.script_main import run_main


def quantized_pairs(pair, schemes: str) -> list[tuple[str, object]]:
    """``(scheme, pair)`` per scheme of the comma list: the same target, a quantized copy of the draft."""
    import copy
    import dataclasses

    from specstop.pair.loader import quantize_draft
    from specstop.pair.quantize import check_scheme

    out = []
    for scheme in filter(None, (check_scheme(s) for s in schemes.split(",") if s.strip())):
        variant = dataclasses.replace(pair, draft=copy.deepcopy(pair.draft))
        record = quantize_draft(variant, scheme)
        print(f"draft in {scheme}: {record['bytes_before'] / 1e6:.0f} -> {record['bytes_after'] / 1e6:.0f} MB of linear "
              "weights")
        out.append((scheme, variant))
    return out


def self_drafts(pair, schemes: str) -> list[tuple[str, object]]:
    """``("self-SCHEME", pair)`` per scheme of the comma list: the same target, a quantized copy of it as the draft."""
    from specstop.pair.loader import self_draft
    from specstop.pair.quantize import check_scheme

    return [(f"self-{scheme}", self_draft(pair, scheme))
            for scheme in filter(None, (check_scheme(s) for s in schemes.split(",") if s.strip()))]


def multi_level_methods(pair, texts: list[str], scheme: str, quantized: list, selfs: list,
                        decoding=None, *, level_cost=None, prompts=None, max_new: int = 0) -> tuple[list, dict]:
    """One method per ``LO/HI`` of ``texts``: the pair's draft in ``scheme`` drafts (policy LO) for the target in
    ``scheme``, which drafts (policy HI) for the target; reuses the run's quantized copies when it has them.
    With ``level_cost`` (a LevelCost) and ``prompts`` (``[(name, ids)]``), greedy: the three models' tokens on
    those prompts are recorded first and each method's prediction is its exact replay priced by that cost.
    Returns the methods, ``{method name: [per-run level counters]}`` (filled as they run) and what re-pricing
    needs: ``{"records": LevelRecords or None, "combos": {method name: rules}, "scheme", "bottom", "middle"}``."""
    import dataclasses

    from specstop.decode.multilevel import MultiLevelDecoder
    from specstop.errors import UserError
    from specstop.measure import online
    from specstop.pair.quantize import check_scheme

    scheme = check_scheme(scheme)
    if scheme is None:
        raise SystemExit("--multi-level needs a --multi-level-quant scheme (int8 or int4)")
    bottom = dict(quantized).get(scheme) or quantized_pairs(pair, scheme)[0][1]
    middle = dict(selfs).get(f"self-{scheme}") or self_drafts(pair, scheme)[0][1]
    methods, levels, stacked = [], {}, {}
    stacks = []
    for text in texts:
        parts = text.split("/")
        if len(parts) != 2:
            raise SystemExit(f"--multi-level {text}: give two policies, LO/HI (the draft's for the quantized target, "
                             "then the quantized target's for the target), e.g. static:3/confidence:0.6")
        try:
            stacks.append((text, parts, MultiLevelDecoder(bottom, [middle.draft], parts, decoding)))
        except UserError as err:
            raise SystemExit(f"--multi-level {text}: {err}") from None
    records = None
    if level_cost is not None and prompts:
        records = record_stack(bottom, middle, [p for _, p, _ in stacks], level_cost, prompts, max_new)
    for text, parts, dec in stacks:
        pred = level_replay(records, parts, level_cost) if records is not None else None
        name = f"ours[{scheme} / self-{scheme}] {text}"
        fn, runs = online.decoder_method(name, dec).fn, levels.setdefault(name, [])

        def run(ids, n, seed=0, fn=fn, dec=dec, runs=runs):
            out = fn(ids, n, seed)
            runs.append(dec.last_levels)
            return dataclasses.replace(out, k_hist=None)  # a chain's K histogram would price it as one

        methods.append(online.Method(name, run, same_prompts=pred, seeded=True))
        stacked[name] = parts
    return methods, levels, {"records": records, "combos": stacked, "scheme": scheme, "bottom": bottom.draft,
                             "middle": middle.draft}


def record_stack(bottom, middle, combos: list[list[str]], level_cost, prompts, max_new: int) -> list:
    """The three models' tokens on ``prompts`` wherever ``combos``' rounds reach (LevelRecords)."""
    from specstop.decode.chain import eos_token_ids
    from specstop.measure.level_record import record_levels

    if len(level_cost.names) != 3:
        raise SystemExit(f"--multi-level-cost times a stack of {len(level_cost.names)} models; the run's has 3")
    return record_levels([bottom.draft, middle.draft, bottom.target], prompts, max_new, combos,
                         vocab_size=bottom.vocab_size, eos=eos_token_ids(bottom))


def level_replay(records: list, combo: list[str], level_cost):
    """The exact replay of the stack with ``combo`` on ``records``, priced by ``level_cost``, as the
    SamePromptsReplay an online method's prediction is."""
    from specstop.errors import UserError
    from specstop.eval.levels import replay_levels
    from specstop.eval.same_prompts import SamePromptsReplay

    try:
        rep = replay_levels(records, combo, level_cost)
    except UserError as err:
        raise SystemExit(f"--multi-level {'/'.join(combo)}: {err}") from None
    return SamePromptsReplay(rep.speedup, None, rep.tokens, rep.per_prompt, rep.tokens_per_round[-1])


def level_summary(runs: list[list[dict]]) -> str:
    """Per level (bottom up, the target last): tokens per round and seconds per forward over all runs."""
    parts = []
    for i, name in enumerate(r["name"] for r in runs[0]):
        rounds = sum(r[i]["rounds"] for r in runs)
        fwd = sum(r[i]["forwards"] for r in runs)
        secs = sum(r[i]["seconds"] for r in runs)
        if i == 0:
            parts.append(f"{name}: {fwd} forwards, {secs / max(fwd, 1):.4f} s each")
        else:
            per = (sum(r[i]["accepted"] for r in runs) + rounds) / max(rounds, 1)
            parts.append(f"{name}: {per:.2f} tokens/round, {secs / max(fwd, 1):.4f} s per forward")
    return "; ".join(parts)


def named_paths(values: list[str], flag: str, variants: list[tuple[str, object]]) -> dict[str, str]:
    """``{NAME: PATH}`` of ``NAME=PATH`` flag values; NAME must be one of the run's quantized drafts."""
    have = [name for name, _ in variants]
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise SystemExit(f"{flag} {value}: give NAME=PATH, e.g. {flag} int4=runs/quantized_int4/...")
        if name not in have:
            raise SystemExit(f"{flag} {value}: {name!r} is not a draft of this run (have: {', '.join(have) or 'none'}; "
                             "add it with --draft-quant or --self-draft)")
        out[name] = path
    return out


def dataset_prompts(data: str, split: str, limit: int | None) -> tuple[list[list[int]], int, list[str]]:
    """Rendered prompt ids of a dataset split, its max_new_tokens and the prompts' ids (names)."""
    from specstop.data_gen.storage import load_table, read_manifest

    seqs = load_table(data, "sequences", split)
    if len(seqs) == 0:
        raise SystemExit(f"{data} has no {split} prompts")
    ids = [list(r) for r in seqs["prompt_ids"]][: limit or None]
    names = [str(p) for p in seqs["prompt_id"]][: len(ids)]
    return ids, int(read_manifest(data)["generation"]["max_new_tokens"]), names


def add_prompt_flags(ap: argparse.ArgumentParser, *, data_help: str, split: str, limit: int, limit_help: str) -> None:
    """The prompt flags :func:`dataset_prompts` and :func:`text_prompts` read: --data / --split, or --prompt,
    --prompts and --field; --limit."""
    ap.add_argument("--data", type=existing_dir, help=data_help)
    ap.add_argument("--split", default=split)
    ap.add_argument("--prompt", action="append", help="a prompt text (repeatable; without --data)")
    ap.add_argument("--prompts", type=existing_file, help="prompts file: .jsonl records or .txt lines (without --data)")
    ap.add_argument("--field", default="prompt_text", help="record field holding the text")
    ap.add_argument("--limit", type=nonnegative_int, default=limit, help=f"{limit_help} (default {limit}; 0: all)")


def text_prompts(args, tokenizer) -> list[list[int]]:
    from specstop.decode.cli import render

    texts = list(args.prompt or [])
    if args.prompts:
        path = Path(args.prompts)
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line) if line.lstrip().startswith("{") else line
                texts.append(rec.get(args.field) or rec.get("text") or rec.get("prompt") if isinstance(rec, dict) else rec)
    if not texts:
        raise SystemExit("no prompts: pass --data DIR, --prompt TEXT (repeatable) or --prompts FILE (.jsonl/.txt)")
    return [render(t, tokenizer, True) for t in texts[: args.limit or None]]


def load_policy(text: str, pair, tuned: dict | None, decoding=None):
    """(display name, StoppingPolicy) for static:K / heuristic / confidence:T / an export folder / tuned:NAME;
    (text, tree shape) for mcsd:... / tree:N; (text, PEARL spec) for pearl / pearl:G. An export tuned per
    decoding setting is set to ``decoding``'s (its name says which)."""
    from specstop.decode import parse_tree_policy
    from specstop.decode.pearl_spec import parse_pearl_policy
    from specstop.errors import UserError
    from specstop.export.runtime import StoppingPolicy
    from specstop.policy import PolicySpec

    try:
        shape = parse_tree_policy(text) or parse_pearl_policy(text)
    except UserError as err:
        raise SystemExit(str(err)) from None
    if shape is not None:
        return text, shape
    if text.startswith("tuned:"):
        if tuned is None:
            raise SystemExit(f"--policy {text} needs --tuned FILE")
        name = text.split(":", 1)[1]
        if name not in tuned["policies"]:
            raise SystemExit(f"{name!r} is not in the tuned file (have: {', '.join(tuned['policies'])})")
        spec = PolicySpec.from_dict(tuned["policies"][name]["spec"])
        if spec.kind == "predictor":
            raise SystemExit(f"{name} is a learned policy: pass its export folder instead")
        stats = tuned["policies"][name].get("stats")  # live re-pricing (--live) re-picks from these
        config = {"stats": stats, "cost_model": tuned.get("cost_model")} if stats else None
        return f"{name} ({spec.label})", StoppingPolicy(spec, config=config)
    pol = StoppingPolicy.load(text, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash,
                              device=pair.draft_device)
    if decoding is not None:
        pol.configure(decoding)
    return (f"export {pol.label}" if Path(text).is_dir() else text), pol


def distinct_names(loaded: list[tuple[str, str, object]]) -> list[tuple[str, str, object]]:
    """``(text, name, policy)`` with every name unique: two exports of one tuned policy (say disco_ffn tuned
    greedy and at T = 1) get their folder after the name."""
    counts: dict[str, int] = {}
    for _, name, _ in loaded:
        counts[name] = counts.get(name, 0) + 1
    return [(text, f"{name} ({text})" if counts[name] > 1 else name, pol) for text, name, pol in loaded]


def policy_pair(text: str, pair, quantized: list[tuple[str, object]]) -> tuple[str | None, object]:
    """``(scheme, pair)`` a --policy runs on: an export trained with a quantized draft runs on the run's copy
    of the pair with that draft (--draft-quant must include its scheme); everything else on ``pair``."""
    from specstop.export.reading import export_draft_quant

    scheme = export_draft_quant(text) if Path(text).is_dir() and (Path(text) / "config.json").is_file() else None
    if scheme is None:
        return None, pair
    variants = dict(quantized)
    if scheme not in variants:
        raise SystemExit(f"--policy {text} was trained with the {scheme} draft: add --draft-quant {scheme} to run it")
    return scheme, variants[scheme]


def run_decoding(args, generation: dict | None):
    """The DecodingConfig every method decodes with: --temperature / --top-k / --top-p where given, the rest
    from the dataset's ``generation`` (its manifest's), greedy without either."""
    from specstop.errors import UserError
    from specstop.probs import DecodingConfig

    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    try:
        decoding = DecodingConfig.from_generation({**(generation or {}), **{k: v for k, v in given.items() if v is not None}})
    except UserError as err:
        raise SystemExit(f"--temperature / --top-k / --top-p: {err}") from None
    return DecodingConfig() if decoding.greedy else decoding


def in_run_timing(args, pair, cost, variant_cost: dict, variants: list, stack: dict | None, prompts: list,
                  max_new: int):
    """An InRunTiming of the target, the float draft (priced by ``cost``) and every variant with a cost model,
    plus a multi-level stack's middle model (its level cost), at ``--data``'s decoding context (calibrate-cost's),
    else at the run's prompts' mean length plus half the budget."""
    from specstop.measure.calibrate import context_from_data
    from specstop.measure.in_run_cost import InRunTiming

    drafts = {"": (pair.draft, getattr(pair, "compile_draft", False))} if cost is not None else {}
    drafts.update({n: (q.draft, getattr(q, "compile_draft", False)) for n, q in variants if n in variant_cost})
    ks = {k for c in [cost, *variant_cost.values()] if c is not None for k in (c.target_by_k or {0: 0})}
    middle, bottom_rows = None, (1,)
    if stack and stack.get("cost") is not None:
        level = stack["cost"]
        ks |= {n - 1 for n in level.forward[-1]}
        middle, bottom_rows = (stack["middle"], list(level.forward[1])), tuple(sorted(level.forward[0]))
        drafts.setdefault(stack["scheme"], (stack["bottom"], False))
    if not drafts and middle is None:
        raise SystemExit("--retime re-prices predictions: give --cost, --quant-cost or --multi-level-cost")
    if args.data:
        context, length = context_from_data(args.data)
    else:
        flat = [t for ids in prompts for t in ids]
        length = int(sum(map(len, prompts)) / len(prompts) + max_new / 2)
        context, length = (flat * (1 + length // len(flat)))[:length], length
    print(f"--retime: timing the target at K = {sorted(ks)}, drafts {', '.join(n or 'float' for n in drafts)}"
          + (" and the middle level" if middle else "") + " between prompts")
    return InRunTiming(pair.target, drafts, context[:length], [k + 1 for k in sorted(ks)], middle=middle,
                       bottom_rows=bottom_rows)


def reprice(timing, methods: list, cost, variant_cost: dict, replays: dict, stack: dict | None, split: str,
            names, max_new: int):
    """Every method's cost model and same-prompts replay priced again with ``timing``'s costs (in place);
    returns the run's re-timed cost model."""
    from specstop.eval.same_prompts import replay_policies

    timed = {who.split(":", 1)[1] for who, _ in timing.samples if who.startswith("draft:")}
    own = {n: timing.cost_for(c, n) for n, c in variant_cost.items() if n in timed}
    retimed = timing.cost_for(cost, "") if cost is not None else None
    for m in methods:
        if m.cost is not None:
            m.cost = next((own[n] for n, c in variant_cost.items() if c is m.cost and n in own), m.cost)
        if m.name in replays:
            data, pol, draft = replays[m.name]
            c = retimed if draft == "" else own.get(draft)
            if c is not None:
                m.same_prompts = replay_policies(data, split, names, max_new, {m.name: pol}, c)[m.name]
        if stack and stack.get("records") is not None and m.name in stack["combos"]:
            level = timing.level_cost_for(stack["cost"], stack["scheme"])
            m.same_prompts = level_replay(stack["records"], stack["combos"][m.name], level)
    return retimed if retimed is not None else cost


def retimed_markdown(calibrated: dict, retimed: dict) -> str:
    """Per method: measured decode speedup, its prediction by the calibrations and by the in-run timings."""
    lines = ["| method | decode speedup | predicted (calibration) | predicted (re-timed in the run) |",
             "|---|---:|---:|---:|"]
    for name, row in retimed["rows"].items():
        if row["kind"] == "baseline":
            continue
        cal = calibrated["rows"][name]
        pick = [r.get("replay_same_prompts") or r.get("predicted_decode_speedup") for r in (cal, row)]
        meas = (row.get("decode_speedup") or (None,))[0]
        cells = [f"{p:.2f}x ({100 * (meas / p - 1):+.0f}%)" if p and meas else "-" for p in pick]
        lines.append(f"| {name} | {_fmt(meas)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _fmt(x) -> str:
    return f"{x:.2f}x" if x else "-"


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True, help="known pair name or folder with draft/ and target/")
    add_prompt_flags(ap, data_help="a specstop dataset: decode its --split prompts (rendered ids) at its max_new_tokens",
                     split="test", limit=8, limit_help="prompts to use")
    ap.add_argument("--policy", action="append", default=None, help="our decoder's policies (repeatable)")
    ap.add_argument("--tuned", type=existing_file, help="tuned.json (for --policy tuned:NAME)")
    ap.add_argument("--pearl-stop", action="append", default=None, metavar="POLICY",
                    help="also run each --policy pearl[:G] with its windows ended early by this stopping policy "
                    "(confidence:T, static:K, an export folder or tuned:NAME; repeatable)")
    ap.add_argument("--hf-default", action="store_true", help="HF assisted generation with its defaults")
    ap.add_argument("--hf-heuristic", action="store_true", help="HF assisted generation, heuristic schedule")
    ap.add_argument("--hf-target", action="store_true", help="also time the target alone through HF generate")
    ap.add_argument("--hf-stock", action="store_true",
                    help="also HF's defaults and the target alone on a second copy of the pair loaded with plain "
                    "from_pretrained, without specstop's fast paths (what stock transformers users get)")
    ap.add_argument("--hf-policies", action="store_true", help="HF assisted generation driven by each --policy")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None,
                    help="default: the dataset's (--data; at most that, so the replay of the same prompts applies), else 64")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--static-cache", action="store_true", help="our decoder with a static KV cache")
    ap.add_argument("--compile", action="store_true", help="our decoder compiled (implies --static-cache)")
    ap.add_argument("--compile-draft", action="store_true",
                    help="every rule --policy (and its --draft-quant / --self-draft variants) again with the draft's "
                    "steps compiled (torch.compile over a static cache), named compiled / int4+compiled / ...; "
                    "--quant-cost int4+compiled=COST (calibrate-cost --compile-draft) prices them")
    ap.add_argument("--reference", help="one of the --policy values every other is also compared with, paired per "
                    "prompt (default: tuned:static_opt when given)")
    ap.add_argument("--replay-report", type=existing_file, help="eval report.json with the replay's predicted speedups")
    ap.add_argument("--cost", help="cost model (cost.json from `specstop calibrate-cost`, or a preset)")
    ap.add_argument("--node-head", type=existing_path, metavar="CKPT",
                    help="a tree_node_mlp checkpoint: every dynamic tree policy (tree:N) also runs grown by it")
    ap.add_argument("--draft-quant", default="", metavar="SCHEMES",
                    help="comma list of int8,int4: every rule --policy also with the draft quantized so")
    ap.add_argument("--quant-cost", action="append", default=[], metavar="NAME=COST",
                    help="the cost model of a quantized draft (NAME: int8, int4, self-int4; calibrate-cost with that "
                    "--draft-quant): its methods' rounds are priced with it (without it they are not priced)")
    ap.add_argument("--quant-data", action="append", default=[], metavar="NAME=DATA",
                    help="a dataset generated with that draft (same prompts as --data): with --quant-cost, the replay "
                    "of the same prompts is its methods' prediction")
    ap.add_argument("--self-draft", default="", metavar="SCHEMES",
                    help="comma list of int8,int4: every rule --policy also with the target quantized so as its draft")
    ap.add_argument("--multi-level", action="append", default=None, metavar="LO/HI",
                    help="multi-level speculation: the draft (policy LO) for the quantized target (policy HI) for "
                    "the target, e.g. static:3/confidence:0.6 (repeatable)")
    ap.add_argument("--multi-level-quant", default="int4", metavar="SCHEME",
                    help="the scheme of both lower levels of --multi-level (default int4)")
    ap.add_argument("--live", action="store_true",
                    help="also run each policy with price-free statistics with live re-pricing on (pinned otherwise)")
    ap.add_argument("--retime", action="store_true",
                    help="time the target's verification and every priced draft's step between prompts (at --data's "
                    "decoding context) and price the predictions with those timings too, beside the calibrations'")
    ap.add_argument("--multi-level-cost", type=existing_file, metavar="FILE",
                    help="level_cost.json of benchmarks/multi_level.py: the run records the stack's tokens on its "
                    "prompts and predicts each --multi-level run by its exact replay priced with it (greedy)")
    ap.add_argument("--temperature", type=nonnegative_float, default=None,
                    help="sampling temperature (0 = greedy); default: --data's, else greedy")
    ap.add_argument("--top-k", type=nonnegative_int, default=None, help="top-k under sampling (0 = off); default: --data's")
    ap.add_argument("--top-p", type=unit_interval, default=None, help="top-p under sampling (1 = off); default: --data's")
    ap.add_argument("--flip-epsilon", type=nonnegative_float, default=0.5, help="top-2 logit gap below which a flip is a near-tie")
    ap.add_argument("--out", type=result_file(__file__), help="write the summary (and every run) as JSON here")
    args = ap.parse_args(argv)

    import dataclasses

    from specstop.data_gen.storage import read_manifest
    from specstop.decode import TreeDecoder
    from specstop.decode.chain import SpeculativeDecoder
    from specstop.decode.node_head import load_node_head
    from specstop.decode.pearl import PearlDecoder
    from specstop.decode.pearl_spec import PearlSpec
    from specstop.decode.pearl_workers import PearlWorkers
    from specstop.errors import UserError
    from specstop.eval.cost import load_cost_model
    from specstop.eval.same_prompts import applies, replay_policies
    from specstop.export.runtime import StoppingPolicy
    from specstop.measure import online
    from specstop.pair import load_named_pair
    from specstop.tree_policy import DynamicTreeShape

    pair = load_named_pair(args.pair, dtype=args.dtype, device=args.device)
    names = None
    if args.data:
        prompts, max_new, names = dataset_prompts(args.data, args.split, args.limit)
    else:
        prompts, max_new = text_prompts(args, pair.tokenizer), 64
    max_new = args.max_new_tokens or max_new
    decoding = run_decoding(args, read_manifest(args.data)["generation"] if args.data else None)
    if not decoding.greedy:
        hf = [flag for flag in ("hf_default", "hf_heuristic", "hf_target", "hf_stock", "hf_policies") if getattr(args, flag)]
        if hf:
            raise SystemExit(f"--{hf[0].replace('_', '-')}: HF's methods here decode greedily; drop them for a sampled "
                             f"run (temperature {decoding.temperature:g}) or pass --temperature 0")
        print(f"sampled decoding: temperature {decoding.temperature:g}, top-k {decoding.top_k}, top-p "
              f"{decoding.top_p:g}; repeat r decodes with seed r")
    cost = load_cost_model(args.cost) if args.cost else None
    tuned = json.loads(Path(args.tuned).read_text()) if args.tuned else None
    replay_rows = json.loads(Path(args.replay_report).read_text()).get("rows") or {} if args.replay_report else {}
    kw = {"static_cache": args.static_cache, "compile": args.compile}
    quantized = quantized_pairs(pair, args.draft_quant)
    selfs = self_drafts(pair, args.self_draft)
    # The same drafts with their steps compiled: same tokens and acceptance, so the same datasets replay them.
    compiled = [(f"{n}+compiled" if n else "compiled", q.with_compiled_draft())
                for n, q in ([("", pair)] + quantized + selfs if args.compile_draft else [])]
    variant_cost = {n: load_cost_model(p)
                    for n, p in named_paths(args.quant_cost, "--quant-cost", [*quantized, *selfs, *compiled]).items()}
    variant_data = named_paths(args.quant_data, "--quant-data", [*quantized, *selfs])
    if args.data and compiled:
        variant_data["compiled"] = args.data
    variant_data.update({n: variant_data[n.removesuffix("+compiled")] for n, _ in compiled
                         if n.removesuffix("+compiled") in variant_data})

    def variant_method(label: str, scheme: str, qpair, pol):
        """A chain on a quantized draft's pair, priced (and replayed) with that draft's own files when given."""
        vcost = variant_cost.get(scheme)
        replay = None
        vdata = variant_data.get(scheme)
        if (vdata and vcost is not None and names is not None
                and applies(read_manifest(vdata)["generation"], max_new, decoding)):
            replay = replay_policies(vdata, args.split, names, max_new, {label: pol}, vcost)[label]
            replays[label] = (vdata, pol, scheme)
        return online.decoder_method(label, SpeculativeDecoder(qpair, pol, decoding, **kw), spec=pol.spec,
                                     cost=vcost, priced=vcost is not None, same_prompts=replay)

    replays: dict[str, tuple] = {}  # method -> (dataset, policy, draft) of its same-prompts replay, to re-price
    live_decoders: dict = {}  # --live: method -> its decoder (its switches are printed after the run)
    base = SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1"), decoding, **kw)
    methods = [online.decoder_method("target", base, max_draft=0, kind="baseline")]
    if args.hf_target:
        methods.append(online.hf_target_method("target (HF generate)", pair))
    on = {text: policy_pair(text, pair, quantized) for text in args.policy or ["static:4"]}
    loaded = distinct_names([(text, *load_policy(text, on[text][1], tuned, decoding)) for text in on])
    chains = [(text, name, pol) for text, name, pol in loaded if isinstance(pol, StoppingPolicy) and not on[text][0]]
    same = {}
    if names is not None and cost is not None and applies(read_manifest(args.data)["generation"], max_new, decoding):
        # The replay of exactly these prompts at this budget: the like-for-like prediction.
        same = replay_policies(args.data, args.split, names, max_new, {n: p for _, n, p in chains}, cost)
    ref_text = args.reference or ("tuned:static_opt" if "tuned:static_opt" in (args.policy or []) else None)
    reference = next((f"ours {name}" for text, name, _ in loaded if text == ref_text), None)
    if ref_text and reference is None:
        raise SystemExit(f"--reference {ref_text} is not one of the --policy values")
    pearl_stops = [(text, *load_policy(text, pair, tuned)) for text in args.pearl_stop or []]
    for text, _, pol in pearl_stops:
        if not isinstance(pol, StoppingPolicy):
            raise SystemExit(f"--pearl-stop {text}: give a stopping policy (confidence:T, static:K, an export folder "
                             "or tuned:NAME), not a tree or PEARL policy")
    if pearl_stops and not any(isinstance(pol, PearlSpec) for _, _, pol in loaded):
        raise SystemExit("--pearl-stop ends PEARL's windows early: add --policy pearl or --policy pearl:G")
    pearls = []
    pearl_pool = None  # one pair of workers for every PEARL method (one copy of the weights in /dev/shm)
    for text, name, pol in loaded:
        if isinstance(pol, PearlSpec):
            if pol.gamma is None and cost is not None:
                from specstop.eval.pearl import pearl_gamma

                pol = pol.with_gamma(pearl_gamma(cost))
            pearl_pool = pearl_pool or PearlWorkers(pair)
            plain = None  # plain PEARL runs first: it settles the window its stop variants share
            for stop_text, stop_name, stop_pol in [(None, None, None), *pearl_stops]:
                label = name if stop_text is None else f"{name}+{stop_name}"
                if stop_text is None:
                    spec = pol
                else:  # a folder or rule text crosses to the draft's worker as is, a tuned rule as its spec
                    tuned_rule = stop_text.startswith("tuned:") and not Path(stop_text).is_dir()
                    spec = plain.spec.with_stop(stop_pol.spec if tuned_rule else stop_text)
                try:
                    dec = PearlDecoder(pair, spec, decoding, workers=pearl_pool)
                except UserError as err:  # e.g. a heuristic schedule, which PEARL's windows cannot drive
                    raise SystemExit(f"--pearl-stop {stop_text}: {err}") from None
                pearls.append(dec.start())
                plain = plain or dec
                measured = pol.gamma is None and stop_text is None
                print(f"{label}: {dec.gamma_source if measured else f'gamma={dec.spec.gamma}'}, "
                      f"workers {dec.workers.describe()}")
                fn = online.decoder_method(f"ours {label}", dec).fn  # PEARL's phases are no chain K histogram
                pred = None
                if (stop_text is None and names is not None and cost is not None
                        and applies(read_manifest(args.data)["generation"], max_new, decoding)):
                    from specstop.eval.same_prompts import pearl_same_prompts

                    pred = pearl_same_prompts(args.data, args.split, names, max_new, cost, dec.spec.gamma)
                methods.append(online.Method(f"ours {label}",
                                             lambda ids, n, seed=0, fn=fn: dataclasses.replace(fn(ids, n, seed), k_hist=None),
                                             same_prompts=pred, seeded=True))
            continue
        if not isinstance(pol, StoppingPolicy):  # a token tree, priced round by round (no K histogram)
            methods.append(online.tree_method(f"ours {name}", TreeDecoder(pair, pol, decoding), cost=cost))
            if args.node_head and isinstance(pol, DynamicTreeShape):  # the same node budget, grown by the head
                head = load_node_head(args.node_head)
                head.check_pair(pair)
                methods.append(online.tree_method(f"ours {name}+node-head",
                                                  TreeDecoder(pair, pol, decoding, node_head=head), cost=cost))
            continue
        scheme, own = on[text]
        if scheme is not None:  # an export of a quantized draft: its own copy of the pair (no float replay applies)
            methods.append(variant_method(f"ours[{scheme}] {name}", scheme, own, pol))
            continue
        replay = None
        if replay_rows:
            from specstop.eval.report import row_key_for_policy

            # An export is replayed under its tuned policy's name, a tuned:NAME policy under NAME.
            lookup = text.split(":", 1)[1] if text.startswith("tuned:") else (pol.config.get("name") or text)
            key = row_key_for_policy(replay_rows, lookup)
            replay = replay_rows[key].get("speedup") if key else None
        dec = SpeculativeDecoder(pair, pol, decoding, live_pricing=False, **kw)
        methods.append(online.decoder_method(f"ours {name}", dec, spec=pol.spec, replay_speedup=replay,
                                             same_prompts=same.get(name)))
        if name in same:
            replays[f"ours {name}"] = (args.data, pol, "")
        if args.live and pol.stats is not None:
            import copy

            live = SpeculativeDecoder(pair, copy.deepcopy(pol), decoding, cost_model=cost, **kw)
            live_decoders[f"ours {name} (live)"] = live
            methods.append(online.decoder_method(f"ours {name} (live)", live, spec=pol.spec))
        for scheme, qpair in [*quantized, *selfs, *compiled]:
            if pol.spec.kind == "predictor" and scheme != "compiled":
                print(f"ours[{scheme}] {name}: left out (a learned policy reads the float draft's features)")
                continue
            own_pol = pol if scheme == "compiled" else StoppingPolicy.from_spec(pol.spec)  # the float draft's own
            methods.append(variant_method(f"ours[{scheme}] {name}", scheme, qpair, own_pol))
        if args.hf_policies:
            methods.append(online.hf_policy_method(f"hf+{name}", pair, pol))
    levels, stack = {}, None
    if args.multi_level:
        level_cost = None
        if args.multi_level_cost and decoding.greedy:
            from specstop.eval.levels import LevelCost

            level_cost = LevelCost.load(args.multi_level_cost)
        elif args.multi_level_cost:
            print("--multi-level-cost: the multi-level replay is greedy; sampled runs are not predicted")
        stacked, levels, stack = multi_level_methods(
            pair, args.multi_level, args.multi_level_quant, quantized, selfs, decoding, level_cost=level_cost,
            prompts=list(zip(names or map(str, range(len(prompts))), prompts)), max_new=max_new)
        methods.extend(stacked)
        stack["cost"] = level_cost
    if args.hf_default:
        methods.append(online.hf_assisted_method("hf-default", pair))
    if args.hf_stock:
        stock = online.load_stock_models(pair)
        methods.append(online.hf_assisted_method("hf-default (stock transformers)", pair, models=stock))
        methods.append(online.Method("target (stock HF generate)",
                                     lambda ids, n, t=stock[1]: online._hf_generate(pair, ids, n, target=t), "hf"))
    if args.hf_heuristic:
        methods.append(online.hf_assisted_method("hf-heuristic", pair, num_assistant_tokens=5,
                                                 schedule="heuristic", confidence=None))
    timing = None
    if args.retime:
        timing = in_run_timing(args, pair, cost, variant_cost, [*quantized, *selfs, *compiled], stack, prompts,
                               max_new)
    try:
        meas = online.measure(prompts, methods, max_new_tokens=max_new, repeats=args.repeats,
                              seeds=not decoding.greedy, between=timing.sample if timing else None)
    finally:
        for dec in pearls:
            dec.close()
        if pearl_pool is not None:
            pearl_pool.close()
    flips = online.greedy_flips(pair, prompts, meas, "target") if decoding.greedy else []
    calibrated = None
    if timing is not None:  # the calibration's predictions first, then every cost re-timed in the run
        calibrated = online.summarize(meas, methods, baseline="target", cost=cost, flips=flips, reference=reference,
                                      sampled=not decoding.greedy)
        cost = reprice(timing, methods, cost, variant_cost, replays, stack, args.split, names, max_new)
    summary = online.summarize(meas, methods, baseline="target", cost=cost, flips=flips, reference=reference,
                               sampled=not decoding.greedy)
    print()
    print(f"pair {pair.name}: {pair.target_identity.dtype} ({pair.dtype_record().get('reason')}), "
          f"device {pair.target_device}")
    if cost is not None:
        print(cost.provenance_line())
        print(f"cost model: {cost.describe()}")
    print(online.to_markdown(summary, flip_epsilon=args.flip_epsilon))
    if calibrated is not None:
        print(f"\nPredictions priced by the calibrations against priced by forwards re-timed in the run "
              f"({timing.passes} passes between prompts):\n")
        print(retimed_markdown(calibrated, summary))
    print()
    for name, r in summary["rows"].items():
        if r.get("phases_per_round"):
            ph = ", ".join(f"{k} {v:.4f}" for k, v in r["phases_per_round"].items())
            print(f"  {name}: per round (s): {ph}; drafted/round {r['drafted_per_round']:.2f}")
    for name, runs in levels.items():
        print(f"  {name}: {level_summary(runs)}")
    for name, dec in live_decoders.items():
        record = dec.live.record() if dec.live is not None else None
        if record is None:
            print(f"  {name}: live re-pricing off (no table to scale: pass --cost or use an export)")
            continue
        summary["rows"][name]["live"] = record
        scales = ", ".join(f"{k} {v:.2f}x" for k, v in record["scales"].items())
        moves = "; ".join(f"{s['from']} -> {s['to']} after {s['round']} rounds" for s in record["switches"]) or "none"
        print(f"  {name}: live prices {scales} the table's; policy now {record['policy']}; switches: {moves}")
    if args.out:
        doc = {"args": vars(args), "pair": pair.to_dict(), "cost": cost.to_dict() if cost else None,
               "calibrated_summary": calibrated,
               "decoding": dataclasses.asdict(decoding), "summary": summary, "levels": levels,
               "runs": {m: [[r.__dict__ for r in rs] for rs in runs] for m, runs in meas.runs.items()}}
        write_result(args.out, doc, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
