"""Where a model is loaded from, checked before anything heavy happens.

``--draft``/``--target`` (or a ``--pair`` folder) name a local Hugging Face folder or a hub id.
:func:`locate_model` turns that into what to load, or one clear error:

* a local folder must hold ``config.json``, tokenizer files and intact weights (an empty folder
  would otherwise surface as a tokenizer-backend message, a truncated safetensors file as a
  deserialization traceback);
* a path that does not exist is reported as such (not looked up on the hub);
* a hub id is used as is when the hub is reachable. When it is not (``HF_HUB_OFFLINE=1``,
  ``SPECSTOP_OFFLINE=1``, or a short connection probe fails), the cached copy is used if there is
  one; otherwise the error names the model id at once, instead of ~50 s of retries.

:func:`check_device` refuses a device this torch cannot use (``--device cuda`` without CUDA).
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

from specstop.errors import MissingInputError, UserError
from specstop.pair.weights import check_not_a_broken_link, check_weight_files

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HUB_TIMEOUT_ENV = "SPECSTOP_HUB_TIMEOUT"


def check_model_folder(folder: str | Path, role: str) -> None:
    """Refuse a local model folder that cannot load (empty, no config, no tokenizer, broken weights)."""
    folder = Path(folder)
    check_not_a_broken_link(folder / "config.json")
    if not (folder / "config.json").is_file():
        what = "is empty" if not any(folder.iterdir()) else "has no config.json"
        raise UserError(
            f"{role} folder {folder} {what}: not a Hugging Face model folder. Save a model there "
            "(model.save_pretrained + tokenizer.save_pretrained), point at another folder, or fetch the "
            "reference pair with `specstop fetch-pair qwen2.5-coder-0.5b-1.5b`"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{role} folder {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); save the "
            "tokenizer next to the model with tokenizer.save_pretrained"
        )
    check_weight_files(folder, role)


def looks_like_path(name: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else with a separator is a filesystem path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def offline_flag() -> str | None:
    """The environment variable that declares the hub offline, if one does."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SPECSTOP_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


@lru_cache(maxsize=4)
def hub_reachable(endpoint: str | None = None) -> bool:
    """Does the hub answer one HTTP request within ``$SPECSTOP_HUB_TIMEOUT`` (default 5) seconds?

    Any HTTP answer counts (even an error status); no answer - DNS failure, refused or silent
    connection (e.g. a proxy that accepts and never replies) - means unreachable. One request, no
    retries, so an offline machine learns it in seconds, not after huggingface_hub's backoff.
    """
    import urllib.error
    import urllib.request

    if endpoint is None:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    try:
        timeout = float(os.environ.get(HUB_TIMEOUT_ENV, "5"))
    except ValueError:
        timeout = 5.0
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # the server answered
    except (urllib.error.URLError, OSError, ValueError):
        return False


def cached_snapshot(repo_id: str, revision: str | None = None) -> str | None:
    """The local folder of a hub model already in the Hugging Face cache, or None."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (or not a valid repo id): the caller reports it
        return None
    return path if (Path(path) / "config.json").is_file() else None


def weights_folder(source: str, revision: str | None = None) -> str | None:
    """The local folder holding a loaded model's weight files: ``source`` itself, or the
    Hugging Face cache snapshot of a hub id (None when neither exists)."""
    if Path(source).is_dir():
        return source
    return cached_snapshot(source, revision)


def locate_model(name: str, role: str, revision: str | None = None) -> str:
    """What to load for ``--draft``/``--target`` ``name`` (a checked local folder or a hub id).

    Args:
        name: local folder or hub id.
        role: ``draft`` or ``target``, for messages.
        revision: hub revision, if any.

    Raises:
        MissingInputError: a path that does not exist.
        UserError: a broken local folder, or a hub id while the hub is unreachable and the model
            is not cached (names the id and the fix).
    """
    name = str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        check_model_folder(path, role)
        return str(path)
    if path.exists():
        raise UserError(f"{role} {name!r} is a file; give a Hugging Face model folder or a hub id")
    if looks_like_path(name):
        raise MissingInputError(f"{role} model folder {name} does not exist; check the path (or give a hub id like Qwen/Qwen2.5-0.5B)")
    flag = offline_flag()
    if flag is None and hub_reachable():
        return name
    cached = cached_snapshot(name, revision)
    why = f"{flag}=1 is set" if flag else "the Hugging Face hub cannot be reached (no network?)"
    if cached is not None:
        log.info("%s model %s: %s; using the cached copy in %s", role, name, why, cached)
        return cached
    raise UserError(
        f"{role} model {name!r} is not a local folder and {why}, and it is not in the Hugging Face cache. "
        f"Download it where there is network (`huggingface-cli download {name}`) and give its folder, or use "
        "`specstop fetch-pair NAME` for a known pair"
    )


def check_device(device: str | None) -> None:
    """Refuse a device this torch cannot use, before any model is loaded.

    Raises:
        UserError: an unknown device string, CUDA without a CUDA build or GPU, a GPU index past the
            last GPU, or MPS where it is not available.
    """
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "no GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            raise UserError(
                f"--device {device} asks for CUDA but {why} (torch {torch.__version__}); use --device cpu, "
                "or install a CUDA build of torch on a GPU machine"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible (cuda:0 ..)")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError(f"--device {device}: MPS is not available on this machine; use --device cpu")
