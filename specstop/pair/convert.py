"""Convert a GGUF checkpoint into a plain Hugging Face folder (config, safetensors, tokenizer).

transformers reads GGUF through ``from_pretrained(..., gguf_file=...)`` and dequantizes the
weights to the requested dtype. Loading GGUF is slow (minutes), so we do it once and save a
normal folder that later stages load in seconds.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specstop.errors import MissingInputError

log = logging.getLogger(__name__)

SOURCE_RECORD = "specstop_source.json"


@dataclass
class ConvertResult:
    """Where a converted model went and how long the conversion took."""

    path: Path
    seconds: float
    num_parameters: int
    skipped: bool = False


def read_source_record(folder: Path) -> dict | None:
    """The ``specstop_source.json`` of a converted folder, or None."""
    try:
        return json.loads((Path(folder) / SOURCE_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def gguf_source(model: str) -> str:
    """The GGUF file a model folder was converted from (``specstop fetch-pair``), else ``model`` itself.

    llama.cpp loads GGUF files only; a converted pair's folder records its source file, which
    ``fetch-pair`` keeps in the downloads cache. A folder without that record (or whose GGUF is gone)
    is returned unchanged, so a command still names the model the user gave.
    """
    from specstop.paths import downloads_dir

    record = read_source_record(Path(model)) if Path(model).is_dir() else None
    name = record.get("gguf_file") if isinstance(record, dict) else None
    path = downloads_dir() / str(name)
    return str(path) if name and path.is_file() else model


def is_converted_from(folder: Path, sha256: str) -> bool:
    """True when ``folder`` is a complete conversion of the GGUF file with this hash."""
    rec = read_source_record(folder)
    return bool(rec) and rec.get("sha256") == sha256 and (Path(folder) / "config.json").is_file()


def _strip_gguf_quantization(model) -> None:
    """Make a GGUF-loaded model look like a plain float model.

    The weights are already dequantized, but transformers still attaches its GGUF quantizer
    (``model.hf_quantizer``) and a ``GgufConfig`` (``config.quantization_config``).
    ``save_pretrained`` refuses to save a model whose quantizer is not serializable (GGUF's never
    is), and a leftover ``quantization_config`` in config.json would make later loads look for a
    GGUF file, so both are removed.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Older versions also flag the model itself; harmless when absent.
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


_PAD_TOKEN = re.compile(r"\[PAD(\d+)\]")


def trim_gguf_padding_tokens(folder: str | Path) -> int:
    """Drop the ``[PADnnn]`` placeholder tokens a GGUF tokenizer carries; return how many.

    GGUF stores one token per embedding row, so Qwen's padded rows 151,665..151,935 come back as
    ordinary vocabulary entries named ``[PAD151665]`` ... The original tokenizer has no such
    tokens (151,665 entries, logits 151,936 wide). Keeping them would make ``len(tokenizer)``
    equal the logit width, let sampling emit them as literal text, and give the converted pair
    a different tokenizer fingerprint from the hub one. Only entries whose name is ``[PAD<own id>]``
    at the end of the id range are removed, so a real token can never be dropped.
    """
    path = Path(folder) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return 0
    pads = {tok for tok, i in vocab.items() if (m := _PAD_TOKEN.fullmatch(tok)) and int(m.group(1)) == i}
    if not pads:
        return 0
    first_pad = min(vocab[t] for t in pads)
    if any(i >= first_pad for t, i in vocab.items() if t not in pads):
        return 0  # padding is not a clean tail; leave the tokenizer as it is
    added = [t.get("id", -1) for t in data.get("added_tokens", [])]
    if any(i >= first_pad for i in added):
        return 0
    data["model"]["vocab"] = {t: i for t, i in vocab.items() if t not in pads}
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    return len(pads)


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    sha256: str | None = None,
    size: int | None = None,
    force: bool = False,
) -> ConvertResult:
    """Convert one GGUF file to a float32 Hugging Face folder at ``out_dir``.

    The folder is written to a temporary sibling and renamed into place only when complete, so an
    interrupted conversion never looks finished.

    Args:
        gguf_path: the verified GGUF file.
        out_dir: destination folder (e.g. ``<cache>/pairs/<name>/draft``).
        sha256, size: the GGUF file's verified hash and size, recorded in ``specstop_source.json``.
        force: convert even when ``out_dir`` already holds a conversion of this file.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not force and sha256 and is_converted_from(out_dir, sha256):
        return ConvertResult(out_dir, 0.0, int(read_source_record(out_dir).get("num_parameters", 0)), skipped=True)
    if not gguf_path.is_file():
        raise MissingInputError(f"GGUF file {gguf_path} does not exist; run `specstop fetch-pair NAME` to fetch it")

    t0 = time.perf_counter()
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = None
    try:
        log.info("loading %s (dequantizing to float32; about a minute per GB)", gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _strip_gguf_quantization(model)
        num_params = int(sum(p.numel() for p in model.parameters()))
        # transformers 5 always writes safetensors (there is no safe_serialization switch anymore).
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        from specstop.outputs import default_file_mode

        for weights in Path(tmp).glob("*.safetensors"):  # safetensors writes them 0600; others read them
            default_file_mode(weights)
        trimmed = trim_gguf_padding_tokens(tmp)
        if trimmed:
            log.info("removed %d [PAD] placeholder tokens from the GGUF tokenizer", trimmed)
        seconds = time.perf_counter() - t0
        record = {
            "gguf_file": gguf_path.name,
            "sha256": sha256,
            "size": size if size is not None else gguf_path.stat().st_size,
            "conversion_seconds": round(seconds, 1),
            "num_parameters": num_params,
            "dtype": "float32",
            "tokenizer_pad_tokens_removed": trimmed,
            "transformers_version": transformers.__version__,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        # Free the float32 weights before the caller converts the next (larger) model.
        del model
        gc.collect()
    return ConvertResult(out_dir, seconds, num_params)


def folder_size(path: str | Path) -> int:
    """Total bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
