"""specstop: learned stopping predictors for speculative decoding, end to end.

The public API (documented in docs/decoders.md); everything else is internal and may move::

    from specstop import load_pair, StoppingPolicy, SpeculativeDecoder

    pair = load_pair(draft="DRAFT", target="TARGET")
    policy = StoppingPolicy.load("EXPORT_DIR_OR_REPO_ID")
    out = SpeculativeDecoder(pair, policy).generate(prompt_ids, max_new_tokens=128)

Names resolve on first use, so ``import specstop`` (and the CLI's start) loads neither torch nor
transformers, and the core install (no extras) is enough for every name here.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it.
_PUBLIC = {
    # pair
    "load_pair": "specstop.pair.loader",
    "pair_from_models": "specstop.pair.loader",
    "ModelPair": "specstop.pair.loader",
    "DecodingConfig": "specstop.probs",
    # a stopping policy (an export folder or hub repo) and the decoders it steers
    "StoppingPolicy": "specstop.export.runtime",
    "SpeculativeDecoder": "specstop.decode.chain",
    "DecodeResult": "specstop.decode.chain",
    "TreeDecoder": "specstop.decode.tree_decoder",
    "parse_tree_policy": "specstop.tree_policy",
    "PearlDecoder": "specstop.decode.pearl",
    "BatchedSpeculativeDecoder": "specstop.decode.batched",
    "BatchDecodeResult": "specstop.decode.batched",
    "MultiLevelDecoder": "specstop.decode.multilevel",
    "parse_pearl_policy": "specstop.decode.pearl_spec",
    # Hugging Face generate()
    "generate_with_policy": "specstop.decode.hf_assist",
    "assisted_generate": "specstop.decode.hf_assist",
    "use_policy": "specstop.decode.hf_assist",
    "custom_generate_source": "specstop.export.hub",
    # Hugging Face assisted generation with the settings `specstop export --for hf` writes
    "load_hf_settings": "specstop.decode.hf_settings",
    "apply_hf_settings": "specstop.decode.hf_settings",
    "generate_with_settings": "specstop.decode.hf_settings",
    "read_back_hf_settings": "specstop.decode.hf_settings",
    # errors every command raises for bad input
    "UserError": "specstop.errors",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'specstop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
