"""Shared builders for the export / decoder / HF tests: fake Lightning checkpoints, tuned files,
dataset manifests and random-init exports for the tiny pair."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specstop.models import build_predictor
from specstop.policy import PolicySpec


def tiny_prompts(pair, texts=("hello world", "def f(x):")) -> list[list[int]]:
    from specstop.decode.cli import render

    return [render(t, pair.tokenizer, True) for t in texts]


def write_checkpoint(path: Path, family: str, label: str = "accept_prob", seed: int = 0, **config) -> torch.nn.Module:
    """A checkpoint in the Lightning layout (hyper_parameters + state_dict under ``predictor.``)."""
    torch.manual_seed(seed)
    model = build_predictor(family, **config)
    torch.save(
        {
            "hyper_parameters": {"family": family, "predictor_config": model.config_dict(), "label": label},
            "state_dict": {"predictor." + k: v for k, v in model.state_dict().items()},
        },
        path,
    )
    return model


def write_manifest(folder: Path, pair, temperature: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema_version": 1,
        "pair": pair.to_dict(),
        "generation": {"temperature": temperature, "top_k": 0, "top_p": 1.0, "max_new_tokens": 64},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def write_tuned(path: Path, policies: dict[str, PolicySpec], dataset: Path, checkpoints: dict, best: str) -> Path:
    tuned = {
        "schema_version": 1,
        "policies": {n: {"spec": s.to_dict(), "validation": {"latency_per_token": 0.01, "speedup": 1.5}} for n, s in policies.items()},
        "best": best,
        "cost_model": {"t_draft": 0.01, "t_target": 0.03, "verify_per_token": 0.0, "predictor_per_step": 0.0, "kind": "specdecpp"},
        "dataset": str(dataset),
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
    }
    path.write_text(json.dumps(tuned))
    return path


def _mid_gap(scores: torch.Tensor) -> float:
    """Midpoint between the two middle scores: a threshold no calibration score sits on."""
    s = scores.sort().values
    i = len(s) // 2
    return float((s[i - 1] + s[i]) / 2)


def per_setting_copy(export: Path, out: Path, policies: dict[tuple[float, float], dict]) -> Path:
    """A copy of ``export`` at ``out`` tuned per decoding setting: ``{(temperature, top_p): policy spec}`` as its
    ``by_decoding`` entries (no top-k)."""
    import json
    import shutil

    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["by_decoding"] = [{"decoding": {"temperature": t, "top_k": 0, "top_p": p}, "policy": spec}
                          for (t, p), spec in policies.items()]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def random_exports(tmp: Path, pair) -> dict[str, Path]:
    """Random-init disco_ffn and specdecpp_resnet exports for ``pair`` (thresholds chosen so both
    stop and continue decisions happen)."""
    from specstop.export.export import export_from_files

    hidden = pair.draft_identity.hidden_size
    ds = write_manifest(tmp / "data", pair)
    ck_disco = tmp / "disco.ckpt"
    ck_sdpp = tmp / "sdpp.ckpt"
    disco = write_checkpoint(ck_disco, "disco_ffn", label="accept_expected", seed=1)
    sdpp = write_checkpoint(ck_sdpp, "specdecpp_resnet", seed=2, hidden_size=hidden, depth=2)
    # Thresholds at the median score on real draft states, so both decisions happen.
    with torch.no_grad():
        # Raw text (no chat template): the test prompts share the template's header, and a score
        # exactly at the threshold would make cached and cache-free runs disagree on a tie.
        ids = pair.tokenizer("Threshold calibration text, long enough.")["input_ids"]
        out = pair.draft(torch.tensor([ids]), output_hidden_states=True)
        probs = torch.softmax(out.logits[0, :, : pair.vocab_size].float(), -1)
        x = disco.feature_spec.build_from_probs(probs, torch.arange(len(ids)))
        tau = _mid_gap(torch.sigmoid(disco(x)))
        m = _mid_gap(torch.sigmoid(sdpp(out.hidden_states[-1][0])))
    specs = {
        "disco": PolicySpec(kind="predictor", family="disco_ffn", threshold=tau, sl_max=6, reads="dist"),
        "sdpp": PolicySpec(kind="predictor", family="specdecpp_resnet", threshold=1 - m**2.5, sl_max=8, rule="cumprod", reads="hidden"),
        "static": PolicySpec(kind="static", k=3),
    }
    tuned = write_tuned(tmp / "tuned.json", specs, ds, {"disco": ck_disco, "sdpp": ck_sdpp}, best="disco")
    out = {}
    for name in specs:
        out[name] = tmp / f"export_{name}"
        export_from_files(out[name], tuned=tuned, policy=name)
    return out


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models run several times faster on one thread (and the CI machine is shared)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def hub_snapshot(cache, repo_id: str, folder, revision: str = "main"):
    """``folder`` laid out in the Hugging Face cache ``cache`` exactly as ``snapshot_download`` leaves
    a model repo: ``models--owner--name/blobs/<etag>`` (git blob sha1, sha256 for LFS files),
    ``snapshots/<commit>/<path>`` relative symlinks to them, ``refs/<revision>`` naming the commit and
    the commit's tree listing. Returns the snapshot folder."""
    import hashlib

    from huggingface_hub import scan_cache_dir
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    listing = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel, data = f.relative_to(folder).as_posix(), f.read_bytes()
        git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs_sha256 = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else None
        blob = storage / "blobs" / (lfs_sha256 or git_sha1)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / rel
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
        listing[rel] = (len(data), git_sha1, lfs_sha256)
    _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    try:  # huggingface_hub >= 1.x also caches the commit's file listing next to the snapshots
        from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    except ImportError:
        pass
    else:
        write_tree_cache(str(storage), commit, {
            rel: TreeCacheEntry(size=n, blob_id=sha1, lfs_sha256=lfs, lfs_size=n if lfs else None)
            for rel, (n, sha1, lfs) in listing.items()
        })
    snapshot = storage / "snapshots" / commit
    assert (snapshot / "config.json").is_symlink()
    (repo,) = [r for r in scan_cache_dir(cache).repos if r.repo_id == repo_id]  # huggingface_hub reads it as its own
    assert {f.file_name for rev in repo.revisions for f in rev.files} == {p.name for p in folder.rglob("*") if p.is_file()}
    return snapshot
