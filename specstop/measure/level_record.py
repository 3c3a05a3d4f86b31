"""Record what a multi-level replay reads: every model's greedy token at the prefixes its rounds reach.

:func:`record_levels` decodes each prompt with the target alone (its greedy path), then runs the
replay's rounds (:mod:`specstop.eval.levels`) for every combination of rules asked for, with the stack's
models answering each prefix the record does not hold yet. Prefixes are shared between combinations and
between rounds, so a combination mostly reads what an earlier one recorded; each model keeps one KV cache,
cut back to the longest prefix it shares with the next query.
"""

from __future__ import annotations

import torch

from specstop.cache_prefix import cached_prefix
from specstop.decode.chain import _LM
from specstop.eval.levels import LevelRecord, replay_levels
from specstop.probs import DecodingConfig, logits_to_probs

__all__ = ["record_levels"]

#: Longest feed whose last row is scored directly; longer ones are fed as a block and a last step.
FEED_ROWS = 4


class _Stepper:
    """One model and its KV cache: greedy next token (and its probability) after any sequence."""

    def __init__(self, model, vocab_size: int) -> None:
        self.lm = _LM(model, static_cache=False, max_len=0, compile=False)
        self.vocab = vocab_size
        self.cached: list[int] = []
        self.forwards = 0

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[int, float]:
        shared = cached_prefix(self.cached, ids, 1)
        self.lm.rollback(shared)
        if len(ids) - shared > FEED_ROWS:
            # A long feed (the prompt) fills the cache first, as a decoder's prefill does: the step's own
            # logits then come from a short feed, on the kernels a quantized model's decode steps run.
            self.lm.feed(list(ids[shared:-1]), keep_logits=1)
            shared = len(ids) - 1
        logits, _ = self.lm.feed(list(ids[shared:]), keep_logits=1)
        self.cached = list(ids)
        self.forwards += 1
        probs = logits_to_probs(logits[-1], DecodingConfig(), self.vocab)
        top = int(probs.argmax())
        return top, float(probs[top])


def record_levels(models: list, prompts: list[tuple[str, list[int]]], budget: int, combos: list[list[str]], *,
                  vocab_size: int, eos: set[int], progress: bool = True) -> list[LevelRecord]:
    """One :class:`~specstop.eval.levels.LevelRecord` per prompt.

    Args:
        models: the stack, bottom first, the target last (e.g. ``[int4 draft, int4 target, target]``).
        prompts: ``(name, rendered prompt ids)`` per prompt.
        budget: new tokens per prompt.
        combos: the combinations of rules to record, one rule per gap, bottom first
            (``[["confidence:0.6", "static:8"], ...]``).
        vocab_size: the shared vocabulary (argmax and probabilities over it, as the decoders pick).
        eos: the ids that end a response.
        progress: show a bar (prompts x combinations, with forwards per second).
    """
    from tqdm.auto import tqdm

    steppers = [_Stepper(m, vocab_size) for m in models]
    records = []
    bar = tqdm(total=len(prompts) * (1 + len(combos)), desc="record levels", unit="replay", disable=not progress)
    for name, ids in prompts:
        path: list[int] = []
        while len(path) < budget and not (path and path[-1] in eos):  # the target alone, greedy
            path.append(steppers[-1](list(ids) + path)[0])
        bar.update(1)
        rec = LevelRecord(str(name), list(ids), int(budget), path, [{} for _ in models[:-1]], sorted(eos),
                          [list(c) for c in combos])

        def fill(level: int, seq: list[int]) -> tuple[int, float]:
            return steppers[level](seq)

        for combo in combos:
            replay_levels([rec], combo, fill=fill)
            bar.update(1)
            bar.set_postfix_str(" / ".join(f"{s.forwards} fwd" for s in steppers))
        records.append(rec)
    bar.close()
    return records
