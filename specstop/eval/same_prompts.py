"""The replay's prediction for exactly the prompts and token budget an online check decodes.

An online check decodes a few prompts (say 8 x 64 tokens); the eval report's replay covers a whole
split at the dataset's budget (say 80 x 128). The two differ in workload - early response positions
are harder for the draft - so comparing them mixes a sampling difference into what should be a test
of the replay. This module replays the *same* prompts, cut to the *same* budget, and aggregates the
same way the online check does (median over prompts of per-prompt predicted speedups):

* greedy decoding is deterministic and our decoder is lossless, so the replay's rounds on those
  prompts are the decoder's rounds: their K histograms are compared prompt by prompt
  (``rounds_as_replayed`` in the online summary) - a check of the replay machinery on the real pair, not only on test models;
* what is left between this prediction and the measurement is the cost model and the decoder's own
  overhead, i.e. exactly what "measured within 10% of predicted" should test.

Sampled data (T > 0) are replayed as R realisations of the acceptance draws along each prompt's recorded
sample (:mod:`specstop.eval.sampled`), pooled per prompt: the prediction of what decoding those prompts
with fresh seeds gives on average. Rounds are then not compared K for K (each seed is another sample).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstop.eval.cost import CostModel
from specstop.eval.episodes import ReplayData, load_replay_data
from specstop.eval.replay import Counts, replay_prompt, score_key
from specstop.eval.sampled import DEFAULT_REPEATS, replayable
from specstop.probs import DecodingConfig


@dataclass
class SamePromptsReplay:
    """Replay of one policy on the online check's prompts.

    Attributes:
        speedup: median over prompts of ``t_target(0) * N_p / cost(K histogram of prompt p)``.
        k_hists: per prompt, the replayed rounds as a K histogram (trailing zeros trimmed); None for
            schemes whose rounds are not chain rounds (PEARL's phases).
        tokens: per prompt, emitted tokens.
        per_prompt: per prompt, the predicted speedup (what ``speedup`` is the median of).
        tokens_per_round: emitted tokens per target pass over every prompt (sampled: every realisation).
        copies: realisations of the acceptance draws per prompt (1 for greedy data).
    """

    speedup: float
    k_hists: list[list[int]] | None
    tokens: list[int]
    per_prompt: list[float]
    tokens_per_round: float | None = None
    copies: int = 1


def trim(hist) -> list[int]:
    """A K histogram without trailing zero bins (so decoder and replay histograms compare)."""
    h = [int(v) for v in hist]
    while len(h) > 1 and h[-1] == 0:
        h.pop()
    return h


def applies(generation: dict, max_new_tokens: int, decoding=None) -> bool:
    """Whether a dataset (its manifest's ``generation``) can predict an online check decoding
    ``max_new_tokens`` with ``decoding`` (a DecodingConfig; None: the dataset's own settings): the same
    temperature, top-k and top-p (a replay simulates the decoding its labels were drawn under) and within
    the budget it recorded."""
    if max_new_tokens > int(generation["max_new_tokens"]):
        return False
    if decoding is None:
        return True
    recorded = DecodingConfig.from_generation(generation)
    return decoding.greedy if recorded.greedy else decoding == recorded


def load_for_prompts(data_dir: str | Path, split: str, prompt_ids: list[str], max_new_tokens: int,
                     predictors: dict | None = None, *, repeats: int = DEFAULT_REPEATS) -> ReplayData:
    """The split's replay data for ``prompt_ids`` (in that order) cut to ``max_new_tokens``, scored by
    ``predictors`` ({score key: predictor module}) first, since scoring reads the whole split's rows.

    Sampled data come back as ``repeats`` realisations per prompt, prompt-major (prompt 0's copies,
    then prompt 1's, ...), with ``copies_per_prompt = repeats`` set on the result.

    Raises:
        KeyError: a prompt id the split does not hold.
        ValueError: ``max_new_tokens`` above the dataset's budget.
    """
    from specstop.eval.scoring import score_split

    data = load_replay_data(data_dir, split)
    for key, predictor in (predictors or {}).items():
        score_split(data, data_dir, split, key, predictor)
    index = {str(p): i for i, p in enumerate(data.prompt_ids)}
    missing = [p for p in prompt_ids if str(p) not in index]
    if missing:
        raise KeyError(f"{data_dir} split {split!r} has no prompt(s) {missing[:3]}")
    chosen = np.array([index[str(p)] for p in prompt_ids], dtype=np.int64)
    if data.temperature <= 0:
        return data.subset(chosen, max_new_tokens=max_new_tokens)
    # Realisations of the whole split (the same draws tune and eval use for these prompts), then ours.
    virtual = replayable(data, data_dir, split, repeats=repeats)
    copies = (np.arange(repeats)[None, :] * data.num_prompts + chosen[:, None]).reshape(-1)
    out = virtual.subset(copies, max_new_tokens=max_new_tokens)
    out.copies_per_prompt = repeats
    return out


def replay_same_prompts(data: ReplayData, spec, cost: CostModel) -> SamePromptsReplay:
    """Replay ``spec`` (a PolicySpec) on every prompt of ``data`` (already cut by :func:`load_for_prompts`)
    and price each prompt's rounds like the online check prices its runs."""
    key = score_key(spec)
    if key is not None and key not in data.row_scores:
        raise KeyError(f"no scores {key!r} for the learned policy; pass its predictor to load_for_prompts")
    c = cost.for_policy(spec)
    copies = int(getattr(data, "copies_per_prompt", 1))
    ratios, hists, toks = [], [], []
    total = Counts()
    for p in range(data.num_prompts // copies):
        counts = Counts()
        for i in range(p * copies, (p + 1) * copies):  # a sampled prompt's realisations, pooled
            counts.add(replay_prompt(data, i, spec))
        ratios.append(counts.metrics(c)["speedup"])  # the report's own pricing of these rounds
        hists.append(trim(counts.k_hist))
        toks.append(int(counts.n))
        total.add(counts)
    return SamePromptsReplay(float(statistics.median(ratios)), hists if copies == 1 else None, toks,
                             [float(r) for r in ratios], total.n / max(total.rounds, 1), copies)


def replay_policies(data_dir: str | Path, split: str, prompt_ids: list[str], max_new_tokens: int,
                    policies: dict, cost: CostModel) -> dict[str, SamePromptsReplay]:
    """:func:`replay_same_prompts` for every ``{name: StoppingPolicy}`` (static, confidence, exports).

    Learned policies are scored by their own predictor (a CPU copy: the decoder's may sit on a GPU). An
    export tuned per decoding setting is replayed with the setting the dataset's decoding picks.
    """
    import copy
    from dataclasses import replace

    from specstop.data_gen.storage import read_manifest

    decoding = DecodingConfig.from_generation(read_manifest(data_dir)["generation"])
    predictors, specs = {}, {}
    for name, pol in policies.items():
        if getattr(pol, "setting", None) is not None:
            pol.configure(decoding)
        spec = pol.spec
        key = score_key(spec)
        if key is not None:
            if key in predictors:  # two learned policies of one family: keep their scores apart
                spec = replace(spec, extra={**spec.extra, "scores": name})
                key = name
            predictors[key] = copy.deepcopy(pol.predictor).cpu()
        specs[name] = spec
    data = load_for_prompts(data_dir, split, prompt_ids, max_new_tokens, predictors)
    return {name: replay_same_prompts(data, spec, cost) for name, spec in specs.items()}


def pearl_same_prompts(data_dir: str | Path, split: str, prompt_ids: list[str], max_new_tokens: int,
                       cost: CostModel, gamma: int | None = None) -> SamePromptsReplay:
    """PEARL's timing model (:func:`specstop.eval.pearl.pearl_replay`, priced with the cost model's
    measured core split when it has one) on exactly the online check's prompts and budget."""
    from specstop.eval.pearl import pearl_replay

    data = load_for_prompts(data_dir, split, prompt_ids, max_new_tokens)
    copies = int(getattr(data, "copies_per_prompt", 1))
    ratios, toks = [], []
    for p in range(data.num_prompts // copies):
        m = pearl_replay(data.subset(np.arange(p * copies, (p + 1) * copies)), cost, gamma)
        ratios.append(float(m["speedup"]))
        toks.append(int(m["n"]))
    return SamePromptsReplay(float(statistics.median(ratios)), None, toks, ratios, copies=copies)
