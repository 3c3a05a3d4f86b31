"""Model weight files: a cheap content fingerprint, and checks that catch broken folders early.

The fingerprint identifies *which weights* a model has, so that a dataset, checkpoint or export
made with one draft is never silently used with another draft of the same name and size (a
fine-tune, another quantization). It must be fast for a 7 GB model, so it does not read every
byte: per weight file it hashes the name, the size, the first MiB (a safetensors header names
every tensor, its dtype, shape and offset) and 64 blocks of 64 KiB spread evenly over the file;
files up to 32 MiB are hashed whole. Changing the weights in any non-trivial way (fine-tuning,
merging, re-quantizing) changes bytes in every block, so the sampled hash changes. Weights that
exist only in memory (tests) are fingerprinted from their tensors instead; the two kinds carry
different prefixes (``files-v1:``, ``params-v1:``) and are only compared with their own kind.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from specstop.errors import UserError

FULL_HASH_LIMIT = 32 << 20
HEAD_BYTES = 1 << 20
SAMPLE_BLOCKS = 64
BLOCK_BYTES = 64 << 10
FILES_PREFIX = "files-v1:"
PARAMS_PREFIX = "params-v1:"
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a Hugging Face folder: ``*.safetensors``, else PyTorch ``*.bin``."""
    folder = Path(folder)
    found = sorted(folder.glob("*.safetensors"))
    return found or sorted(p for p in folder.glob("*.bin") if "training_args" not in p.name)


def safetensors_header(path: Path) -> dict:
    """The parsed JSON header of a safetensors file.

    Raises:
        UserError: the file is too short for its header, the header is not JSON, or the data the
            header describes runs past the end of the file (a truncated download or copy).
    """
    size = path.stat().st_size
    fix = "the file is truncated or corrupt (an interrupted download or copy): download, copy or convert it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: {size} bytes is too short for a safetensors file; {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise UserError(f"{path}: its header claims {n} bytes but the file has {size}; {fix}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{path}: the safetensors header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is not a JSON object; {fix}")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
               and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        raise UserError(f"{path} has {size} bytes but its header describes {8 + n + end}; {fix}")
    return header


def check_weight_files(folder: str | Path, role: str) -> list[Path]:
    """The folder's weight files, after checking each safetensors file and the shard index.

    Raises:
        UserError: no weight files, a shard the index names is missing, or a truncated file.
    """
    folder = Path(folder)
    files = weight_files(folder)
    if not files:
        raise UserError(
            f"{role} folder {folder} holds no weights (*.safetensors or pytorch_model*.bin); copy the model "
            "there with save_pretrained, or point at the folder that has them"
        )
    for index in folder.glob("*.index.json"):
        try:
            shards = set((json.loads(index.read_text()).get("weight_map") or {}).values())
        except (OSError, ValueError):
            raise UserError(f"{index} is not valid JSON; copy or download the model again") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise UserError(f"{role} folder {folder}: {index.name} names shards that are missing: {missing[:3]}; copy them too")
    for f in files:
        check_not_a_broken_link(f)
        if f.suffix == ".safetensors":
            safetensors_header(f)
    return files


def check_not_a_broken_link(path: Path) -> None:
    """Refuse a symbolic link that leads to nothing, naming the link and where it leads (a folder of
    links, e.g. into a cache that was since cleaned, would otherwise read as a missing file or a
    raw FileNotFoundError).

    Raises:
        UserError: ``path`` is a link whose target does not exist.
    """
    if path.is_symlink() and not path.exists():
        raise UserError(
            f"{path} is a symbolic link to {path.readlink()}, which does not exist (moved or deleted?); "
            "link it to the file again or copy the file there"
        )


def _hash_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return
        h.update(f.read(HEAD_BYTES))
        step = (size - HEAD_BYTES - BLOCK_BYTES) // SAMPLE_BLOCKS
        for i in range(SAMPLE_BLOCKS + 1):
            f.seek(HEAD_BYTES + i * step)
            h.update(f.read(BLOCK_BYTES))


def folder_fingerprint(folder: str | Path) -> str | None:
    """``files-v1:<sha256>`` of a folder's weight files (see module docstring), or None without any."""
    files = weight_files(folder)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        _hash_file(h, f)
    return FILES_PREFIX + h.hexdigest()


def params_fingerprint(model, sample: int = 4096) -> str:
    """``params-v1:<sha256>`` of a model's tensors in memory: whole tensors up to ``sample``
    elements, else ``sample`` evenly strided elements (cheap on any device)."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        flat = t.reshape(-1)
        if flat.numel() > sample:
            idx = torch.linspace(0, flat.numel() - 1, sample, device=flat.device).long()
            flat = flat[idx]
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return PARAMS_PREFIX + h.hexdigest()


def weights_fingerprint(model, weights_path: str | Path | None) -> str:
    """The fingerprint of ``model``'s weights: from its files when ``weights_path`` is a folder that
    holds them, else from the tensors in memory."""
    if weights_path is not None and Path(weights_path).is_dir():
        fp = folder_fingerprint(weights_path)
        if fp is not None:
            return fp
    return params_fingerprint(model)


def estimated_load_bytes(folder: str | Path, itemsize: int) -> int | None:
    """Bytes the folder's safetensors weights take in memory at ``itemsize`` bytes per value (None
    when the folder has no safetensors files)."""
    total = 0
    files = [f for f in weight_files(folder) if f.suffix == ".safetensors"]
    if not files:
        return None
    for f in files:
        for key, info in safetensors_header(f).items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            count = 1
            for d in info.get("shape", []):
                count *= int(d)
            # Integer tensors (quantized weights, position ids) keep their own width.
            stored = _SAFETENSORS_ITEMSIZE.get(info.get("dtype"), 4)
            total += count * (itemsize if str(info.get("dtype", "")).startswith(("F", "BF")) else stored)
    return total
