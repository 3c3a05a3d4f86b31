"""The export folder format: its file names, ``config.json``, and writing the files.

One home for what an export *is*, imported by both sides: :mod:`specstop.export.export` builds and
validates exports from training outputs, :mod:`specstop.export.runtime` loads them (and saves a
loaded policy back). This module imports neither.

Layout::

    EXPORT/
      config.json              the policy, the predictor's family and features, pair, decoding, costs
      model.safetensors        the predictor weights (absent for rule-only policies)
      node_head.safetensors    a token-tree export's node head (when it has one)
      README.md                model card (Hub metadata in its front matter)
      custom_generate/         transformers' generate(custom_generate=...) entry point
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specstop import __version__
from specstop.export.hub import MODEL_TYPE, front_matter, write_custom_generate

if TYPE_CHECKING:
    from specstop.models import StoppingPredictor
    from specstop.policy import PolicySpec

SCHEMA_VERSION = 1
EXPORT_FORMAT = "specstop-stopping-policy"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# A token-tree export (config "tree": {"policy": "mcsd:..." | "tree:N,W,D", "node_head": predictor entry | null})
# keeps a learned node head's weights here; "policy" stays a chain policy for chain-only consumers.
NODE_HEAD_NAME = "node_head.safetensors"


#: Files ``specstop export`` writes into a folder: the export itself and ``--for`` engine settings
#: (``<engine>.json`` and their side files). Anything else in a folder is the user's.
EXPORT_FILE_PATTERNS = (
    CONFIG_NAME, WEIGHTS_NAME, NODE_HEAD_NAME, "README.md", "custom_generate", ".gitattributes",
    "hf.json", "vllm.json", "llamacpp.json", "sglang.json", "trtllm.json", "trtllm_*.yaml", "sglang_adaptive.json",
)


def is_export_file(name: str) -> bool:
    """True for a file or folder name :data:`EXPORT_FILE_PATTERNS` covers."""
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for pattern in EXPORT_FILE_PATTERNS)


def export_config(
    spec: PolicySpec,
    predictor: StoppingPredictor | None = None,
    *,
    name: str | None = None,
    pair: dict | None = None,
    decoding: dict | None = None,
    cost_model: dict | None = None,
    validation: dict | None = None,
    label: str | None = None,
    source: dict | None = None,
    stats: dict | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of an export (schema in the module docstring)."""
    config: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "model_type": MODEL_TYPE,
        "schema_version": SCHEMA_VERSION,
        "specstop_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "name": name or spec.label,
        "policy": spec.to_dict(),
        "predictor": None,
        "features": None,
        "decoding": decoding,
        "cost_model": cost_model,
        "validation": validation,
        "pair": pair,
        "source": source or {},
        "export_check": None,
    }
    if stats:
        config["stats"] = stats
    if predictor is not None:
        config["predictor"] = {
            "family": predictor.family,
            "config": predictor.config_dict(),
            "label": label,
            "num_parameters": int(sum(p.numel() for p in predictor.parameters())),
            "weights": WEIGHTS_NAME,
            "dtype": "float32",
        }
        config["features"] = predictor.feature_spec.to_dict()
    return config


def write_export_files(
    out: str | Path, config: dict, predictor: StoppingPredictor | None = None, *,
    node_head: StoppingPredictor | None = None, after_weights=None,
) -> dict:
    """Write every file of an export folder.

    Args:
        out: the folder (created; existing export files in it are overwritten).
        config: the export config (:func:`export_config`, or a loaded export's).
        predictor: the learned predictor, None for rule-only policies.
        node_head: a token-tree export's node head (config ``tree.node_head``), written as
            ``node_head.safetensors``.
        after_weights: called as ``after_weights(out, config) -> config`` once the weights and
            ``config.json`` are written and before the model card, which shows what it adds (the
            exporter's check that the written weights reproduce the predictor).

    Returns:
        The written config.
    """
    from safetensors.torch import save_file

    from specstop.outputs import default_file_mode

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "model_type": MODEL_TYPE}
    if config.get("predictor"):  # the weights are always written under their standard name
        config["predictor"] = {**config["predictor"], "weights": WEIGHTS_NAME}
    weights = out / WEIGHTS_NAME
    if predictor is not None:
        predictor = predictor.float().eval()
        state = {k: v.detach().cpu().contiguous() for k, v in predictor.state_dict().items()}
        save_file(state, str(weights), metadata={"format": "pt", "family": predictor.family})
        default_file_mode(weights)
    elif weights.exists():
        weights.unlink()  # a stale predictor from an earlier export must not sit next to a rule-only config
    if node_head is not None:
        state = {k: v.detach().cpu().float().contiguous() for k, v in node_head.state_dict().items()}
        save_file(state, str(out / NODE_HEAD_NAME), metadata={"format": "pt", "family": node_head.family})
        default_file_mode(out / NODE_HEAD_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    if after_weights is not None:
        config = after_weights(out, config)
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    write_custom_generate(out)
    (out / "README.md").write_text(front_matter(config) + model_card(config))
    return config


def model_card(config: dict) -> str:
    """The README.md written next to config.json."""
    spec = config["policy"]
    pred = config.get("predictor")
    pair = config.get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path", "unknown")
    target = (pair.get("target") or {}).get("name_or_path", "unknown")
    lines = [
        f"# specstop stopping policy: {config['name']}",
        "",
        "A speculative-decoding stopping policy exported by "
        f"[specstop](https://example.invalid/specstop) {config['specstop_version']} on {config['created']}.",
        "It decides after each drafted token whether to stop drafting and let the target verify.",
        "",
        "| field | value |",
        "|---|---|",
        f"| policy | `{spec['kind']}` (rule `{spec['rule']}`, threshold {spec['threshold']}, SL_max {spec['sl_max']}) |",
        f"| draft | `{draft}` |",
        f"| target | `{target}` |",
        f"| tokenizer hash | `{pair.get('tokenizer_hash')}` |",
        f"| label decoding | `{json.dumps(config.get('decoding'))}` |",
    ]
    if config.get("tree"):
        tree = config["tree"]
        lines += [f"| token tree | `{tree['policy']}`{' steered by a node head' if tree.get('node_head') else ''} "
                  "(`specstop decode --pair PAIR --policy DIR --prompt TEXT` runs the tree decoder; `policy` is the chain "
                  "fallback) |"]
    if pred:
        lines += [
            f"| family | `{pred['family']}` ({pred['num_parameters']} parameters, label `{pred['label']}`) |",
            f"| features | `{json.dumps(config.get('features'))}` |",
            f"| export check | max abs diff {config['export_check']['max_abs_diff']:.3g} on {config['export_check']['batch']} inputs |",
        ]
    lines += [
        f"| cost model | `{json.dumps(config.get('cost_model'))}` |",
        f"| validation | `{json.dumps(config.get('validation'))}` |",
        "",
        "## Use",
        "",
        "With transformers (assisted generation; the policy decides each round's draft length):",
        "",
        "```python",
        "out = target.generate(**inputs, assistant_model=draft, custom_generate=REPO_OR_DIR,",
        "                      trust_remote_code=True, max_new_tokens=128)",
        "```",
        "",
        "In your own decoding loop:",
        "",
        "```python",
        "from specstop import StoppingPolicy",
        "policy = StoppingPolicy.from_pretrained(REPO_OR_DIR, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)",
        "policy.start_sequence()            # each new sequence",
        "policy.reset()                     # each round",
        "stop = policy.should_stop(draft_logits, draft_hidden_prev, position)",
        "policy.end_round(num_drafted, num_accepted)",
        "```",
        "",
        "or `specstop decode --pair PAIR --policy DIR --prompt TEXT`.",
        "`specstop export --tuned TUNED --out OUT --for hf,vllm,llamacpp,sglang,trtllm` writes the tuned settings",
        "other engines accept (TUNED: the tuned.json that specstop tune wrote).",
        "",
        "The runtime imports only torch and safetensors. It refuses a different draft model or tokenizer",
        "(override: `allow_draft_mismatch=True`) and unknown schema versions. Decoding with this policy is",
        "lossless: the policy changes only how many tokens are drafted, never which tokens are emitted.",
        "",
    ]
    return "\n".join(lines)
