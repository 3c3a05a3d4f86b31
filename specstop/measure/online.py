"""Online speed check: real decoding, side by side, with a spread - the measurement the replay predicts.

Method (``pipeline``'s online stage and ``benchmarks/online_speedup.py`` both run this):

* every method first runs once on a short generation (warm-up: allocator, kernel choice);
* then, for each repeat and each prompt, every method runs on that prompt in a shuffled order
  (interleaved, so drift and background load hit all methods alike);
* per prompt and method the *fastest* of the repeats is taken (other load on the machine only ever
  adds time: one repeat slowed 5-10x by a background job must not move the result), per prompt the
  ratio to the baseline
  (target alone through our decoder's own loop, ``max_draft=0``: same prefill, same cache code),
  and the summary is the **median of per-prompt ratios** with a bootstrap 90% interval over
  prompts (resampling prompts, 2000 times);
* sampled runs (``seeds=True``): repeat r decodes with seed r in every method, so each repeat is another
  sample of every prompt's response. Per prompt the time is pooled over the seeds - seconds per token =
  total seconds / total tokens - since the fastest repeat would be the luckiest sample; the spread over
  seeds (each seed's median over prompts) is reported beside it, and so are tokens per round against the
  sampled replay's (the acceptance part of a prediction, apart from its prices);
* ``decode`` ratios leave out each method's prompt prefill (both models' prefill for ours). The
  replay and the cost model predict exactly that phase, so predictions are compared with it:
  each run's own K histogram priced by the cost model (the same statistic: median of per-prompt
  predicted ratios); the replay of the same prompts cut to the same budget
  (:mod:`specstop.eval.same_prompts`: same statistic, and its rounds are compared K for K with the
  decoder's); and optionally the eval report's whole-split replay number (another workload, shown
  only). A measured / predicted pair more than 10% apart is flagged.
* measured seconds per round are put beside the cost model's mean round cost
  sum_r (K_r * t_draft + t_target(K_r)) / rounds for the same rounds: the decoder's own overhead.
* live prices: the step costs this very run paid, as ratios to the cost model (each method's draft
  step per drafted token, decision and verifications from its own phases; the target-only step from
  the baseline's runs), scale the cost model (:func:`specstop.decode.live_pricing.scaled`), and the
  replay of the same prompts (else the run's own rounds) priced with it is the *live* prediction: what
  the counts predict at the costs of the moment. A calibration minutes old can miss because the
  machine's steps moved since (on a 2-core AMD EPYC the target's steps ran 15-20% faster in the check
  than in the calibration three minutes before, the draft's 12%); the live prediction shows whether the
  counts and the cost model's shape still hold, and the row says how far each step moved.

Greedy runs are checked token for token against the baseline's output; a difference is listed
with the target's top-2 logit gap at the first differing token (a bf16 near-tie flip or a bug).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specstop.eval.replay import add_hists
from specstop.pair.cached_forward import sync

FLAG_TOLERANCE = 0.10
CI = 0.90
BOOTSTRAP = 2000


@dataclass
class Run:
    """One method on one prompt (one repeat).

    Attributes:
        tokens: generated ids. seconds: wall time of the whole call. prefill: seconds of prompt
        prefill inside it (None when the method cannot separate it). k_hist: rounds per drafted
        length K (ours), rounds: target forwards, phases: per-phase seconds (ours),
        round_seconds: summed wall time of the rounds (ours).
        priced: the cost model's seconds for this run's rounds, for methods whose rounds are not a
            chain K histogram (token trees: :func:`tree_method`); None otherwise.
    """

    tokens: list[int]
    seconds: float
    prefill: float | None = None
    k_hist: list[int] | None = None
    rounds: int | None = None
    phases: dict | None = None
    round_seconds: float | None = None
    priced: float | None = None

    @property
    def decode_seconds(self) -> float | None:
        return None if self.prefill is None else self.seconds - self.prefill


@dataclass
class Method:
    """A way to decode: ``fn(prompt_ids, max_new_tokens) -> Run``; ``spec`` (a PolicySpec) prices its
    decision cost in predictions; ``kind`` is "baseline", "ours" or "hf". ``cost``: this method's own cost
    model (another draft's, e.g. a quantized one) instead of the run's; ``priced``: False where no cost
    model describes the method (its rounds are then not priced)."""

    name: str
    fn: Callable[[list[int], int], Run]
    kind: str = "ours"
    spec: Any = None
    replay_speedup: float | None = None
    same_prompts: Any = None  # a specstop.eval.same_prompts.SamePromptsReplay for these prompts and budget
    cost: Any = None
    priced: bool = True
    seeded: bool = False  # fn takes seed=: sampled measurements decode repeat r with seed r


@dataclass
class Measurement:
    """Runs per method per prompt: ``runs[method][prompt] -> [Run per repeat]``."""

    prompts: int
    repeats: int
    max_new_tokens: int
    runs: dict[str, list[list[Run]]] = field(default_factory=dict)
    seconds: float = 0.0


def decoder_method(name: str, decoder, *, spec=None, max_draft: int | None = None, seed: int = 0,
                   replay_speedup: float | None = None, same_prompts=None, kind: str = "ours", cost=None,
                   priced: bool = True) -> Method:
    """A :class:`Method` running our :class:`~specstop.decode.chain.SpeculativeDecoder` (``cost``, ``priced``:
    see :class:`Method`)."""

    def fn(ids: list[int], max_new: int, seed: int = seed) -> Run:
        res = decoder.generate(ids, max_new, seed=seed, max_draft=max_draft)
        hist = np.bincount(np.asarray(res.round_lengths, dtype=np.int64), minlength=1).tolist()
        t = res.timings
        return Run(
            tokens=list(res.token_ids), seconds=t["total"], prefill=t["prefill"], k_hist=hist,
            rounds=len(res.round_lengths), phases={k: v for k, v in t.items() if isinstance(v, float)},
            round_seconds=float(sum(t["round_seconds"])),
        )

    return Method(name, fn, kind, spec, replay_speedup, same_prompts, cost, priced, seeded=True)


def tree_round_seconds(cost, round_nodes: list[int], draft_forwards: int,
                       draft_width_hist: list[int] | None = None) -> float:
    """The cost model's price of token-tree rounds.

    With the cost model's measured ``tree`` section (calibrate-cost): each round's target forward over
    its N nodes at the tree table's t_target_tree(N), and each draft forward at t_draft_width(W) for the
    W nodes it fed (``draft_width_hist[W]`` forwards, catch-up feeds included; interpolated in N and W).
    Without it (or without the widths): t_target(N) from the K table and every draft forward - a
    round's catch-up feed plus its tree expansions - at t_draft, which prices wide frontiers low.
    K = 0 rounds (target-only steps) cost t_target(0) either way.
    """
    tree_rounds = sum(1 for n in round_nodes if n > 0)
    if getattr(cost, "tree", None):
        target = sum(cost.tree_target_cost(n) if n > 0 else cost.target_cost(0) for n in round_nodes)
        if draft_width_hist:
            draft = sum(c * cost.tree_draft_cost(w) for w, c in enumerate(draft_width_hist) if c)
        else:
            draft = (tree_rounds + draft_forwards) * cost.tree_draft_cost(1)
        return float(target + draft)
    return float(sum(cost.target_cost(n) for n in round_nodes)) + (tree_rounds + draft_forwards) * cost.t_draft


def tree_method(name: str, decoder, *, cost=None, seed: int = 0) -> Method:
    """A :class:`Method` running a :class:`~specstop.decode.TreeDecoder`; with ``cost`` each run carries
    the cost model's price of its rounds (:func:`tree_round_seconds`)."""

    def fn(ids: list[int], max_new: int, seed: int = seed) -> Run:
        res = decoder.generate(ids, max_new, seed=seed)
        t = res.timings
        priced = (None if cost is None
                  else tree_round_seconds(cost, res.round_lengths, int(res.counters["draft_forwards"]),
                                          res.counters.get("draft_width_hist")))
        return Run(tokens=list(res.token_ids), seconds=t["total"], prefill=t["prefill"],
                   rounds=len(res.round_lengths), phases={k: v for k, v in t.items() if isinstance(v, float)},
                   round_seconds=float(sum(t["round_seconds"])), priced=priced)

    return Method(name, fn, seeded=True)


def _hf_generate(pair, ids: list[int], max_new: int, *, assistant=None, policy=None, target=None) -> Run:
    """One greedy ``target.generate`` call (optionally assisted, optionally driven by our policy) with a
    clean generation config, so no checkpoint default (repetition penalty, sampling knobs) applies.
    ``target`` replaces ``pair.target`` (e.g. a stock copy without specstop's fast paths)."""
    target = pair.target if target is None else target
    from transformers import GenerationConfig

    from specstop.decode.hf_assist import use_policy

    padded = list(range(pair.vocab_size, pair.target_identity.logits_size)) or None
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1, repetition_penalty=1.0,
                          eos_token_id=sorted(_eos(pair)), pad_token_id=pair.tokenizer.pad_token_id,
                          suppress_tokens=padded)
    x = torch.tensor([ids], device=pair.target_device)
    kw = {"assistant_model": assistant} if assistant is not None else {}
    sync(pair.target_device)
    t0 = time.perf_counter()
    with torch.no_grad():
        if policy is not None:
            with use_policy(target, policy, vocab_size=pair.vocab_size):
                out = target.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, **kw)
        else:
            out = target.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, **kw)
    sync(pair.target_device)
    return Run(tokens=_strip_eos(out[0, len(ids):].tolist(), _eos(pair)), seconds=time.perf_counter() - t0)


def hf_target_method(name: str, pair) -> Method:
    """The target alone through HF ``generate`` (what users compare with)."""
    return Method(name, lambda ids, max_new: _hf_generate(pair, ids, max_new), "hf")


def hf_policy_method(name: str, pair, policy) -> Method:
    """HF assisted generation whose draft length our policy decides (:mod:`specstop.decode.hf_assist`)."""
    return Method(name, lambda ids, max_new: _hf_generate(pair, ids, max_new, assistant=pair.draft, policy=policy),
                  "hf", policy.spec)


def hf_assisted_method(name: str, pair, *, num_assistant_tokens: int = 20, schedule: str = "constant",
                       confidence: float | None = 0.4, models: tuple | None = None) -> Method:
    """HF assisted generation, greedy. Defaults are transformers' own: 20 tokens, constant schedule,
    confidence threshold 0.4 (HF reads these from the assistant's generation config). ``models``:
    ``(draft, target)`` to run instead of the pair's (e.g. :func:`load_stock_models`)."""
    draft, target = models if models is not None else (pair.draft, pair.target)

    def fn(ids: list[int], max_new: int) -> Run:
        dgc = draft.generation_config
        saved = (dgc.num_assistant_tokens, dgc.num_assistant_tokens_schedule, dgc.assistant_confidence_threshold)
        dgc.num_assistant_tokens, dgc.num_assistant_tokens_schedule = num_assistant_tokens, schedule
        dgc.assistant_confidence_threshold = confidence
        try:
            return _hf_generate(pair, ids, max_new, assistant=draft, target=target)
        finally:
            dgc.num_assistant_tokens, dgc.num_assistant_tokens_schedule, dgc.assistant_confidence_threshold = saved

    return Method(name, fn, "hf")


def load_stock_models(pair) -> tuple:
    """``(draft, target)`` loaded again from the pair's folders with plain ``from_pretrained``, in the
    pair's dtype and device, *without* specstop's fast paths (:mod:`specstop.pair.fast_paths`): what a
    user of stock transformers runs. Costs a second copy of both models in memory."""
    from transformers import AutoModelForCausalLM

    out = []
    for ident, device in ((pair.draft_identity, pair.draft_device), (pair.target_identity, pair.target_device)):
        m = AutoModelForCausalLM.from_pretrained(ident.name_or_path, dtype=getattr(torch, ident.dtype))
        out.append(m.to(device).eval().requires_grad_(False))
    return tuple(out)


def _eos(pair) -> set[int]:
    from specstop.decode.chain import eos_token_ids

    return eos_token_ids(pair)


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def measure(prompts: list[list[int]], methods: list[Method], *, max_new_tokens: int, repeats: int = 2,
            warmup_tokens: int = 8, seed: int = 0, progress: bool = True, seeds: bool = False,
            between: Callable[[], None] | None = None) -> Measurement:
    """Run every method on every prompt ``repeats`` times, interleaved (see module docstring).

    ``seeds``: sampled decoding; repeat r decodes with seed r in every seeded method (common random
    numbers across methods), so the repeats are samples, not copies of one sample. ``between``: called
    after each prompt's methods (:class:`specstop.measure.in_run_cost.InRunTiming`'s timing passes).
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("the online check needs at least one prompt")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t0 = time.perf_counter()
    for m in methods:  # warm-up
        m.fn(prompts[0], min(warmup_tokens, max_new_tokens))
    meas = Measurement(len(prompts), repeats, max_new_tokens,
                       {m.name: [[] for _ in prompts] for m in methods})
    rng = random.Random(seed)
    bar = tqdm(total=repeats * len(prompts) * len(methods), unit="run", desc="online check", disable=not progress)
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            order = list(methods)
            rng.shuffle(order)
            for m in order:
                kw = {"seed": r} if seeds and m.seeded else {}
                meas.runs[m.name][i].append(m.fn(ids, max_new_tokens, **kw))
                bar.update(1)
            if between is not None:
                between()
    bar.close()
    meas.seconds = time.perf_counter() - t0
    return meas


def bootstrap_median(values: list[float], *, ci: float = CI, n: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float, float]:
    """Median of ``values`` and its bootstrap ``ci`` interval (resampling the values)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    meds = np.median(v[rng.integers(0, len(v), size=(n, len(v)))], axis=1)
    lo, hi = np.percentile(meds, [50 * (1 - ci), 50 * (1 + ci)])
    return float(np.median(v)), float(lo), float(hi)


def _per_prompt_fastest(runs: list[list[Run]], attr: str) -> list[float | None]:
    """Per prompt, the smallest ``attr`` over its repeats (None when a run cannot report it)."""
    out = []
    for rs in runs:
        vals = [getattr(r, attr) for r in rs]
        out.append(None if any(v is None for v in vals) else min(vals))
    return out


def _per_prompt_pooled(runs: list[list[Run]], attr: str) -> list[float | None]:
    """Per prompt, ``attr`` seconds summed over its repeats per token they emitted (sampled runs: every
    seed's sample counts, the lucky and the unlucky; None when a run cannot report it)."""
    out = []
    for rs in runs:
        vals = [getattr(r, attr) for r in rs]
        out.append(None if any(v is None for v in vals) else sum(vals) / max(sum(len(r.tokens) for r in rs), 1))
    return out


def _per_seed(base: list[list[Run]], runs: list[list[Run]], attr: str) -> list[float] | None:
    """Per repeat (seed), the median over prompts of baseline / method seconds per token (None when a run
    cannot report ``attr``)."""
    out = []
    for r in range(min(len(rs) for rs in runs)):
        ratios = []
        for b_rs, m_rs in zip(base, runs):
            b, m = getattr(b_rs[r], attr), getattr(m_rs[r], attr)
            if b is None or m is None:
                return None
            ratios.append((b / max(len(b_rs[r].tokens), 1)) / (m / max(len(m_rs[r].tokens), 1)))
        out.append(float(np.median(ratios)))
    return out


def summarize(meas: Measurement, methods: list[Method], *, baseline: str, cost=None,
              tolerance: float = FLAG_TOLERANCE, flips: list[dict] | None = None, sampled: bool = False,
              reference: str | None = None) -> dict:
    """Per-method speedups (median of per-prompt ratios, bootstrap interval), predictions and flags.

    ``sampled``: the runs are speculative *sampling* (their outputs are samples, not the target's
    greedy output), so no token-for-token comparison is made (``greedy_diffs`` is None); per prompt
    the repeats (seeds) are pooled (:func:`_per_prompt_pooled`) and each seed's speedup is reported
    (``decode_speedup_seeds``: median, min, max over seeds).
    ``reference``: a method every other is also compared with *paired per prompt* (e.g. Static
    SL-opt): the median over prompts of reference decode time / method decode time, with its bootstrap
    interval, beside the same statistic of the same-prompts replay. Two methods' intervals against
    the target overlap whenever prompts differ in difficulty; the paired ratio cancels that."""
    base = meas.runs[baseline]
    # Greedy runs emit the same tokens, so whole-call seconds compare; sampled runs emit samples of
    # different lengths (one hits EOS after 10 tokens, another runs to the cap): time per token, pooled
    # over the seeds.
    total_attr, decode_attr = "seconds", "decode_seconds"
    per_prompt = _per_prompt_pooled if sampled else _per_prompt_fastest
    base_total = per_prompt(base, total_attr)
    base_decode = per_prompt(base, decode_attr)
    base_tokens = [rs[0].tokens for rs in base]
    rows = {}
    for m in methods:
        runs = meas.runs[m.name]
        total = per_prompt(runs, total_attr)
        decode = per_prompt(runs, decode_attr)
        r_total = [b / t for b, t in zip(base_total, total)]
        row: dict[str, Any] = {"kind": m.kind, "speedup": bootstrap_median(r_total)}
        if all(d is not None for d in decode) and all(b is not None for b in base_decode):
            row["decode_speedup"] = bootstrap_median([b / d for b, d in zip(base_decode, decode)])
        if sampled and m.kind != "baseline":
            seeds = _per_seed(base, runs, "decode_seconds") or _per_seed(base, runs, "seconds")
            row["decode_speedup_seeds"] = [float(np.median(seeds)), min(seeds), max(seeds)]
        toks = [len(rs[0].tokens) for rs in runs]
        row["tokens"] = int(sum(toks))
        row["tok_s"] = statistics.median(len(r.tokens) / r.seconds for rs in runs for r in rs)
        row["greedy_diffs"] = None if sampled else sum(rs[0].tokens != bt for rs, bt in zip(runs, base_tokens))
        if runs[0][0].k_hist is not None:
            hists = [np.asarray(functools.reduce(add_hists, [r.k_hist for r in rs])) for rs in runs]  # per prompt
            n_round = sum(int(h.sum()) for h in hists)
            k_tot = sum(int((np.arange(len(h)) * h).sum()) for h in hists)
            row["rounds"] = n_round
            row["tokens_per_round"] = sum(len(r.tokens) for rs in runs for r in rs) / max(n_round, 1)
            row["drafted_per_round"] = k_tot / max(n_round, 1)
            # Per run seconds per round, then the median over runs: robust to a run slowed by other load.
            row["round_seconds"] = float(np.median([r.round_seconds / max(r.rounds, 1) for rs in runs for r in rs]))
            ph = {}
            for rs in runs:
                for r in rs:
                    for k, v in (r.phases or {}).items():
                        ph[k] = ph.get(k, 0.0) + v
            row["phases_per_round"] = {k: v / max(n_round, 1) for k, v in ph.items() if k not in ("total", "prefill")}
            own = m.cost if m.cost is not None else cost
            if own is not None and m.priced:
                c = own.for_policy(m.spec) if m.spec is not None else own
                row["predicted_round_seconds"] = float(np.median(
                    [c.total_hist(r.k_hist) / max(r.rounds, 1) for rs in runs for r in rs]))
                row["round_overhead"] = row["round_seconds"] / row["predicted_round_seconds"] - 1.0
                if m.kind != "baseline":
                    n_tok = [sum(len(r.tokens) for r in rs) for rs in runs]
                    pred = [c.target_only_per_token / float(c.latency_from_hist(h, n)) for n, h in zip(n_tok, hists)]
                    row["predicted_decode_speedup"] = float(np.median(pred))
        elif runs[0][0].priced is not None and cost is not None:  # token trees: priced per run
            row["rounds"] = sum(r.rounds for rs in runs for r in rs)
            row["tokens_per_round"] = sum(len(r.tokens) for rs in runs for r in rs) / max(row["rounds"], 1)
            row["round_seconds"] = float(np.median([r.round_seconds / max(r.rounds, 1) for rs in runs for r in rs]))
            row["predicted_round_seconds"] = float(np.median([r.priced / max(r.rounds, 1) for rs in runs for r in rs]))
            row["round_overhead"] = row["round_seconds"] / row["predicted_round_seconds"] - 1.0
            row["predicted_decode_speedup"] = float(np.median(
                [cost.target_only_per_token * sum(len(r.tokens) for r in rs) / sum(r.priced for r in rs) for rs in runs]))
        own = m.cost if m.cost is not None else cost
        if (own is not None and m.priced and m.kind != "hf" and runs[0][0].k_hist is not None
                and runs[0][0].phases):
            _live_prediction(row, own.for_policy(m.spec) if m.spec is not None else own, runs, base, m.same_prompts)
        if m.replay_speedup is not None:
            row["replay_speedup"] = m.replay_speedup
        if m.same_prompts is not None:
            from specstop.eval.same_prompts import trim

            row["replay_same_prompts"] = m.same_prompts.speedup
            row["replay_tokens_per_round"] = m.same_prompts.tokens_per_round
            if m.same_prompts.k_hists is not None:
                # Greedy + lossless: the decoder's rounds on a prompt are the replay's, K for K.
                row["rounds_as_replayed"] = sum(
                    trim(rs[0].k_hist or [0]) == h for rs, h in zip(runs, m.same_prompts.k_hists))
        meas_dec = (row.get("decode_speedup") or (None,))[0]
        flags = []
        # The whole-split replay is another workload (more prompts, a longer budget): it is shown, but
        # measured-vs-predicted is judged on the same prompts and budget whenever that replay exists.
        replay_key = "replay_same_prompts" if "replay_same_prompts" in row else "replay_speedup"
        for key in ("predicted_decode_speedup", replay_key, "live_predicted_decode_speedup"):
            p = row.get(key)
            if p and meas_dec and abs(meas_dec / p - 1.0) > tolerance:
                flags.append(f"measured {meas_dec:.2f}x vs {key.replace('_', ' ')} {p:.2f}x "
                             f"({100 * (meas_dec / p - 1):+.0f}%)")
        tpr, tpr_replay = row.get("tokens_per_round"), row.get("replay_tokens_per_round")
        if tpr and tpr_replay and abs(tpr / tpr_replay - 1.0) > tolerance:
            flags.append(f"tokens/round {tpr:.2f} vs replay {tpr_replay:.2f} ({100 * (tpr / tpr_replay - 1):+.0f}%)")
        row["flags"] = flags
        rows[m.name] = row
    if reference is not None:
        _paired_with_reference(meas, methods, rows, reference, lambda runs: per_prompt(runs, decode_attr), tolerance)
    return {"baseline": baseline, "reference": reference, "prompts": meas.prompts, "repeats": meas.repeats,
            "max_new_tokens": meas.max_new_tokens, "seconds": meas.seconds, "tolerance": tolerance,
            "ci": CI, "rows": rows, "flips": flips or [], "sampled": sampled,
            "all_identical": None if sampled else all(r["greedy_diffs"] == 0 for r in rows.values())}


def live_scales(cost, runs: list[list[Run]], base: list[list[Run]]) -> dict:
    """What this run's steps cost as ratios to ``cost``: ``{"draft", "decision", "verify", "single"}``.

    ``runs``' phases give the draft step per drafted token, the decision per drafted token and the
    target forwards against their table prices for the rounds' K; the baseline's (target-only steps)
    give the one-row step. A side not measured stays 1.0.
    """
    def totals(rs_list):
        draft = decision = target = priced_target = drafted = 0.0
        for rs in rs_list:
            for r in rs:
                h = np.asarray(r.k_hist or [0], dtype=np.float64)
                ks = np.arange(len(h))
                draft += (r.phases or {}).get("draft", 0.0)
                decision += (r.phases or {}).get("predictor", 0.0)
                target += (r.phases or {}).get("target", 0.0)
                priced_target += float(h @ cost.target_costs(len(h) - 1))
                drafted += float((ks * h).sum())
        return draft, decision, target, priced_target, drafted

    draft, decision, target, priced_target, drafted = totals(runs)
    _, _, b_target, b_priced, _ = totals(base)
    return {"draft": draft / drafted / cost.draft_step if draft > 0 and drafted and cost.draft_step > 0 else 1.0,
            "decision": (decision / drafted / cost.predictor_per_step
                         if decision > 0 and drafted and cost.predictor_per_step > 0 else 1.0),
            "verify": target / priced_target if target > 0 and priced_target > 0 else 1.0,
            "single": b_target / b_priced if b_target > 0 and b_priced > 0 else 1.0}


def _live_prediction(row: dict, cost, runs: list[list[Run]], base: list[list[Run]], same_prompts) -> None:
    """``live_scales`` and ``live_predicted_decode_speedup`` (module docstring) into ``row``."""
    from specstop.decode.live_pricing import scaled

    scales = live_scales(cost, runs, base)
    live = scaled(cost, **scales)
    row["live_scales"] = scales
    if row["kind"] == "baseline":
        return
    hists = (same_prompts.k_hists if same_prompts is not None and same_prompts.k_hists is not None
             else [functools.reduce(add_hists, [r.k_hist for r in rs]) for rs in runs])
    tokens = (same_prompts.tokens if same_prompts is not None and same_prompts.k_hists is not None
              else [sum(len(r.tokens) for r in rs) for rs in runs])
    pred = [live.target_only_per_token / float(live.latency_from_hist(h, n)) for h, n in zip(hists, tokens) if n]
    if pred:
        row["live_predicted_decode_speedup"] = float(np.median(pred))


def _paired_with_reference(meas: Measurement, methods: list[Method], rows: dict, reference: str,
                           per_prompt: Callable[[list[list[Run]]], list[float | None]], tolerance: float) -> None:
    """Adds ``vs_reference`` ([median, lo, hi] of per-prompt reference / method decode time) and, where
    both have a same-prompts replay, ``vs_reference_predicted`` (the replay's per-prompt ratio, median)."""
    if reference not in meas.runs:
        raise ValueError(f"reference method {reference!r} is not among the measured ones: {sorted(meas.runs)}")
    ref_t = per_prompt(meas.runs[reference])
    ref_m = next(m for m in methods if m.name == reference)
    for m in methods:
        if m.name == reference or m.kind == "baseline":
            continue
        t = per_prompt(meas.runs[m.name])
        if any(v is None for v in t + ref_t):
            continue
        row = rows[m.name]
        row["vs_reference"] = bootstrap_median([r / v for r, v in zip(ref_t, t)])
        if m.same_prompts is not None and ref_m.same_prompts is not None:
            pred = float(np.median([a / b for a, b in zip(m.same_prompts.per_prompt, ref_m.same_prompts.per_prompt)]))
            row["vs_reference_predicted"] = pred
            got = row["vs_reference"][0]
            if abs(got / pred - 1.0) > tolerance:
                row["flags"].append(f"vs {reference}: measured {got:.3f}x vs replay {pred:.3f}x "
                                    f"({100 * (got / pred - 1):+.0f}%)")


@torch.no_grad()
def greedy_flips(pair, prompts: list[list[int]], meas: Measurement, baseline: str) -> list[dict]:
    """Every greedy difference from the baseline's output, with the target's top-2 logit gap (float32
    logits of one forward over the shared prefix) at the first differing token."""
    out = []
    for name, runs in meas.runs.items():
        if name == baseline:
            continue
        for i, rs in enumerate(runs):
            ref, got = meas.runs[baseline][i][0].tokens, rs[0].tokens
            if ref == got:
                continue
            j = next((t for t, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            x = torch.tensor([prompts[i] + ref[:j]], device=pair.target_device)
            logits = pair.target(input_ids=x, logits_to_keep=1).logits[0, -1, : pair.vocab_size].float()
            top2 = logits.topk(2).values
            out.append({"method": name, "prompt": i, "token": j, "target_token": ref[j] if j < len(ref) else None,
                        "method_token": got[j] if j < len(got) else None, "top2_gap": float(top2[0] - top2[1])})
    return out


def to_markdown(summary: dict, *, flip_epsilon: float = 0.5) -> str:
    """The online table: measured (median, 90% interval) beside predicted, per method; flags; flips."""
    rows = summary["rows"]
    lines = [
        f"Measured on {summary['prompts']} prompts x {summary['repeats']} repeats x {summary['max_new_tokens']} "
        f"tokens, methods interleaved per prompt after a warm-up; speedup = median over prompts of "
        + ("(baseline s/token / method s/token, pooled over the repeats: each repeat samples with its own "
           "seed; seeds = the range of each seed's decode speedup)" if summary.get("sampled")
           else "(baseline seconds / method seconds)")
        + f", [{int(100 * summary['ci'])}% bootstrap interval]; baseline: "
        f"`{summary['baseline']}`. decode = prompt prefill left out (what the replay predicts).",
        "",
        "| method | speedup | decode speedup | predicted (cost model, these runs) | replay (these prompts) "
        "| predicted (live prices) | rounds as replayed | replay (test split) | tokens/round (replay) | s/round measured "
        "| s/round K*t_draft+t_target(K) | greedy diffs | flag |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        sp = r["speedup"]
        dec = r.get("decode_speedup")
        lines.append(
            f"| {name} | {sp[0]:.2f}x [{sp[1]:.2f}, {sp[2]:.2f}] | "
            + (f"{dec[0]:.2f}x [{dec[1]:.2f}, {dec[2]:.2f}]" if dec else "-")
            + (f"; seeds {r['decode_speedup_seeds'][1]:.2f}-{r['decode_speedup_seeds'][2]:.2f}"
               if r.get("decode_speedup_seeds") else "")
            + f" | {_x(r.get('predicted_decode_speedup'))} | {_x(r.get('replay_same_prompts'))} | "
            + f"{_x(r.get('live_predicted_decode_speedup'))} | "
            + ("-" if r.get("rounds_as_replayed") is None else f"{r['rounds_as_replayed']}/{summary['prompts']}")
            + f" | {_x(r.get('replay_speedup'))} | "
            + (f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "-")
            + (f" ({r['replay_tokens_per_round']:.2f})" if r.get("replay_tokens_per_round") else "")
            + f" | {_s(r.get('round_seconds'))} | {_s(r.get('predicted_round_seconds'))} | "
            + ("sampled" if r["greedy_diffs"] is None else str(r["greedy_diffs"])) + " | "
            + ("; ".join(r["flags"]) if r["flags"] else "")
            + " |"
        )
    moved = {n: r["live_scales"] for n, r in rows.items() if r.get("live_scales")}
    if moved:
        lines += ["", "Step costs in these runs against the cost model (live prices: the draft step per drafted token, "
                  "the target's verifications, and the target-only step of the baseline's runs):", ""]
        lines += [f"- {n}: draft {v['draft']:.2f}x, verification {v['verify']:.2f}x, target-only step {v['single']:.2f}x"
                  for n, v in moved.items()]
    ref = summary.get("reference")
    paired = {n: r for n, r in rows.items() if "vs_reference" in r}
    if ref and paired:
        lines += ["", f"Against `{ref}`, paired per prompt (median over prompts of its decode seconds / the method's, "
                  f"[{int(100 * summary['ci'])}% bootstrap interval]) beside the replay of the same prompts:", "",
                  f"| method | measured vs {ref} | replay (these prompts) vs {ref} |", "|---|---:|---:|"]
        for name, r in paired.items():
            v = r["vs_reference"]
            lines.append(f"| {name} | {v[0]:.3f}x [{v[1]:.3f}, {v[2]:.3f}] | "
                         + ("-" if r.get("vs_reference_predicted") is None else f"{r['vs_reference_predicted']:.3f}x")
                         + " |")
    flips = summary.get("flips") or []
    if flips:
        lines += ["", "Greedy differences from the target alone (first differing token, target's top-2 logit gap):"]
        for f in flips:
            near = "near-tie" if f["top2_gap"] < flip_epsilon else "NOT a near-tie"
            lines.append(f"- {f['method']}, prompt {f['prompt']}, token {f['token']}: gap {f['top2_gap']:.4f} ({near}, "
                         f"epsilon {flip_epsilon})")
    return "\n".join(lines)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _s(v) -> str:
    return "-" if v is None else f"{v:.3f}"
