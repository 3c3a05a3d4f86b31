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
    tree:       {policy: "mcsd:..." | "tree:N,W,D", node_head: {family, config, weights} | null} (token-tree
                exports only; ``policy`` above is then the tuned chain fallback for chain-only consumers)
    levels:     {schema_version: 1, models, policies, speedup} (multi-level stack exports only: the models
                between draft and target, smallest first, and one rule per gap, bottom first;
                specstop.eval.stack_entry)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from specstop.config_io import resolve_tuned_paths
from specstop.errors import MissingInputError, UserError
from specstop.export.folder import (
    CONFIG_NAME,
    EXPORT_FORMAT,
    NODE_HEAD_NAME,
    export_config,
    is_export_file,
    write_export_files,
)
from specstop.export.reading import load_predictor_weights
from specstop.export.runtime import StoppingPolicy
from specstop.jsonio import read_json
from specstop.models import StoppingPredictor
from specstop.models.checkpoint import load_predictor
from specstop.outputs import LOCK_DIR, claim_output_dir
from specstop.pair.identity import check_same_pair
from specstop.policy import PolicySpec

log = logging.getLogger(__name__)

__all__ = [
    "ExportError", "export_config", "export_policy", "read_tuned", "validate_export",
    "write_export_folder",
]

MAX_EXPORT_DIFF = 1e-6


class ExportError(UserError):
    """The inputs cannot make a valid export (the message says what to fix)."""


# ---------------------------------------------------------------------- inputs
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


def _decoding_info(meta: dict, manifest: dict | None, where: str = "generation") -> dict | None:
    """The ``{temperature, top_k, top_p}`` the labels were made at (a checkpoint's or a manifest's
    ``generation`` record), checked by the one rule for a decoding setting; None when none is recorded.

    Raises:
        ExportError: a recorded value that is not a valid setting, named with ``where``.
    """
    gen = meta.get("generation") or (meta.get("manifest") or {}).get("generation") or (manifest or {}).get("generation")
    if not gen:
        return None
    from specstop.export.by_decoding import setting_of

    try:
        setting_of(gen, where)
    except UserError as err:
        raise ExportError(str(err)) from None
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
    tree: str | None = None,
    node_head: StoppingPredictor | None = None,
    by_decoding: list[dict] | None = None,
    stats: dict | None = None,
    levels: dict | None = None,
) -> dict:
    """Write an export folder and validate it. Returns the written config.

    ``out`` is claimed first (:func:`~specstop.outputs.claim_output_dir`: a second export into it
    stops in one line). The export is written and validated in a temporary folder next to ``out``
    and moved into it only when complete, so a failed export never leaves a half-written folder,
    an existing export is replaced only after the new one passed its check, and a file somebody
    else put into ``out`` meanwhile is never deleted.

    Args:
        out: the folder to create; an existing non-empty one is replaced only with ``overwrite``.
        spec: the tuned policy spec.
        predictor: the trained module (``predictor`` policies only).
        pair: ``{name, draft, target, tokenizer_hash}`` identities (runtime refuses other drafts).
        decoding: the decoding transform the labels were made at.
        allow_missing_pair: write an export without pair identities (the runtime can then not
            refuse a wrong draft; only for tests and demos).
        overwrite: replace an existing non-empty ``out``.
        tree: a token-tree policy (``mcsd:...`` / ``tree:N,W,D``): ``specstop decode --policy OUT`` then
            runs the tree decoder; ``spec`` stays the chain policy chain-only consumers use.
        node_head: a ``tree_node_mlp`` predictor steering a dynamic ``tree`` (its weights are exported).
        by_decoding: the policy per decoding setting (:mod:`specstop.export.by_decoding`), ``spec``'s own
            setting among them.
        stats: the policy's price-free statistics (:mod:`specstop.eval.price_free`): decoders re-pick its
            threshold, SL_max or K from them as live step costs move.
        levels: a multi-level stack entry (:mod:`specstop.eval.stack_entry`): ``specstop decode --policy
            OUT`` then runs the stack; ``spec`` stays the chain policy chain-only consumers use.

    Raises:
        ExportError: inconsistent inputs, or ``out`` exists and is not empty (without ``overwrite``).
    """
    if node_head is not None:
        from specstop.tree_policy import DynamicTreeShape, parse_tree_policy

        if not isinstance(parse_tree_policy(tree or ""), DynamicTreeShape):
            raise ExportError(f"a node head steers dynamic trees (tree:N); {tree or spec.label} is not one - drop --node-head")
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
        label=label, source=source, stats=stats,
    )
    if by_decoding is not None:
        from specstop.export.by_decoding import check_entries, setting_of

        try:
            check_entries(by_decoding, spec, "by_decoding")
        except UserError as err:
            raise ExportError(str(err)) from None
        if not any(setting_of(e["decoding"]) == setting_of(decoding or {}) for e in by_decoding):
            raise ExportError("by_decoding must hold the export's own decoding setting (its dataset's)")
        config["by_decoding"] = by_decoding
    if levels is not None:
        config["levels"] = levels
    if tree is not None:
        config["tree"] = {"policy": tree, "node_head": None if node_head is None else {
            "family": node_head.family, "config": node_head.config_dict(), "weights": NODE_HEAD_NAME,
            "num_parameters": int(sum(p.numel() for p in node_head.parameters()))}}
    final = Path(out)
    check_export_target(final, overwrite)
    with claim_output_dir(final, command=f"specstop export --out {final}"):
        # Again under the lock: another run may have finished an export here since the first look.
        check_export_target(final, overwrite)
        earlier = _entries(final)  # the earlier export --overwrite replaces (checked to be one)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            config = write_export_folder(tmp, config, predictor, node_head=node_head)
            _install_export(tmp, final, earlier)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return config


def _entries(folder: Path) -> set[str]:
    """The names in ``folder`` (our lock folder aside)."""
    return {p.name for p in folder.iterdir() if p.name != LOCK_DIR} if folder.is_dir() else set()


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
    return all(is_export_file(name) for name in _entries(folder))


def check_export_target(final: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds something else than an earlier export (before any work).

    Raises:
        ExportError: ``final`` is a file, a non-empty folder without ``overwrite``, or a folder
            specstop did not write (even with ``overwrite``: it would delete the user's files).
    """
    from specstop.outputs import check_writable

    if final.exists() and not final.is_dir():
        raise ExportError(f"--out {final} is a file; give a folder path for the export")
    if final.is_dir() and _entries(final):
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


def _install_export(new: Path, final: Path, earlier: set[str]) -> None:
    """Move the finished export ``new`` into the claimed folder ``final``, entry by entry.

    ``earlier`` names the earlier export found in ``final`` when this run claimed it (what
    ``--overwrite`` replaces): it is moved aside first and removed only once the new export is in.
    Anything else in ``final`` - a file somebody put there while the export ran - is not ours and
    is never deleted or overwritten: beside the export it is left alone; where it has the name of
    an export file, the export stops in one line and changes nothing.

    Raises:
        ExportError: an entry the export writes appeared in ``final`` meanwhile.
    """
    ours = sorted((p.name for p in new.iterdir()), key=lambda n: (n == CONFIG_NAME, n))  # config.json last
    present = _entries(final)
    strangers = present - earlier
    clash = sorted(strangers & set(ours))
    if clash:
        raise ExportError(
            f"{final / clash[0]} appeared in --out while the export ran and is not part of it; nothing was replaced. "
            "Move it away (or choose another --out) and rerun the export"
        )
    if strangers:
        log.warning("%s also holds %s (not written by specstop export; left as it is)", final, ", ".join(sorted(strangers)))
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    retire = sorted(present & earlier, key=lambda n: (n != CONFIG_NAME, n))  # config.json first: no half export
    moved: list[str] = []
    installed: list[str] = []
    try:
        if retire:
            old.mkdir()
            for name in retire:
                os.replace(final / name, old / name)
                moved.append(name)
        for name in ours:
            os.replace(new / name, final / name)
            installed.append(name)
    except BaseException:
        for name in reversed(installed):  # undo: the earlier export back as it was
            os.replace(final / name, new / name)
        for name in moved:
            os.replace(old / name, final / name)
        with contextlib.suppress(OSError):
            old.rmdir()  # only when everything is back
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_export_folder(
    out: str | Path, config: dict, predictor: StoppingPredictor | None = None, *,
    node_head: StoppingPredictor | None = None,
) -> dict:
    """Write an export folder (:func:`~specstop.export.folder.write_export_files`) and check it loads.

    A learned predictor's written weights must reproduce it (the config's ``export_check``); a
    rule-only config must load; a token-tree export's tree policy and node head must load.

    Returns:
        The written config (with ``export_check`` filled for learned policies).
    """

    def check(folder: Path, written: dict) -> dict:
        if predictor is not None:
            diff = validate_export(folder, predictor)
            written = {**written, "export_check": {"batch": 256, "max_abs_diff": diff}}
        else:
            StoppingPolicy.from_pretrained(folder)  # the config must at least load
        tree = written.get("tree")
        if tree is not None and tree.get("node_head") is not None:
            # The tree decoder builds its node scorer from these weights: they must load too.
            load_predictor_weights(folder, folder / CONFIG_NAME, tree["node_head"])
        return written

    return write_export_files(out, config, predictor, node_head=node_head, after_weights=check)


def export_from_files(
    out: str | Path,
    *,
    tuned: str | Path,
    checkpoint: str | Path | None = None,
    policy: str | None = None,
    dataset: str | Path | None = None,
    allow_missing_pair: bool = False,
    overwrite: bool = False,
    node_head: str | Path | None = None,
    also_tuned: list[str | Path] | None = None,
) -> dict:
    """The CLI's work: pick a policy from ``tuned``, load its checkpoint, export.

    ``also_tuned``: tuned files of the same policy on data at other decoding settings (temperature,
    top-k, top-p); the export carries each as a ``by_decoding`` entry (:mod:`specstop.export.by_decoding`).

    A tuned token-tree policy (``tuned["tree_policies"]``, e.g. ``--policy tree_opt``) is exported with
    the tuned ``static_opt`` chain policy as its ``policy`` (for chain-only consumers) and the tree in
    ``tree``; ``node_head`` (a ``tree_node_mlp`` checkpoint) steers a dynamic tree.
    """
    t = read_tuned(tuned)
    name = policy or t.get("best")
    trees = t.get("tree_policies") or {}
    choices = sorted(t["policies"]) + sorted(trees) + (["levels"] if "levels" in t else [])
    if not name:
        raise ExportError(f"{tuned} names no 'best' policy: pass --policy NAME (one of {choices})")
    if node_head is not None and name not in trees:
        raise ExportError(f"--node-head steers token trees; policy {name!r} is not a tuned tree policy (have: "
                          f"{sorted(trees) or 'none'}) - drop --node-head")
    if name == "levels" and name not in t["policies"] and name not in trees:
        if also_tuned or checkpoint:
            raise ExportError("--policy levels exports a multi-level stack of rules: drop --also-tuned and --checkpoint")
        return _export_stack(out, t, tuned=tuned, dataset=dataset, allow_missing_pair=allow_missing_pair,
                             overwrite=overwrite)
    if name in trees and name not in t["policies"]:
        if also_tuned:
            raise ExportError(f"--also-tuned carries a chain policy's settings per decoding; {name!r} is a token tree "
                              "- drop --also-tuned")
        return _export_tree(out, t, name, tuned=tuned, node_head=node_head, dataset=dataset,
                            allow_missing_pair=allow_missing_pair, overwrite=overwrite)
    if name not in t["policies"]:
        raise ExportError(f"policy {name!r} is not in {tuned}; choose from {choices}")
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
        try:
            predictor, meta = load_predictor(ckpt)
        except UserError as err:
            if checkpoint:
                raise
            raise ExportError(f"{tuned} names checkpoint {ckpt} for policy {name!r}, which cannot be used: {err} "
                              "(give the checkpoint that was tuned with --checkpoint PATH, or re-run specstop tune)"
                              ) from None
        checkpoint = ckpt
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
    decoding = _decoding_info(meta, manifest)
    by_decoding = None
    if also_tuned:
        if not decoding:
            raise ExportError(f"--also-tuned: no decoding setting is recorded for {tuned}'s own policy (its dataset "
                              f"{ds} has no manifest): pass --data DIR, the dataset it was tuned on")
        base = {"decoding": decoding, "policy": spec.to_dict(), "speedup": (entry.get("validation") or {}).get("speedup"),
                "source": {"tuned": str(tuned), "dataset": str(ds) if ds else None},
                **({"stats": entry["stats"]} if entry.get("stats") else {})}
        by_decoding = [base, *(_setting_entry(path, name, spec, checkpoint, manifest) for path in also_tuned)]
    return export_policy(
        out,
        spec=spec,
        predictor=predictor,
        name=name,
        pair=_pair_info(meta, manifest),
        decoding=decoding,
        by_decoding=by_decoding,
        cost_model=t.get("cost_model"),
        validation=entry.get("validation"),
        stats=entry.get("stats"),
        label=meta.get("label"),
        source={"checkpoint": str(checkpoint) if checkpoint else None, "tuned": str(tuned), "dataset": str(ds) if ds else None},
        allow_missing_pair=allow_missing_pair,
        overwrite=overwrite,
    )


def _setting_entry(path: str | Path, name: str, spec: PolicySpec, checkpoint, manifest: dict | None) -> dict:
    """The ``by_decoding`` entry of policy ``name`` in tuned file ``path`` (another decoding setting), checked
    against the exported one: the same kind of policy, the same predictor checkpoint, the same pair."""
    from specstop.export.by_decoding import describe

    t = read_tuned(path)
    if name not in t["policies"]:
        raise ExportError(f"--also-tuned {path} has no policy {name!r} (have: {', '.join(sorted(t['policies']))}): tune "
                          "the same policy on that data")
    entry = t["policies"][name]
    try:
        other = PolicySpec.from_dict(entry.get("spec") if isinstance(entry, dict) else entry)
    except UserError as err:
        raise ExportError(f"--also-tuned {path}: policy {name!r}: {err}") from None
    if (other.kind, other.family) != (spec.kind, spec.family):
        raise ExportError(f"--also-tuned {path}: {name} is {other.label} there but {spec.label} here: give a tuned "
                          "file of the same policy")
    if spec.kind == "predictor":
        theirs = (t.get("checkpoints") or {}).get(name)
        if not theirs or not _same_file(theirs, checkpoint):
            raise ExportError(f"--also-tuned {path} tuned {name} with checkpoint {theirs}, not {checkpoint}: its "
                              f"thresholds fit another predictor's scores. Tune this one on that data: specstop tune "
                              f"--data DATA --checkpoint {name}={checkpoint} ...")
    ds = t.get("dataset")
    other_manifest = _read_manifest(ds)
    decoding = _decoding_info({}, other_manifest, f"--also-tuned {path}: its dataset {ds}: manifest generation")
    if not decoding:
        raise ExportError(f"--also-tuned {path}: its dataset {ds} has no manifest with the decoding setting it was "
                          "made at")
    try:
        check_same_pair((other_manifest or {}).get("pair"), (manifest or {}).get("pair"),
                        what=f"--also-tuned {path} was tuned on data of another model pair",
                        fix="tune the policy on data of this export's pair")
    except UserError as err:
        raise ExportError(str(err)) from None
    log.info("--also-tuned %s: %s at %s", path, other.label, describe(decoding))
    return {"decoding": decoding, "policy": other.to_dict(), "speedup": (entry.get("validation") or {}).get("speedup"),
            "source": {"tuned": str(path), "dataset": str(ds) if ds else None},
            **({"stats": entry["stats"]} if entry.get("stats") else {})}


def _same_file(a: str | Path, b: str | Path | None) -> bool:
    """The same file: the same path, or the same bytes (a checkpoint copied elsewhere)."""
    import filecmp

    if b is None:
        return False
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    return a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)


def _export_tree(out, t: dict, name: str, *, tuned, node_head, dataset, allow_missing_pair: bool,
                 overwrite: bool) -> dict:
    """Export the tuned tree policy ``name`` (see :func:`export_from_files`)."""
    from specstop.tree_policy import parse_tree_policy

    entry = t["tree_policies"][name]
    text = str((entry.get("spec") or {}).get("policy") or "")
    try:
        if parse_tree_policy(text) is None:
            raise UserError(f"{text!r} is not a tree policy (mcsd:... or tree:N)")
    except UserError as err:
        raise ExportError(f"{tuned}: tree policy {name!r}: {err}; rerun `specstop tune`") from None
    chain = (t["policies"].get("static_opt") or {}).get("spec")
    spec = PolicySpec.from_dict(chain) if chain else PolicySpec(kind="static", k=4)
    head, meta = (None, {}) if node_head is None else load_predictor(node_head)
    ds = dataset or t.get("dataset")
    manifest = _read_manifest(ds)
    if head is not None:
        ckpt_ds = meta.get("dataset")
        try:
            check_same_pair(
                ckpt_ds.get("pair") if isinstance(ckpt_ds, dict) else None, (manifest or {}).get("pair"),
                what=f"node head {node_head} was trained on data from another model pair than {ds} holds",
                fix="train the node head on this pair's data",
            )
        except UserError as err:
            raise ExportError(str(err)) from None
    return export_policy(
        out, spec=spec, name=name, pair=_pair_info({}, manifest), decoding=_decoding_info({}, manifest),
        cost_model=t.get("cost_model"), validation=entry.get("validation"),
        source={"checkpoint": str(node_head) if node_head else None, "tuned": str(tuned), "dataset": str(ds) if ds else None},
        allow_missing_pair=allow_missing_pair, overwrite=overwrite, tree=text, node_head=head,
    )


def _export_stack(out, t: dict, *, tuned, dataset, allow_missing_pair: bool, overwrite: bool) -> dict:
    """Export the tuned multi-level stack of ``t`` (``--policy levels``): config.json ``levels`` is its stack
    entry without the timings and ranking (which stay in the tuned file), ``policy`` the tuned chain
    ``static_opt`` (what chain-only consumers run with the pair alone), as for token trees."""
    from specstop.eval.stack_entry import check_stack_entry

    try:
        entry = check_stack_entry(t["levels"], str(tuned))
    except UserError as err:
        raise ExportError(str(err)) from None
    levels = {k: entry[k] for k in ("schema_version", "models", "policies", "speedup") if k in entry}
    chain = (t["policies"].get("static_opt") or {}).get("spec")
    spec = PolicySpec.from_dict(chain) if chain else PolicySpec(kind="static", k=4)
    ds = dataset or t.get("dataset")
    manifest = _read_manifest(ds)
    return export_policy(
        out, spec=spec, name="levels", pair=_pair_info({}, manifest), decoding=_decoding_info({}, manifest),
        cost_model=t.get("cost_model"), validation={"speedup": entry.get("speedup")},
        source={"checkpoint": None, "tuned": str(tuned), "dataset": str(ds) if ds else None},
        allow_missing_pair=allow_missing_pair, overwrite=overwrite, levels=levels,
    )
