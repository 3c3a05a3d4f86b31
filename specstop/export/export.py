"""Package a trained, tuned stopping policy as a self-describing folder decoders load.

``DIR/config.json`` (schema below), ``DIR/model.safetensors`` (learned policies only),
``DIR/README.md`` (model card with Hub metadata as YAML front matter) and
``DIR/custom_generate/generate.py`` (transformers' ``generate(custom_generate=DIR)`` entry point), so
the folder is a Hub model repository (``StoppingPolicy.push_to_hub`` uploads it). The export checks itself: it reloads DIR through the runtime and
compares the predictor's outputs with the checkpoint's on a batch of features.

config.json (schema version 1)::

    format, model_type, schema_version, specstop_version, created, name
    policy:     PolicySpec dict (kind, threshold, sl_max, rule, family, reads, ...)
    predictor:  {family, config, label, num_parameters, weights, dtype} | null
    features:   FeatureSpec dict (kind, k, use_position, position_scale, hidden_size, hidden_layer) | null
    decoding:   {temperature, top_k, top_p} the labels were made at | null
    cost_model: the CostModel dict used for tuning | null
    validation: the tuner's validation metrics for this policy | null
    pair:       {name, draft: ModelIdentity, target: ModelIdentity, tokenizer_hash}
    source:     {checkpoint, tuned, dataset}
    export_check: {batch, max_abs_diff}
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from specstop import __version__
from specstop.config_io import read_json, resolve_tuned_paths
from specstop.errors import MissingInputError, UserError
from specstop.export.hub import MODEL_TYPE, front_matter, write_custom_generate
from specstop.export.runtime import CONFIG_NAME, EXPORT_FORMAT, SCHEMA_VERSION, WEIGHTS_NAME, StoppingPolicy
from specstop.models import StoppingPredictor, build_predictor
from specstop.pair.identity import check_same_pair
from specstop.policy import PolicySpec

log = logging.getLogger(__name__)

__all__ = [
    "ExportError", "export_config", "export_policy", "load_checkpoint", "read_tuned", "validate_export",
    "write_export_folder",
]

MAX_EXPORT_DIFF = 1e-6


class ExportError(UserError):
    """The inputs cannot make a valid export (the message says what to fix)."""


# ---------------------------------------------------------------------- inputs
def load_checkpoint(path: str | Path) -> tuple[StoppingPredictor, dict]:
    """``(predictor, meta)`` from a Lightning checkpoint, without importing Lightning.

    Uses ``specstop.models.checkpoint.load_predictor`` when available; otherwise reads the Lightning
    layout itself (``hyper_parameters`` with family / predictor_config / label; weights under
    ``predictor.``).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"checkpoint {path} does not exist (train one with `specstop train`)")
    try:
        from specstop.models.checkpoint import load_predictor
    except ImportError:
        load_predictor = None
    if load_predictor is not None:
        predictor, meta = load_predictor(path)
        return predictor, dict(meta or {})
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    hp = dict(ckpt.get("hyper_parameters") or {})
    if "family" not in hp or "predictor_config" not in hp:
        raise ExportError(
            f"{path} is not a specstop predictor checkpoint: hyper_parameters lack 'family'/'predictor_config'"
        )
    predictor = build_predictor(hp["family"], **hp["predictor_config"])
    sd = {k[len("predictor.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("predictor.")}
    predictor.load_state_dict(sd, strict=True)
    predictor.eval()
    return predictor, hp


def read_tuned(path: str | Path) -> dict:
    """Read a tuned-policy file (design.md "Tuned-policy files")."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"tuned-policy file {path} does not exist (write one with `specstop tune`)")
    tuned = read_json(path, "tuned-policy file")
    if not isinstance(tuned, dict) or tuned.get("schema_version") != 1 or not isinstance(tuned.get("policies"), dict):
        raise ExportError(
            f"{path}: not a tuned-policy file of schema version 1 (found schema_version="
            f"{tuned.get('schema_version')!r}); rerun `specstop tune` with this specstop version"
        )
    return resolve_tuned_paths(tuned, path)


def _read_manifest(dataset: str | Path | None) -> dict | None:
    if not dataset:
        return None
    p = Path(dataset) / "manifest.json"
    if not p.is_file():
        log.warning("dataset %s has no manifest.json; pair identities must come from the checkpoint", dataset)
        return None
    man = read_json(p, "dataset manifest")
    return man if isinstance(man, dict) else None


def _pair_info(meta: dict, manifest: dict | None) -> dict | None:
    for src in (meta.get("pair"), (meta.get("manifest") or {}).get("pair"), (manifest or {}).get("pair")):
        if src and src.get("draft"):
            return {k: src.get(k) for k in ("name", "draft", "target", "tokenizer_hash", "vocab")}
    return None


def _decoding_info(meta: dict, manifest: dict | None) -> dict | None:
    gen = meta.get("generation") or (meta.get("manifest") or {}).get("generation") or (manifest or {}).get("generation")
    if not gen:
        return None
    return {"temperature": gen.get("temperature"), "top_k": gen.get("top_k"), "top_p": gen.get("top_p")}


# ---------------------------------------------------------------------- validation
@torch.no_grad()
def _feature_batch(predictor: StoppingPredictor, batch: int, seed: int = 0) -> torch.Tensor:
    """A realistic ``[batch, input_dim]`` input: hidden-like Gaussians, or features of random distributions."""
    g = torch.Generator().manual_seed(seed)
    fs = predictor.feature_spec
    if fs.reads_hidden:
        return torch.randn(batch, fs.hidden_size, generator=g) * 2.0
    vocab = max(64, fs.k * 4)
    probs = torch.softmax(torch.randn(batch, vocab, generator=g) * 3.0, dim=-1)
    positions = torch.randint(0, 2048, (batch,), generator=g)
    state = torch.randn(batch, fs.hidden_size, generator=g) * 2.0 if fs.reads_state else None
    return fs.build_from_probs(probs, positions, state)


@torch.no_grad()
def validate_export(out: str | Path, predictor: StoppingPredictor, batch: int = 256) -> float:
    """Reload ``out`` through the runtime; return the max abs difference of the predictor logits.

    Raises:
        ExportError: the difference exceeds 1e-6 or the decisions differ.
    """
    policy = StoppingPolicy.from_pretrained(out)
    x = _feature_batch(predictor, batch)
    ref = predictor.float().eval()(x)
    got = policy.predictor(x)
    diff = float((ref - got).abs().max())
    if diff > MAX_EXPORT_DIFF:
        raise ExportError(
            f"export check failed: reloaded predictor differs from the checkpoint by {diff:.3g} (> {MAX_EXPORT_DIFF}); "
            "the weights or architecture arguments were not written faithfully"
        )
    return diff


# ---------------------------------------------------------------------- writing
def export_policy(
    out: str | Path,
    *,
    spec: PolicySpec,
    predictor: StoppingPredictor | None = None,
    name: str | None = None,
    pair: dict | None = None,
    decoding: dict | None = None,
    cost_model: dict | None = None,
    validation: dict | None = None,
    label: str | None = None,
    source: dict | None = None,
    allow_missing_pair: bool = False,
    overwrite: bool = False,
) -> dict:
    """Write an export folder and validate it. Returns the written config.

    The export is written and validated in a temporary folder next to ``out`` and renamed into
    place only when complete, so a failed export never leaves a half-written folder, and an
    existing export is replaced only after the new one passed its check.

    Args:
        out: the folder to create; an existing non-empty one is replaced only with ``overwrite``.
        spec: the tuned policy spec.
        predictor: the trained module (``predictor`` policies only).
        pair: ``{name, draft, target, tokenizer_hash}`` identities (runtime refuses other drafts).
        decoding: the decoding transform the labels were made at.
        allow_missing_pair: write an export without pair identities (the runtime can then not
            refuse a wrong draft; only for tests and demos).
        overwrite: replace an existing non-empty ``out``.

    Raises:
        ExportError: inconsistent inputs, or ``out`` exists and is not empty (without ``overwrite``).
    """
    if spec.kind == "predictor" and predictor is None:
        raise ExportError(f"policy {spec.label} is a learned predictor: give its --checkpoint")
    if spec.kind != "predictor" and predictor is not None:
        raise ExportError(f"policy {spec.label} is not a learned predictor: drop --checkpoint")
    if spec.kind in ("oracle", "pearl"):
        raise ExportError(f"policy kind {spec.kind!r} is a replay-only baseline; it cannot be exported for decoders")
    if predictor is not None:
        if spec.family and spec.family != predictor.family:
            raise ExportError(
                f"the tuned policy is for family {spec.family!r} but the checkpoint holds {predictor.family!r}: "
                "pass the checkpoint that was tuned (tuned.json 'checkpoints')"
            )
        if spec.reads != predictor.feature_spec.kind:
            raise ExportError(f"policy spec reads {spec.reads!r} but {predictor.family} reads {predictor.feature_spec.kind!r}")
    if pair is None and not allow_missing_pair:
        raise ExportError(
            "no draft/target identities found in the checkpoint or the tuned file's dataset manifest; "
            "pass --data DIR (the dataset the predictor was trained on) so the export records its pair"
        )
    config = export_config(
        spec, predictor, name=name, pair=pair, decoding=decoding, cost_model=cost_model, validation=validation,
        label=label, source=source,
    )
    final = Path(out)
    check_export_target(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        # custom_generate/generate.py names the folder it will live in, not the temporary one.
        config = write_export_folder(tmp, config, predictor, location=str(final.resolve()))
        _replace_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config


def is_export_folder(folder: Path) -> bool:
    """Did ``specstop export`` write ``folder``? Its ``config.json`` names our format, and it holds
    nothing but the files an export writes (a folder with the user's own files is never replaced)."""
    config = folder / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        doc = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        return False
    ours = {CONFIG_NAME, WEIGHTS_NAME, "README.md", "custom_generate", ".gitattributes"}
    ours |= {f"{engine}.json" for engine in ("hf", "vllm", "llamacpp", "sglang")}
    return all(p.name in ours for p in folder.iterdir())


def check_export_target(final: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds something else than an earlier export (before any work).

    Raises:
        ExportError: ``final`` is a file, a non-empty folder without ``overwrite``, or a folder
            specstop did not write (even with ``overwrite``: it would delete the user's files).
    """
    from specstop.outputs import check_writable

    if final.exists() and not final.is_dir():
        raise ExportError(f"--out {final} is a file; give a folder path for the export")
    if final.is_dir() and any(final.iterdir()):
        if not is_export_folder(final):
            raise ExportError(
                f"--out {final} holds files that are not a specstop export (no export config.json, or other "
                "files beside it); --overwrite only replaces an earlier export. Choose another --out (or an empty folder)"
            )
        if not overwrite:
            raise ExportError(
                f"{final} already exists and is not empty; pass --overwrite to replace it (the old export is kept "
                "until the new one has passed its check), or choose another --out"
            )
    check_writable(final.parent if final.exists() else final, "--out")


def _replace_folder(new: Path, final: Path) -> None:
    """Move the finished folder ``new`` to ``final``; an old ``final`` is removed only afterwards."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(new, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


def write_export_folder(
    out: str | Path, config: dict, predictor: StoppingPredictor | None = None, *, location: str | None = None
) -> dict:
    """Write ``config.json``, ``model.safetensors``, the model card and ``custom_generate/``; validate.

    Args:
        out: the folder (created; existing export files in it are overwritten).
        config: the export config (:func:`export_config`, or a loaded export's).
        predictor: the learned predictor, None for rule-only policies.
        location: where ``custom_generate/generate.py`` finds this policy (default: ``out``'s absolute
            path; ``push_to_hub`` writes the repo id).

    Returns:
        The written config (with ``export_check`` filled for learned policies).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "model_type": MODEL_TYPE}
    if config.get("predictor"):  # the weights are always written under their standard name
        config["predictor"] = {**config["predictor"], "weights": WEIGHTS_NAME}
    weights = out / WEIGHTS_NAME
    if predictor is not None:
        from safetensors.torch import save_file

        predictor = predictor.float().eval()
        state = {k: v.detach().cpu().contiguous() for k, v in predictor.state_dict().items()}
        save_file(state, str(weights), metadata={"format": "pt", "family": predictor.family})
    elif weights.exists():
        weights.unlink()  # a stale predictor from an earlier export must not sit next to a rule-only config
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    if predictor is not None:
        diff = validate_export(out, predictor)
        config["export_check"] = {"batch": 256, "max_abs_diff": diff}
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    else:
        StoppingPolicy.from_pretrained(out)  # the config must at least load
    write_custom_generate(out, location or str(out.resolve()))
    (out / "README.md").write_text(front_matter(config) + model_card(config))
    return config


def export_from_files(
    out: str | Path,
    *,
    tuned: str | Path,
    checkpoint: str | Path | None = None,
    policy: str | None = None,
    dataset: str | Path | None = None,
    allow_missing_pair: bool = False,
    overwrite: bool = False,
) -> dict:
    """The CLI's work: pick a policy from ``tuned``, load its checkpoint, export."""
    t = read_tuned(tuned)
    name = policy or t.get("best")
    if not name:
        raise ExportError(f"{tuned} names no 'best' policy: pass --policy NAME (one of {sorted(t['policies'])})")
    if name not in t["policies"]:
        raise ExportError(f"policy {name!r} is not in {tuned}; choose from {sorted(t['policies'])}")
    entry = t["policies"][name]
    try:
        spec = PolicySpec.from_dict((entry or {}).get("spec") if isinstance(entry, dict) else entry)
    except UserError as err:
        raise ExportError(f"{tuned}: policy {name!r}: {err}") from None
    predictor, meta = None, {}
    if spec.kind == "predictor":
        ckpt = checkpoint or (t.get("checkpoints") or {}).get(name)
        if not ckpt:
            raise ExportError(f"policy {name!r} is a learned predictor: pass --checkpoint (tuned.json lists none for it)")
        checkpoint = ckpt
        predictor, meta = load_checkpoint(ckpt)
    elif checkpoint:
        raise ExportError(f"policy {name!r} ({spec.label}) is not a learned predictor: drop --checkpoint")
    # The checkpoint records its dataset as a summary dict (with data_dir); tuned.json as a path.
    ckpt_ds = meta.get("dataset")
    if isinstance(ckpt_ds, dict):
        ckpt_ds = ckpt_ds.get("data_dir")
    ds = dataset or ckpt_ds or t.get("dataset")
    manifest = _read_manifest(ds)
    ckpt_pair = (meta.get("dataset") or {}).get("pair") if isinstance(meta.get("dataset"), dict) else None
    try:
        check_same_pair(
            ckpt_pair, (manifest or {}).get("pair"),
            what=f"checkpoint {checkpoint} was trained on data from another model pair than {ds} holds",
            fix="pass the --data the predictor was trained on (or retrain it on this pair's data)",
        )
    except UserError as err:
        raise ExportError(str(err)) from None
    return export_policy(
        out,
        spec=spec,
        predictor=predictor,
        name=name,
        pair=_pair_info(meta, manifest),
        decoding=_decoding_info(meta, manifest),
        cost_model=t.get("cost_model"),
        validation=entry.get("validation"),
        label=meta.get("label"),
        source={"checkpoint": str(checkpoint) if checkpoint else None, "tuned": str(tuned), "dataset": str(ds) if ds else None},
        allow_missing_pair=allow_missing_pair,
        overwrite=overwrite,
    )


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
        "from specstop.export.runtime import StoppingPolicy",
        "policy = StoppingPolicy.from_pretrained(REPO_OR_DIR, draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)",
        "policy.start_sequence()            # each new sequence",
        "policy.reset()                     # each round",
        "stop = policy.should_stop(draft_logits, draft_hidden_prev, position)",
        "policy.end_round(num_drafted, num_accepted)",
        "```",
        "",
        "or `specstop decode --pair PAIR --policy DIR --prompt TEXT`. `specstop export --for hf|vllm|llamacpp|sglang`",
        "writes the tuned settings other engines accept.",
        "",
        "The runtime imports only torch and safetensors. It refuses a different draft model or tokenizer",
        "(override: `allow_draft_mismatch=True`) and unknown schema versions. Decoding with this policy is",
        "lossless: the policy changes only how many tokens are drafted, never which tokens are emitted.",
        "",
    ]
    return "\n".join(lines)
