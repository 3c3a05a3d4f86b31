"""The pipeline's closing check: real decoding of held-out prompts beside the replay's predictions."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from specstop.jsonio import atomic_write_json
from specstop.pipeline.config import PipelineConfig

log = logging.getLogger("specstop")


def online_check(cfg: PipelineConfig, data_dir: Path, export_dir: Path, tuned_path: Path, report_path: Path,
                 cost_arg: str, out_path: Path) -> dict:
    """Real decoding of the first test prompts (:mod:`specstop.measure.online`): the exported policy, Static
    SL-opt, the tuned confidence policy and HF's default assisted generation against the target alone;
    measured speedups beside the cost model's and the replay's predictions; greedy outputs checked."""
    import gc

    from specstop.data_gen.storage import load_table, read_manifest
    from specstop.decode.chain import SpeculativeDecoder
    from specstop.eval.cost import load_cost_model
    from specstop.eval.report import row_key_for_policy
    from specstop.eval.same_prompts import applies as same_prompts_apply
    from specstop.eval.same_prompts import replay_policies
    from specstop.export.runtime import StoppingPolicy
    from specstop.measure import online
    from specstop.measure.online_budget import size_online_check
    from specstop.pair.registry import load_named_pair
    from specstop.policy import PolicySpec
    from specstop.probs import DecodingConfig

    split = "test"
    seqs = load_table(data_dir, "sequences", split)
    if len(seqs) == 0:
        split, seqs = None, load_table(data_dir, "sequences")
    prompts = [list(seqs[i]["prompt_ids"]) for i in range(min(cfg.online_prompts, len(seqs)))]
    gen = read_manifest(data_dir)["generation"]
    max_new = cfg.online_max_new_tokens or int(gen["max_new_tokens"])
    tuned = json.loads(Path(tuned_path).read_text())
    rows = json.loads(Path(report_path).read_text()).get("rows") or {} if Path(report_path).is_file() else {}
    cost = load_cost_model(cost_arg)
    # Expected speedups for the estimate: the replay's for the tuned methods, 1 for the rest.
    expected = [1.0, replay_speedup_of(rows, str(tuned.get("best")))]
    expected += [replay_speedup_of(rows, n) for n in ("static_opt", "confidence_opt") if n in tuned.get("policies", {})]
    hf_default = bool(cfg.online_hf_default and not float(gen.get("temperature") or 0.0))
    expected += [1.0] * int(hf_default)
    size = size_online_check(cost, [len(p) for p in prompts], max_new_tokens=max_new, repeats=cfg.online_repeats,
                             speedups=expected, budget_s=cfg.online_budget, optional=int(hf_default))
    hf_default = hf_default and size.methods == len(expected)  # the optional comparison, dropped to fit
    log.info("%s", size.line())
    prompts, max_new = prompts[: size.prompts], size.max_new_tokens
    prompt_names = [str(seqs[i]["prompt_id"]) for i in range(len(prompts))]
    pair = load_named_pair(cfg.pair, draft=cfg.draft, target=cfg.target, dtype=cfg.dtype, device=cfg.device,
                           draft_quant=cfg.draft_quant)
    # Decode as the dataset describes: greedy, or sampled at its temperature / top-k / top-p (then the
    # outputs are samples, so the token-for-token check against the target does not apply, and each
    # repeat samples with its own seed).
    decoding = DecodingConfig.from_generation(gen)
    greedy = decoding

    def replay_of(name: str) -> float | None:
        key = row_key_for_policy(rows, name)
        return rows[key].get("speedup") if key else None

    export = StoppingPolicy.from_pretrained(str(export_dir), draft_identity=pair.draft_identity,
                                            tokenizer_hash=pair.tokenizer_hash, device=pair.draft_device)
    policies = {f"export {export.label}": (export, export.config.get("name") or "")}
    for name in ("static_opt", "confidence_opt"):
        if name in tuned.get("policies", {}) and name != export.config.get("name"):
            spec = PolicySpec.from_dict(tuned["policies"][name]["spec"])
            policies[f"{name} ({spec.label})"] = (StoppingPolicy.from_spec(spec), name)
    same = {}
    if split is not None and same_prompts_apply(gen, max_new):
        # The like-for-like prediction: the replay of exactly these prompts at this budget (sampled data:
        # its realisations of the acceptance draws along each prompt's recorded sample).
        same = replay_policies(data_dir, split, prompt_names, max_new, {k: p for k, (p, _) in policies.items()}, cost)
    methods = [online.decoder_method("target", SpeculativeDecoder(pair, StoppingPolicy.from_string("static:1"), greedy),
                                     max_draft=0, kind="baseline")]
    for label, (pol, tuned_name) in policies.items():
        # Pinned: the replay predicts the tuned policies themselves (live re-pricing is measured by
        # benchmarks/online_speedup.py beside the pinned policy).
        dec = SpeculativeDecoder(pair, pol, greedy, live_pricing=False)
        methods.append(online.decoder_method(label, dec, spec=pol.spec,
                                             replay_speedup=replay_of(tuned_name), same_prompts=same.get(label)))
    if hf_default:
        methods.append(online.hf_assisted_method("HF assisted (defaults)", pair))
    meas = online.measure(prompts, methods, max_new_tokens=max_new, repeats=cfg.online_repeats,
                          seeds=not decoding.greedy)
    flips = online.greedy_flips(pair, prompts, meas, "target") if decoding.greedy else []
    static = next((m.name for m in methods if m.name.startswith("static_opt")), None)
    summary = online.summarize(meas, methods, baseline="target", cost=cost, flips=flips,
                               sampled=not decoding.greedy, reference=static)
    summary.update({"policy": str(export_dir), "dtype": pair.dtype_record(), "cost_model": cost.name,
                    "size": {**asdict(size), "line": size.line()},
                    "cost_provenance": cost.provenance_line(),
                    "markdown": f"{size.line()}\n\n{online.to_markdown(summary)}"})
    atomic_write_json(out_path, summary)
    del pair, methods
    gc.collect()
    bad = [f for f in flips if f["top2_gap"] >= 0.5 or pair_dtype_is_float32(summary)]
    if bad:
        raise RuntimeError(f"online check: speculative output differs from the target's greedy output beyond "
                           f"near-ties ({len(bad)} case(s)), see {out_path}")
    return {"online": str(out_path)}


def replay_speedup_of(rows: dict, name: str) -> float:
    """The eval report's replayed speedup of tuned policy ``name`` (1.0 when it has none)."""
    from specstop.eval.report import row_key_for_policy

    key = row_key_for_policy(rows, name) if rows else None
    return float(rows[key].get("speedup") or 1.0) if key else 1.0


def pair_dtype_is_float32(summary: dict) -> bool:
    """In float32 verification and single steps agree exactly, so any greedy flip is a bug."""
    return (summary.get("dtype") or {}).get("dtype") == "float32"
