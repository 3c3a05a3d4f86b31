"""Read and write predictor checkpoints with torch only (no Lightning import).

A checkpoint is a ``torch.save``d dict in Lightning's layout (``specstop.train`` writes it through
Lightning; :func:`save_predictor_checkpoint` writes the same layout directly)::

    {"state_dict": {"predictor.<param>": tensor, ...},
     "hyper_parameters": {"family", "predictor_config", "label", "w_acc", "w_rej", ...},
     "specstop": {"format", "family", "predictor_config", "feature_spec", "label", "dataset", "val_metrics", ...}}

Eval, tune and export load predictors through :func:`load_predictor`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specstop.errors import MissingInputError, UserError
from specstop.models.base import StoppingPredictor
from specstop.models.registry import build_predictor

PREFIX = "predictor."


ZERO_SUFFIX = ".fp32.ckpt"


def consolidated_path(folder: str | Path) -> Path:
    """Where the single-file form of a DeepSpeed checkpoint folder is written (next to it)."""
    folder = Path(folder)
    return folder.with_name(folder.name.removesuffix(".ckpt") + ZERO_SUFFIX)


def convert_zero_checkpoint(folder: str | Path) -> Path:
    """Consolidate a DeepSpeed (ZeRO) checkpoint folder into one fp32 checkpoint file, once.

    Uses Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (it needs ``deepspeed``),
    which keeps the hyper-parameters and specstop metadata beside the gathered weights, so
    :func:`load_predictor` (and tune, eval, export) read the result like any checkpoint.

    Returns:
        The consolidated file (``<name>.fp32.ckpt`` next to the folder); reused when it exists.
    """
    folder = Path(folder)
    out = consolidated_path(folder)
    if out.is_file() and out.stat().st_mtime >= folder.stat().st_mtime:
        return out
    try:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    except ImportError as err:  # pragma: no cover - lightning is a dependency
        raise UserError(f"{folder} is a DeepSpeed checkpoint folder; converting it needs lightning ({err})") from None
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(tmp))
    except ImportError as err:
        raise UserError(
            f"{folder} is a DeepSpeed checkpoint folder and converting it needs deepspeed ({err}); "
            "pip install 'specstop[distributed]'"
        ) from None
    tmp.replace(out)
    return out


def _read(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            raise MissingInputError(
                f"{path} is an export folder, not a training checkpoint; give the .ckpt it was exported from "
                "(its config.json 'source.checkpoint')"
            )
        if not (path / "checkpoint").is_dir() and not consolidated_path(path).is_file():
            raise MissingInputError(
                f"{path} is a folder, not a checkpoint file or a DeepSpeed checkpoint folder; "
                "`specstop train` prints the best checkpoint's path"
            )
        path = convert_zero_checkpoint(path)
    if not path.is_file():
        raise MissingInputError(f"no checkpoint at {path}; `specstop train` prints the best checkpoint's path")
    if path.suffix in (".safetensors", ".json"):
        what = "a safetensors weights file (an export's model.safetensors?)" if path.suffix == ".safetensors" else (
            "a JSON file (a tuned.json or config.json?)")
        raise UserError(f"{path} is {what}, not a training checkpoint; give the .ckpt that `specstop train` printed")
    try:
        # weights_only=True: a checkpoint is data and must not run code when read. PredictorModule
        # stores plain dicts so this succeeds; only foreign checkpoints need the fallback.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pragma: no cover - depends on who wrote the file
        raise UserError(
            f"{path} could not be read as a plain-data checkpoint ({type(err).__name__}: {err}); "
            "was it written by specstop train?"
        ) from err


def read_checkpoint_meta(path: str | Path) -> dict:
    """The ``specstop`` metadata of a checkpoint (family, dataset summary with its pair, ...), or {}."""
    return dict(_read(path).get("specstop") or {})


def load_predictor(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[StoppingPredictor, dict]:
    """Rebuild a trained predictor from a checkpoint.

    Args:
        path: a ``.ckpt`` written by ``specstop train`` (or :func:`save_predictor_checkpoint`), or a
            DeepSpeed checkpoint folder (consolidated once into ``<name>.fp32.ckpt`` beside it).
        map_location: device for the weights.

    Returns:
        ``(predictor in eval mode, meta)``; meta holds ``family``, ``predictor_config``,
        ``feature_spec``, ``label``, ``w_acc``, ``w_rej`` and, when recorded, ``dataset`` (manifest
        summary: pair identities, tokenizer_hash, temperature) and ``val_metrics``.
    """
    ckpt = _read(path)
    hp = dict(ckpt.get("hyper_parameters") or {})
    meta = dict(ckpt.get("specstop") or {})
    family = meta.get("family") or hp.get("family")
    config = meta.get("predictor_config") or hp.get("predictor_config")
    if not family or config is None:
        raise UserError(f"{path} has no specstop predictor metadata (family / predictor_config); not a specstop checkpoint")
    predictor = build_predictor(family, **config)
    state = {k[len(PREFIX) :]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith(PREFIX)}
    if not state:
        raise UserError(f"{path} holds no 'predictor.*' weights")
    missing, unexpected = predictor.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{path} does not match family {family!r} config {config}: missing {missing}, unexpected {unexpected}")
    predictor.to(map_location).eval()
    for key in ("label", "w_acc", "w_rej"):
        meta.setdefault(key, hp.get(key))
    meta.setdefault("family", family)
    meta.setdefault("predictor_config", predictor.config_dict())
    meta.setdefault("feature_spec", predictor.feature_spec.to_dict())
    meta.setdefault("label", predictor.default_label)
    return predictor, meta


def save_predictor_checkpoint(path: str | Path, predictor: StoppingPredictor, meta: dict | None = None) -> Path:
    """Write ``predictor`` in the layout :func:`load_predictor` reads (tests, conversions).

    ``meta`` may carry ``label``, ``w_acc``, ``w_rej``, ``dataset``, ``val_metrics``, ... (JSON-like values).
    """
    meta = dict(meta or {})
    label = meta.get("label", predictor.default_label)
    hp = {
        "family": predictor.family,
        "predictor_config": predictor.config_dict(),
        "label": label,
        "w_acc": float(meta.get("w_acc", 1.0)),
        "w_rej": float(meta.get("w_rej", 1.0)),
    }
    full_meta = {**meta, **hp, "feature_spec": predictor.feature_spec.to_dict(), "format": 1}
    ckpt = {
        "state_dict": {PREFIX + k: v.detach().cpu() for k, v in predictor.state_dict().items()},
        "hyper_parameters": hp,
        "specstop": full_meta,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(ckpt, tmp)
    tmp.replace(path)
    return path
