"""Load a draft/target model pair that shares one tokenizer.

Speculative decoding compares the draft's and the target's next-token distributions token by
token, so both models must map ids to the same strings and agree on special tokens. We check
that up front and fail with the first differing token rather than producing silent garbage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specstop.errors import UserError
from specstop.pair.dtype_choice import resolve_dtype
from specstop.pair.fast_paths import install_fast_paths

log = logging.getLogger(__name__)


class TokenizerMismatchError(UserError):
    """The draft and target tokenizers differ, so the pair cannot do speculative decoding."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary mapping and the special tokens (first 16 hex digits)."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "special": _special_tokens(tokenizer),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:16]


def _special_tokens(tokenizer) -> dict[str, Any]:
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        out[name] = getattr(tokenizer, name, None)
    out["all_special_tokens"] = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    return out


def check_same_tokenizer(draft_tok, target_tok, draft_name: str, target_name: str) -> None:
    """Raise :class:`TokenizerMismatchError` naming the first differing token or special token."""
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    d_by_id = {i: t for t, i in dv.items()}
    t_by_id = {i: t for t, i in tv.items()}
    for i in range(max(len(d_by_id), len(t_by_id), max(d_by_id, default=-1) + 1, max(t_by_id, default=-1) + 1)):
        a, b = d_by_id.get(i), t_by_id.get(i)
        if a != b:
            raise TokenizerMismatchError(
                f"draft {draft_name!r} and target {target_name!r} do not share a tokenizer: "
                f"token id {i} is {a!r} in the draft but {b!r} in the target "
                f"(vocabulary sizes {len(dv)} vs {len(tv)}). Speculative decoding needs one tokenizer; "
                "pick a draft from the target's model family."
            )
    ds, ts = _special_tokens(draft_tok), _special_tokens(target_tok)
    for key in ds:
        if ds[key] != ts[key]:
            raise TokenizerMismatchError(
                f"draft {draft_name!r} and target {target_name!r} share a vocabulary but differ in special "
                f"token {key}: {ds[key]!r} vs {ts[key]!r}. Fix the tokenizer_config.json of one of them."
            )


@dataclass
class ModelIdentity:
    """What later stages record about a model in manifests and exports."""

    name_or_path: str
    revision: str | None
    architecture: str
    num_parameters: int
    dtype: str
    hidden_size: int
    num_hidden_layers: int
    logits_size: int
    source_sha256: str | None = None  # e.g. the GGUF file hash for converted reference models
    # Content fingerprint of the weights (specstop.pair.weights): two drafts with the same name and
    # size but other weights differ here.
    weights_sha256: str | None = None
    # The weight-only scheme the model runs in ("int8", "int4"; None: as loaded). Its identity is the
    # float model's otherwise (same files, sizes and fingerprint), so this field alone tells them apart.
    quant: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelPair:
    """A loaded draft/target pair with its shared tokenizer.

    Attributes:
        draft, target: ``PreTrainedModel`` in eval mode.
        tokenizer: the shared tokenizer (the target's copy).
        vocab_size: the shared vocabulary length; logits are compared on ``[:vocab_size]``.
        compile_draft: the draft's decode steps run under ``torch.compile`` over a static KV cache, in
            the chain decoder and in calibrate-cost's timings alike (:meth:`with_compiled_draft`).
    """

    draft: Any
    target: Any
    tokenizer: Any
    draft_identity: ModelIdentity
    target_identity: ModelIdentity
    tokenizer_hash: str
    vocab_size: int
    name: str | None = None
    extra: dict = field(default_factory=dict)
    dtype_choice: dict | None = None
    compile_draft: bool = False

    def with_compiled_draft(self) -> ModelPair:
        """The same loaded models, the draft's steps compiled (see ``compile_draft``)."""
        from dataclasses import replace

        return replace(self, compile_draft=True)

    @property
    def draft_device(self) -> torch.device:
        return next(self.draft.parameters()).device

    @property
    def target_device(self) -> torch.device:
        return _input_device(self.target)

    def vocab_handling(self) -> dict:
        """Manifest entry explaining how distributions are compared."""
        return {
            "shared_vocab_size": self.vocab_size,
            "draft_logits_size": self.draft_identity.logits_size,
            "target_logits_size": self.target_identity.logits_size,
            "rule": "logits are sliced to the shared tokenizer vocabulary before softmax; padded rows are dropped",
        }

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "draft": self.draft_identity.to_dict(),
            "target": self.target_identity.to_dict(),
            "tokenizer_hash": self.tokenizer_hash,
            "vocab": self.vocab_handling(),
            "dtype": self.dtype_record(),
        }

    def dtype_record(self) -> dict:
        """The dtype the pair runs in and why it was chosen (``dtype: auto`` explains itself)."""
        if self.dtype_choice:
            return dict(self.dtype_choice)
        d = self.target_identity.dtype
        return {"dtype": d, "requested": d, "reason": "models passed in already loaded"}


def _input_device(model) -> torch.device:
    """Where inputs must go (the embedding's device, also under ``device_map='auto'``)."""
    try:
        return model.get_input_embeddings().weight.device
    except Exception:  # pragma: no cover - exotic models
        return next(model.parameters()).device


def _read_source_hash(path: str) -> str | None:
    marker = Path(path) / "specstop_source.json"
    if marker.is_file():
        try:
            return json.loads(marker.read_text()).get("sha256")
        except (OSError, json.JSONDecodeError):
            return None
    return None


def model_identity(
    model, name_or_path: str, revision: str | None = None, weights_path: str | None = None
) -> ModelIdentity:
    """Identity of a loaded model; ``weights_path`` is the folder its weights were read from
    (default: ``name_or_path`` when that is a folder) - in-memory models are fingerprinted from tensors."""
    from specstop.pair.weights import weights_fingerprint

    if weights_path is None and os.path.isdir(str(name_or_path)):
        weights_path = str(name_or_path)
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return ModelIdentity(
        name_or_path=str(name_or_path),
        revision=revision,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        num_parameters=int(sum(p.numel() for p in model.parameters())),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        hidden_size=int(text_cfg.hidden_size),
        num_hidden_layers=int(text_cfg.num_hidden_layers),
        logits_size=int(model.get_output_embeddings().weight.shape[0]),
        source_sha256=_read_source_hash(weights_path) if weights_path and os.path.isdir(weights_path) else None,
        weights_sha256=weights_fingerprint(model, weights_path),
    )


def load_tokenizer(name_or_path: str, revision: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    if tok.pad_token is None:
        # Batched generation needs a pad token; EOS is the usual choice and is masked out anyway.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    device_map: str | dict | None = None,
    revision: str | None = None,
    pack: bool = True,
):
    """Load one causal LM in eval mode, on ``device`` or spread by ``device_map``; ``pack=False``: no
    packed copy of its linear weights (:func:`specstop.pair.fast_paths.install_linear_route`)."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "revision": revision}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load model {name_or_path!r}: {err}\n"
            "Give a local Hugging Face folder, a hub id (needs network), or fetch the reference pair "
            "with `specstop fetch-pair qwen2.5-coder-0.5b-1.5b`."
        ) from err
    if device_map is None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    install_fast_paths(model, pack=pack)
    return model


def load_pair(
    draft: str,
    target: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    target_device_map: str | dict | None = None,
    draft_revision: str | None = None,
    target_revision: str | None = None,
    name: str | None = None,
    dtype_workload: str = "decode",
    draft_quant: str | None = None,
    draft_prefill_copy: bool = True,
) -> ModelPair:
    """Load a draft and a target that share a tokenizer.

    Args:
        draft, target: local Hugging Face folders or hub ids.
        dtype: ``float32``/``bfloat16``/``float16`` or ``auto`` (this pair's fastest on this machine,
            timed: :mod:`specstop.pair.dtype_choice`).
        dtype_workload: what ``auto`` optimises: ``decode`` (batch-1 decoding, calibration) or
            ``generate`` (batched data generation).
        device: device for the draft (and the target unless ``target_device_map`` is given).
        target_device_map: e.g. ``"auto"`` to spread a target larger than one GPU.
        draft_quant: "int8" or "int4": the draft's linear layers (output head included) in weight-only
            int8/int4 (:mod:`specstop.pair.quantize`, CPU), recorded in its identity (``quant``), so
            data, checkpoints and exports made with it are told apart from the float draft's.
        draft_prefill_copy: with ``draft_quant``, keep a float copy of the weights for blocks of many rows
            (a decoder's prompt prefill, :data:`specstop.pair.quantize.PREFILL_ROWS`). False for data
            generation: its teacher-forced forwards score every response position in one block, and those
            rows must run the packed kernels a decoder's draft steps run.

    Raises:
        TokenizerMismatchError: the tokenizers differ (names the first differing token).
    """
    from specstop.pair.preflight import check_dtype_name, check_pair_fits, loading_errors
    from specstop.pair.quantize import check_scheme
    from specstop.pair.sources import check_device, locate_model, weights_folder

    # Fail in a second, with the fix, rather than deep inside transformers: the device, the
    # folders (or hub ids), the dtype name, the quantization and whether both models fit in memory.
    check_device(device)
    check_dtype_name(dtype)
    draft_quant = check_scheme(draft_quant)
    if draft_quant and str(device or default_device()).startswith("cuda"):
        raise UserError(f"--draft-quant {draft_quant}: the weight-only kernels are CPU ones; load the pair with "
                        "--device cpu, or leave the draft unquantized on a GPU")
    draft_src = locate_model(draft, "draft", draft_revision)
    target_src = locate_model(target, "target", target_revision)
    with loading_errors(f"draft {draft!r}"):
        draft_tok = load_tokenizer(draft_src, draft_revision)
    with loading_errors(f"target {target!r}"):
        target_tok = load_tokenizer(target_src, target_revision)
    check_same_tokenizer(draft_tok, target_tok, draft, target)
    # `auto` is resolved once, here (timed on this pair, or read from the cached timing); everything
    # below - the memory check, both models, the record in manifests and reports - uses this choice.
    choice = _dtype_record(dtype, device, pair=(draft_src, target_src), workload=dtype_workload)
    if dtype in (None, "auto"):
        log.info("dtype auto -> %s (%s)", choice["dtype"], choice["reason"])
    dtype = resolve_dtype(choice["dtype"])
    pack = check_pair_fits(draft_src, target_src, dtype, offloaded=target_device_map is not None)
    with loading_errors(f"draft {draft!r}"):
        d_model = load_model(draft_src, dtype=dtype, device=device, revision=draft_revision, pack=pack)
    with loading_errors(f"target {target!r}"):
        t_model = load_model(
            target_src, dtype=dtype, device=device, device_map=target_device_map, revision=target_revision, pack=pack
        )
    pair = pair_from_models(
        d_model,
        t_model,
        target_tok,
        draft_name=draft,
        target_name=target,
        draft_revision=draft_revision,
        target_revision=target_revision,
        name=name,
        # Hub models are fingerprinted from their files in the cache (dtype-independent).
        draft_path=weights_folder(draft_src, draft_revision),
        target_path=weights_folder(target_src, target_revision),
    )
    pair.dtype_choice = choice
    if draft_quant:
        quantize_draft(pair, draft_quant, prefill_copy=draft_prefill_copy)
    return pair


def quantize_draft(pair: ModelPair, scheme: str, *, prefill_copy: bool = True) -> dict:
    """Quantize ``pair``'s draft in place (:func:`specstop.pair.quantize.quantize_weights`) and record the
    scheme in its identity; returns the quantization record (layers, bytes before and after).

    ``prefill_copy``: blocks of :data:`~specstop.pair.quantize.PREFILL_ROWS` rows and more run on a float
    copy of the weights (a decoder's prompt prefill at bf16's speed); False runs every row on the packed
    kernels (data generation's teacher-forced forwards, whose rows are draft steps)."""
    from dataclasses import replace

    from specstop.pair.quantize import PREFILL_ROWS, quantize_weights

    record = quantize_weights(pair.draft, scheme, prefill_rows=PREFILL_ROWS.get(scheme) if prefill_copy else None)
    pair.draft_identity = replace(pair.draft_identity, quant=record["scheme"])
    where = (f"blocks of {record['prefill_rows']}+ rows on a {record['prefill_copy_bytes'] / 1e6:.0f} MB float copy"
             if record["prefill_rows"] else "every row on the packed kernels")
    log.info("draft in weight-only %s: %d linear layers, %.0f -> %.0f MB per decode step (%s)", record["scheme"],
             record["layers"], record["bytes_before"] / 1e6, record["bytes_after"] / 1e6, where)
    return record


def self_draft(pair: ModelPair, scheme: str) -> ModelPair:
    """The target quantized as its own draft: a pair with the same target and, as its draft, a copy of
    the target whose linear layers are weight-only ``scheme`` (:func:`quantize_draft`). The copy costs
    the target's memory once more (packed weights plus the float prefill copy)."""
    import copy
    from dataclasses import replace

    variant = replace(pair, draft=copy.deepcopy(pair.target), draft_identity=pair.target_identity,
                      name=f"{pair.name}:self-{scheme}")
    quantize_draft(variant, scheme)
    return variant


def _dtype_record(dtype, device: str | None, *, pair: tuple[str, str] | None = None, workload: str = "decode") -> dict:
    """``{"dtype", "requested", "reason", ...}``: what the pair runs in and why (manifests, cost files, reports)."""
    from specstop.pair.dtype_choice import choose_dtype

    if dtype in (None, "auto"):
        rec = choose_dtype(device or default_device(), pair=pair, workload=workload).to_dict()
        rec["workload"] = workload
        rec["requested"] = "auto"
        return rec
    name = str(resolve_dtype(dtype)).replace("torch.", "")
    return {"dtype": name, "requested": str(dtype).replace("torch.", ""), "reason": f"requested {name}"}


def pair_from_models(
    draft_model,
    target_model,
    tokenizer,
    *,
    draft_name: str = "draft",
    target_name: str = "target",
    draft_revision: str | None = None,
    target_revision: str | None = None,
    name: str | None = None,
    draft_path: str | None = None,
    target_path: str | None = None,
) -> ModelPair:
    """Wrap already-loaded models (tests build tiny ones in memory).

    ``draft_path``/``target_path``: the folders the weights were read from (for the weights
    fingerprint; default: the names when they are folders, else the tensors in memory).
    """
    from specstop.pair.compat import check_supported_versions

    check_supported_versions()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    vocab_size = len(tokenizer)
    d_id = model_identity(draft_model, draft_name, draft_revision, weights_path=draft_path)
    t_id = model_identity(target_model, target_name, target_revision, weights_path=target_path)
    for ident in (d_id, t_id):
        if ident.logits_size < vocab_size:
            raise ValueError(
                f"{ident.name_or_path} has {ident.logits_size} output logits but the tokenizer has {vocab_size} tokens"
            )
    for m in (draft_model, target_model):
        m.eval()
        m.requires_grad_(False)
        install_fast_paths(m)
    return ModelPair(
        draft=draft_model,
        target=target_model,
        tokenizer=tokenizer,
        draft_identity=d_id,
        target_identity=t_id,
        tokenizer_hash=tokenizer_fingerprint(tokenizer),
        vocab_size=vocab_size,
        name=name,
    )
