"""Draft/target model pairs: loading, tokenizer checks, identities and the offline reference pair."""

from specstop.pair.loader import (
    ModelIdentity,
    ModelPair,
    TokenizerMismatchError,
    check_same_tokenizer,
    load_pair,
    pair_from_models,
)
from specstop.pair.registry import KNOWN_PAIRS, load_named_pair, resolve_pair

__all__ = [
    "KNOWN_PAIRS",
    "ModelIdentity",
    "ModelPair",
    "TokenizerMismatchError",
    "check_same_tokenizer",
    "load_named_pair",
    "load_pair",
    "pair_from_models",
    "resolve_pair",
]
