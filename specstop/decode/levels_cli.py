"""``specstop decode`` of a multi-level stack: ``--levels MODELS`` with one rule per gap, or an export of a
stack tuned by ``specstop tune --levels`` (:mod:`specstop.eval.stack_entry`)."""

from __future__ import annotations

import sys

from specstop.errors import UserError

__all__ = ["stack_decoder", "stack_request"]

#: Decode settings of the chain, tree and parallel decoders, which a stack does not run.
_CHAIN_ONLY = (("node_head", "--node-head"), ("target_init", "--target-init"), ("cost_model", "--cost-model"),
               ("pearl_cores", "--pearl-cores"), ("stop", "--stop"), ("static_cache", "--static-cache"),
               ("compile", "--compile"), ("compile_draft", "--compile-draft"), ("pin_policy", "--pin-policy"),
               ("pearl_no_pre_verify", "--pearl-no-pre-verify"), ("pearl_no_post_verify", "--pearl-no-post-verify"))


def stack_request(args, source) -> tuple[list[str], list[str]] | None:
    """``(models, rules)`` when ``decode`` runs a stack (``--levels``, or ``--policy`` an export of a
    tuned stack; ``source`` is that export's folder or None), else None. Every problem is one line
    before any model is loaded.

    ``--levels`` beside a stack export replaces its models (the same count: e.g. local copies of the
    hub ids it names); beside rules, ``--policy`` holds one rule per gap, bottom first.
    """
    from specstop.eval.stack_entry import parse_level_models, parse_level_rules, stack_from_export
    from specstop.pair.levels import locate_level_models

    exported = stack_from_export(source)
    levels = getattr(args, "levels", None)
    if exported is None and levels is None:
        return None
    for attr, flag in _CHAIN_ONLY:
        if getattr(args, attr, None) not in (None, False):
            raise UserError(f"{flag} does not apply to a multi-level stack; drop it")
    if exported is None:
        if source is not None:
            raise UserError(f"--levels: {args.policy} is an export of one pair's policy, not of a stack; give one "
                            "rule per gap (e.g. --policy static:2,static:6) or export `--policy levels`")
        models = parse_level_models(levels)
        rules = parse_level_rules(args.policy, len(models) + 1)
    else:
        models, rules = exported["models"], list(exported["policies"])
        if levels is not None:
            models = parse_level_models(levels)
            if len(models) != len(exported["models"]):
                raise UserError(f"--levels names {len(models)} models; {args.policy} was tuned for "
                                f"{len(exported['models'])} ({', '.join(exported['models'])})")
    locate_level_models(models)  # a missing model is named before the pair is loaded
    return models, rules


def stack_decoder(pair, models: list[str], rules: list[str], decoding):
    """The :class:`~specstop.decode.multilevel.MultiLevelDecoder` of the stack (its models loaded);
    says on stderr which models it runs."""
    from specstop.decode.multilevel import MultiLevelDecoder
    from specstop.pair.levels import load_level_models

    middle = load_level_models(models, pair)
    names = [pair.draft_identity.name_or_path, *models, pair.target_identity.name_or_path]
    print(f"multi-level stack, bottom first: {' -> '.join(names)}; rules {' / '.join(rules)}", file=sys.stderr)
    return MultiLevelDecoder(pair, middle, rules, decoding)
