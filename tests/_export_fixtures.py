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
