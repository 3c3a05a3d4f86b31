"""The level models of a multi-level stack: found and loaded like the pair's own, and checked to fit it.

A level model sits between the pair's draft and target (:mod:`specstop.eval.stack_entry`); it runs in
the pair's dtype on the pair's device and must share its tokenizer, since every level verifies the
tokens of the level below over the shared vocabulary.
"""

from __future__ import annotations

from specstop.errors import UserError

__all__ = ["load_level_models", "locate_level_models"]


def _needs(names: list[str]) -> str:
    return f"the stack needs {', '.join(names)} between the draft and the target (--levels replaces them)"


def locate_level_models(names: list[str]) -> list[str]:
    """What to load for each of ``names`` (a checked folder or a hub id), before any model is loaded.

    Raises:
        UserError: one line naming the model that cannot be found and every model the stack needs.
    """
    from specstop.pair.sources import locate_model

    found = []
    for name in names:
        try:
            found.append(locate_model(name, "level model"))
        except UserError as err:
            raise UserError(f"level model {name}: {str(err).splitlines()[0]}; {_needs(names)}") from None
    return found


def load_level_models(names: list[str], pair) -> list:
    """The ``names`` models in the pair's dtype and on its device, each checked to share the pair's tokenizer.

    Raises:
        UserError: a model that cannot be found or loaded (the message names every model the stack needs),
            one with another tokenizer, or one with fewer logits than the shared vocabulary.
    """
    from specstop.pair.loader import load_model, load_tokenizer, tokenizer_fingerprint

    models = []
    for name, src in zip(names, locate_level_models(names)):
        try:
            tok = load_tokenizer(src)
            model = load_model(src, dtype=pair.target.dtype, device=str(pair.target.device))
        except (UserError, OSError) as err:
            raise UserError(f"level model {name}: {str(err).splitlines()[0]}; {_needs(names)}") from None
        if tokenizer_fingerprint(tok) != pair.tokenizer_hash:
            raise UserError(f"level model {name} has another tokenizer than the pair's; every level must share it "
                            f"({_needs(names)})")
        if model.get_output_embeddings().weight.shape[0] < pair.vocab_size:
            raise UserError(f"level model {name} has fewer logits than the pair's {pair.vocab_size} tokens")
        models.append(model)
    return models
