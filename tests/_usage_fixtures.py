"""The files the docs' and artifacts' usage lines read, built for the tiny pair saved on disk.

:func:`usage_fixtures` writes, under one folder: a dataset manifest naming the pair, a disco_ffn
checkpoint, a tree node-head checkpoint, a cost model, and a ``tuned.json`` holding every kind of
tuned entry the exporters read (static / heuristic / confidence rules, a learned predictor, a token
tree, a batch schedule); then an export of the learned policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specstop.policy import PolicySpec

#: A tuned batch schedule (K per batch size, one with a threshold): the engine files' schedule forms.
BATCH_SCHEDULE = {
    "format": 1,
    "cost_model": "cost.json",
    "entries": [
        {"batch_size": 1, "k": 3, "predicted_speedup": 1.3, "predicted_speedup_by_k": {"0": 1.0, "3": 1.3},
         "threshold": {"threshold": 0.5, "sl_max": 6, "predicted_speedup": 1.35}},
        {"batch_size": 4, "k": 2, "predicted_speedup": 1.1, "predicted_speedup_by_k": {"0": 1.0, "2": 1.1},
         "threshold": None},
    ],
}


@dataclass
class UsageFixtures:
    pair_dir: Path
    dataset: Path  # a manifest naming the pair (what tuned.json's "dataset" points to)
    checkpoint: Path  # disco_ffn
    node_head: Path  # tree_node_mlp
    cost: Path
    tuned: Path
    export: Path  # the learned policy, exported


def _validation(speedup: float) -> dict:
    return {"speedup": speedup, "latency_per_token": 0.03 / speedup, "tokens_per_round": 2.0}


def usage_fixtures(root: Path, pair_dir: Path) -> UsageFixtures:
    """Build every fixture under ``root`` for the pair saved at ``pair_dir``."""
    import torch
    from _export_fixtures import write_checkpoint

    from specstop.eval.cost import PRESETS
    from specstop.export.export import export_from_files
    from specstop.models import build_predictor
    from specstop.models.checkpoint import save_predictor_checkpoint
    from specstop.pair import load_named_pair

    root.mkdir(parents=True, exist_ok=True)
    pair = load_named_pair(str(pair_dir), dtype="float32", device="cpu")
    dataset = root / "data"
    dataset.mkdir()
    manifest = {"schema_version": 1, "pair": pair.to_dict(),
                "generation": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 64}}
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    checkpoint = root / "disco.ckpt"
    write_checkpoint(checkpoint, "disco_ffn", label="accept_expected", seed=1)
    torch.manual_seed(0)
    node_head = save_predictor_checkpoint(root / "head.ckpt", build_predictor("tree_node_mlp", k=4, width=8))
    cost = root / "cost.json"
    PRESETS["reference-cpu"].save(cost)
    specs = {
        "static_opt": (PolicySpec(kind="static", k=3), 1.30),
        "heuristic_opt": (PolicySpec(kind="heuristic", start=3), 1.25),
        "confidence_opt": (PolicySpec(kind="confidence", threshold=0.4, sl_max=6), 1.40),
        "disco_ffn": (PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5, sl_max=6, reads="dist",
                                 extra={"scores": "disco_ffn", "checkpoint": "disco_ffn"}), 1.50),
    }
    # Price-free statistics (specstop.eval.price_free) of two candidates for the learned policy and K = 1..4
    # for the static one: what live re-pricing and `tune --reprice` re-pick from.
    stats = {
        "disco_ffn": _stats([({"threshold": 0.5, "sl_max": 6, "rule": "below"}, [0, 2, 3, 4, 3, 2, 6]),
                             ({"threshold": 0.9, "sl_max": 2, "rule": "below"}, [0, 20, 15])]),
        "static_opt": _stats([({"k": k}, [0] * k + [100 // (k + 1)]) for k in (3, 1, 2, 4)]),
    }
    tuned = {
        "schema_version": 1,
        "policies": {n: {"spec": s.to_dict(), "validation": _validation(v), **({"stats": stats[n]} if n in stats else {})}
                     for n, (s, v) in specs.items()},
        "tree_policies": {"tree_opt": {"spec": {"kind": "tree", "policy": "mcsd:2,1"},
                                       "validation": {**_validation(1.45), "exact": True}}},
        "best": "disco_ffn",
        "cost_model": json.loads(cost.read_text()),
        "dataset": str(dataset),
        "split": "validation",
        "checkpoints": {"disco_ffn": str(checkpoint)},
        "batch_schedule": BATCH_SCHEDULE,
    }
    tuned_path = root / "tuned.json"
    tuned_path.write_text(json.dumps(tuned, indent=2))
    export = root / "export"
    export_from_files(export, tuned=tuned_path, policy="disco_ffn")
    return UsageFixtures(pair_dir, dataset, checkpoint, node_head, cost, tuned_path, export)


def _stats(candidates: list[tuple[dict, list[int]]]) -> dict:
    """Price-free statistics of ``(params, k_hist)`` candidates, the first one tuned (half the drafts accepted)."""
    out = []
    for params, hist in candidates:
        drafted = sum(k * h for k, h in enumerate(hist))
        out.append({"params": params, "rounds": sum(hist), "drafted": drafted, "accepted": drafted // 2,
                    "target_only": hist[0], "unproposed": 0, "k_hist": hist})
    return {"format": 1, "n": 100, "prompts": 4, "chosen": 0, "candidates": out}


def reader_namespace(pair) -> dict:
    """The names snippets leave to the reader, bound for ``pair`` (a loaded tiny pair).

    ``pair``, its ``target`` and ``draft`` models, a ``tokenizer``; a prompt as ``inputs`` (what the
    tokenizer returns), ``input_ids`` and ``prompt_ids`` (three more as ``prompt_ids_a/b/c``, row
    ``b``); ``decoding`` and ``vocab_size``; and one drafting step's values for the runtime loops:
    ``draft_logits``, ``draft_hidden`` / ``draft_hidden_prev``, ``position``, ``cap``, ``pick``,
    ``num_drafted``, ``num_accepted``.
    """
    import torch

    from specstop.decode.cli import render
    from specstop.probs import DecodingConfig

    prompt_ids = render("Reverse a string in Python.", pair.tokenizer, True)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = pair.draft(input_ids, output_hidden_states=True)
    return {
        "pair": pair, "target": pair.target, "draft": pair.draft, "tokenizer": pair.tokenizer,
        "inputs": {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
        "input_ids": input_ids, "prompt_ids": prompt_ids,
        "prompt_ids_a": prompt_ids, "prompt_ids_b": render("hello", pair.tokenizer, True),
        "prompt_ids_c": render("def f(x):", pair.tokenizer, True), "b": 1,
        "decoding": DecodingConfig(temperature=0.0), "vocab_size": pair.vocab_size,
        "draft_logits": out.logits[0, -1], "draft_hidden": out.hidden_states[-1][0, -1],
        "draft_hidden_prev": out.hidden_states[-1][0, -1], "position": 0, "cap": 4,
        "pick": lambda logits: int(logits.argmax()), "num_drafted": 2, "num_accepted": 1,
    }
