"""``specstop tune --levels``: the rules of a multi-level stack, tuned jointly on a dataset's prompts.

The ``tune`` command's entry (:func:`main`) is :mod:`specstop.eval.tune_cli` with this module's stack
tuner: timing and recording the stack's models is measuring, which the eval layer below does not do.

The stack is the dataset's own pair (the draft at the bottom, the target on top) with the ``--levels``
models between them. Its forwards are timed on this machine (:func:`specstop.measure.level_cost.time_levels`),
its greedy tokens recorded on the split's prompts (:func:`specstop.measure.level_record.record_levels`)
and every combination of the per-gap grids replayed exactly and priced
(:func:`specstop.eval.levels.tune_levels`). The best combination becomes the tuned file's ``levels``
stack entry (:mod:`specstop.eval.stack_entry`), which ``specstop export --policy levels`` carries to
``specstop decode``.
"""

from __future__ import annotations

import logging

from specstop.errors import UserError

log = logging.getLogger("specstop")

#: Block sizes timed per level past the table's dense start (the cost reads linearly between them).
SPARSE_ROWS = (10, 12, 16, 22)
#: Ranked combinations kept in the tuned file.
KEEP_RANKED = 10

__all__ = ["main", "row_grid", "stack_pair", "tune_dataset_stack", "tune_stack"]


def row_grid(largest: int, dense: int = 8) -> list[int]:
    """1..``dense`` then :data:`SPARSE_ROWS` up to ``largest`` (always including ``largest``)."""
    rows = [*range(1, min(dense, largest) + 1), *(n for n in SPARSE_ROWS if dense < n < largest)]
    return sorted({*rows, largest})


def stack_pair(data_dir: str, *, device: str | None = None):
    """The pair that generated ``data_dir`` (its manifest's models and dtype), checked to be that pair.

    Raises:
        UserError: the manifest names no loadable pair, or the models there now are other models.
    """
    from specstop.data_gen.storage import read_manifest
    from specstop.pair.identity import check_same_pair
    from specstop.pair.loader import load_pair

    recorded = read_manifest(data_dir).get("pair") or {}
    draft, target = ((recorded.get(k) or {}).get("name_or_path") for k in ("draft", "target"))
    if not draft or not target:
        raise UserError(f"--levels: {data_dir}'s manifest names no draft and target to stack the levels between; "
                        "tune the stack on a dataset made by `specstop generate`")
    dtype = (recorded.get("dtype") or {}).get("dtype") or recorded["target"].get("dtype") or "auto"
    pair = load_pair(draft, target, dtype=dtype, device=device, draft_quant=recorded["draft"].get("quant"),
                     name=recorded.get("name"))
    check_same_pair(recorded, pair.to_dict(), what=f"--levels: the models at {draft} and {target} are not the pair "
                    f"that generated {data_dir}", fix="restore that pair's folders, or tune on this pair's data")
    return pair


def tune_stack(pair, models: list[str], prompts: list[tuple[str, list[int]]], max_new_tokens: int,
               grids: list[list[str]], context: list[int], *, budget_s: float, machine: dict | None = None,
               progress: bool = True) -> dict:
    """The stack entry of the best combination of ``grids`` for ``pair`` with ``models`` between its models.

    Args:
        pair: the bottom (draft) and top (target) of the stack.
        models: the level models, smallest first (folders or hub ids, as the entry names them).
        prompts: ``(name, rendered prompt ids)`` to tune on.
        max_new_tokens: tokens decoded per prompt.
        grids: one list of rules per gap, bottom first.
        context: token ids the forwards are timed after (a decoding context).
        budget_s: seconds of forward timing.

    Returns:
        ``{"schema_version", "models", "policies" (the best rules), "speedup", "ranked" (the best
        :data:`KEEP_RANKED` combinations), "level_cost", "prompts", "max_new_tokens"}``.
    """
    from specstop.decode.chain import eos_token_ids
    from specstop.eval.levels import level_combos, tune_levels
    from specstop.eval.stack_entry import stack_entry
    from specstop.measure.level_cost import time_levels
    from specstop.measure.level_record import record_levels
    from specstop.pair.levels import load_level_models
    from specstop.policy import parse_policy_string

    if len(grids) != len(models) + 1:
        raise UserError(f"a stack of {len(models) + 2} models needs {len(models) + 1} grids of rules, got {len(grids)}")
    stack = [pair.draft, *load_level_models(models, pair), pair.target]
    names = ["draft", *models, "target"]
    # The bottom feeds 1-token steps; each level above verifies blocks up to its drafting rules' cap + its token.
    rows = [[1, 2, 3], *(row_grid(max(parse_policy_string(r).cap for r in g) + 2) for g in grids)]
    cost = time_levels(stack, names, context, rows, vocab_size=pair.vocab_size, budget_s=budget_s, machine=machine,
                       progress=progress)
    records = record_levels(stack, prompts, max_new_tokens, level_combos(grids), vocab_size=pair.vocab_size,
                            eos=eos_token_ids(pair), progress=progress)
    ranked = tune_levels(records, grids, cost)
    best = ranked[0]
    log.info("levels: best %s (predicted %.3fx over the target alone) of %d combinations", " / ".join(best["policies"]),
             best["speedup"], len(ranked))
    return stack_entry(models, best["policies"], speedup=best["speedup"], ranked=ranked[:KEEP_RANKED],
                       level_cost=cost.to_dict(), prompts=len(prompts), max_new_tokens=int(max_new_tokens))


def tune_dataset_stack(data_dir: str, split: str, models: list[str], grids: list[list[str]], *, limit: int,
                       budget_s: float, progress: bool = True) -> dict:
    """:func:`tune_stack` on ``limit`` prompts of ``split`` of ``data_dir``, with its pair and its budget.

    The forwards are timed after a real decoding context of the dataset (a prompt and its response).
    """
    from specstop.data_gen.storage import load_table, read_manifest
    from specstop.measure.calibrate import context_from_data, machine_record

    seqs = load_table(data_dir, "sequences", split)
    if len(seqs) == 0:
        raise UserError(f"--levels: {data_dir} has no {split} prompts to tune the stack on; pick another --split")
    prompts = [(str(n), [int(i) for i in ids]) for n, ids in zip(seqs["prompt_id"], seqs["prompt_ids"])][:limit]
    max_new = int(read_manifest(data_dir)["generation"]["max_new_tokens"])
    pair = stack_pair(data_dir)
    context, tokens = context_from_data(data_dir)
    context = context[:tokens]
    return tune_stack(pair, models, prompts, max_new, grids, context, budget_s=budget_s,
                      machine=machine_record(pair, len(context)), progress=progress)


def main(argv: list[str]) -> int:
    """``specstop tune``: :func:`specstop.eval.tune_cli.main` that tunes a ``--levels`` stack too."""
    from specstop.eval.tune_cli import main as tune_main

    return tune_main(argv, stack_tuner=tune_dataset_stack)
