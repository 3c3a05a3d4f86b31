"""``specstop calibrate-cost``: measure this machine's draft step and t_target(K) table (SpecDec++ 5.2).

What decoding will pay is measured where decoding will run: the pair is loaded in the dtype and on
the device decoding uses (``dtype auto`` explains its choice), and both KV caches are filled to the
context length decoding sees (a dataset's mean prompt length plus half its response length with
``--data``, else ``--context-tokens``). Then, window after window until the time budget (default
60 s of measuring; about 90 s with loading on a 2-core CPU) is spent:

* one draft step (one token fed, greedy pick), a few times per window;
* one target pass over K + 1 tokens for every K in the grid (shuffled per window, so drift and other
  load spread over all K alike), the cache rolled back after each;
* between windows, the real chain decoder decodes from the same context (target-only steps and
  static K = 4 rounds, in turns), one window after each of its rounds.

The cost model gets the median per K (``target_by_k``, interpolated by the cost model), the median
draft step, and - for reference and for presets' sake - the least-squares line over K >= 1. A
plot of every sample, the medians and the line is written next to the JSON (``cost.png``).

Before the table is written it is checked (:mod:`specstop.eval.cost_check`): a K whose samples
spread too far, or that verifies more tokens for less time than a shorter K, is re-measured once
(half the budget again); each of the decoder's rounds is set against the round cost the window timed
right after it predicts (like with like, in the same minute: :func:`decoder_check`), and forwards whose
windows sat at two cost levels are reported (:func:`levels`) rather than averaged over silently. What
still fails is recorded in the file and printed in one line; ``tune``, ``eval`` and the pipeline refuse
such a table unless forced.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from specstop import clock
from specstop.errors import MissingInputError, UserError
from specstop.eval.cost import CostModel
from specstop.eval.cost_check import (
    order_problems,
    section_disagreement,
    spread_problems,
    table_problems,
    table_warnings,
)
from specstop.measure.step_timing import DRAFT_STEPS_PER_ROUND, K_GRID, MIN_ROUNDS, tree_inputs
from specstop.pair.cached_forward import CachedForward, sync

log = logging.getLogger("specstop")

DEFAULT_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a Python function that checks whether a string is a palindrome.\n",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Explain in one paragraph what a hash table is.\n",
)
# Token-tree costs (the cost model's "tree" section): verified tree nodes N, draft frontier widths W.
TREE_N_GRID = (1, 2, 4, 8, 16, 32)
TREE_W_GRID = (1, 2, 4, 8, 16)


def read_prompts(path: str | None, limit: int = 8) -> list[str]:
    if not path:
        return list(DEFAULT_PROMPTS)[:limit]
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"--prompts {path}: no such file (give a text file, one prompt per line, or JSONL)")
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError as err:
                raise UserError(f"{path}: a line is not valid JSON ({err}); give JSONL or plain text lines") from None
            text = rec.get("prompt") or rec.get("text") if isinstance(rec, dict) else None
            if not text:
                raise UserError(f"{path}: JSONL records need a 'prompt' or 'text' field")
            out.append(text)
        else:
            out.append(line.replace("\\n", "\n"))
        if len(out) >= limit:
            break
    if not out:
        raise UserError(f"{path} holds no prompts")
    return out


def context_from_data(data_dir: str) -> tuple[list[int], int]:
    """A real decoding context from a dataset: a test (else any) prompt + its response, and the
    length decoding sees on average (mean prompt length + max_new_tokens / 2)."""
    from specstop.data_gen.storage import load_table, read_manifest

    man = read_manifest(data_dir)
    seqs = load_table(data_dir, "sequences", "test")
    if len(seqs) == 0:
        seqs = load_table(data_dir, "sequences")
    if len(seqs) == 0:
        raise UserError(f"{data_dir} holds no sequences to take a context from")
    plen = [len(p) for p in seqs["prompt_ids"]]
    target = int(np.mean(plen) + man["generation"]["max_new_tokens"] / 2)
    ids: list[int] = []
    for p, r in zip(seqs["prompt_ids"], seqs["response_ids"]):
        ids += list(p) + list(r)
        if len(ids) >= target + 64:
            break
    return ids, target


def build_context(tokenizer, prompts: list[str], length: int) -> list[int]:
    """Prompt token ids concatenated (repeated if needed) to ``length`` + a margin for the blocks."""
    ids: list[int] = []
    while len(ids) < length + 64:
        for text in prompts:
            ids += tokenizer(text).input_ids
    return ids


class _BudgetSpent(Exception):
    """Raised between a decoder's rounds when the calibration's time budget is spent."""


#: The decoder's runs calibrate-cost interleaves with the table's forwards: (name, policy, max_draft, tokens).
DECODER_RUNS = (("target-only step", "static:1", 0, 6), ("static:4 round", "static:4", None, 12))


def time_pair(pair, context: list[int], *, context_tokens: int, budget_s: float = 60.0, k_grid=K_GRID,
              progress: bool = True, seed: int = 0, decoder: bool = False) -> dict:
    """Time the table's forwards in windows, and with ``decoder`` the real decoder's rounds between them.

    A window times every forward the table prices once, in shuffled order: :data:`DRAFT_STEPS_PER_ROUND`
    draft steps and one target pass over K + 1 tokens for every K of ``k_grid``, each at
    ``context_tokens`` of context and rolled back. With ``decoder``, the chain decoder decodes
    (:data:`DECODER_RUNS`: target-only steps, static K = 4 rounds, in turns, each run from the context)
    and a window is timed after each of its rounds, so each round has the table's forwards measured
    beside it, in the same minute: a machine that moves between levels moves both. The budget ends the
    timing only once every run has had a round, so a short one still checks both.

    Returns:
        ``{"draft": [s, ...], "target": {K: [s, ...]}, "rounds": windows, "seconds": S, "windows": [{"draft":
        median s, "target": {K: s}}, ...], "decoder": [{"run": name, "k": K, "seconds": s, "window": i}, ...]}``.
    """
    from tqdm.auto import tqdm

    ctx = context[:context_tokens]
    n_block = max(max(k_grid) + 1, DRAFT_STEPS_PER_ROUND)  # the draft steps read the block too
    block = context[context_tokens : context_tokens + n_block]
    if len(block) < n_block:
        raise UserError(f"context too short: need {context_tokens + n_block} tokens, have {len(context)}")
    draft = CachedForward(pair.draft, ctx, compiled=bool(getattr(pair, "compile_draft", False)))
    target = CachedForward(pair.target, ctx)
    # Warm-up: allocator, kernel choice (oneDNN primitives per shape), caches.
    draft.time_feed(block[:1])
    for k in sorted({0, 1, max(k_grid)}):
        target.time_feed(block[: k + 1])
    rng = random.Random(seed)
    draft_s: list[float] = []
    target_s: dict[int, list[float]] = {int(k): [] for k in k_grid}
    windows: list[dict] = []
    rounds_log: list[dict] = []
    t_start = clock.now()
    bar = tqdm(total=round(budget_s), unit="s", desc="calibrate", disable=not progress,
               bar_format="{desc} {bar} {n:.0f}/{total:.0f} s")

    def window() -> bool:
        """Time one window; True once the budget is spent (and the minimum taken)."""
        order = list(k_grid)
        rng.shuffle(order)
        steps = [draft.time_feed(block[i : i + 1])[0] for i in range(DRAFT_STEPS_PER_ROUND)]
        passes = {int(k): target.time_feed(block[: k + 1])[0] for k in order}
        draft_s.extend(steps)
        for k, t in passes.items():
            target_s[k].append(t)
        windows.append({"draft": float(np.median(steps)), "target": passes})
        elapsed = clock.now() - t_start
        bar.n = min(elapsed, budget_s)
        bar.set_description_str(
            f"calibrate (window {len(windows)}: draft step {np.median(draft_s):.3f} s, target K={min(k_grid)} "
            f"{np.median(target_s[min(k_grid)]):.3f} s, K={max(k_grid)} {np.median(target_s[max(k_grid)]):.3f} s)"
        )
        return len(windows) >= MIN_ROUNDS and elapsed >= budget_s

    if decoder:
        from specstop.decode.chain import SpeculativeDecoder
        from specstop.export.runtime import StoppingPolicy

        runs = [(name, SpeculativeDecoder(pair, StoppingPolicy.from_string(spec), live_pricing=False), cap, tokens)
                for name, spec, cap, tokens in DECODER_RUNS]
        for _, dec, cap, _ in runs:
            dec.generate(ctx, 2, max_draft=cap)  # warm-up: the decoder's own shapes

        def after_round(run: str):
            def record(k: int, seconds: float) -> None:
                rounds_log.append({"run": run, "k": int(k), "seconds": float(seconds), "window": len(windows)})
                # A short budget still checks every run: the budget ends the timing only once each has a round.
                if window() and len({r["run"] for r in rounds_log}) == len(runs):
                    raise _BudgetSpent

            return record

        try:
            while True:
                for name, dec, cap, tokens in runs:
                    dec.generate(ctx, tokens, max_draft=cap, on_round=after_round(name))
        except _BudgetSpent:
            pass
    else:
        while not window():
            pass
    bar.close()
    return {"draft": draft_s, "target": target_s, "rounds": len(windows), "seconds": clock.now() - t_start,
            "windows": windows, "decoder": rounds_log}


def _tree_parents(n: int) -> list[int]:
    """Region parents of a tree verification block: the pending token (-1) and ``n`` nodes below it in
    a binary tree (node i's parent is (i - 1) // 2), a shape between a chain and a star."""
    return [-1] + [(i - 1) // 2 for i in range(1, n + 1)]


def time_tree(pair, context: list[int], *, context_tokens: int, budget_s: float = 15.0, n_grid=TREE_N_GRID,
              w_grid=TREE_W_GRID, progress: bool = True, seed: int = 0) -> dict:
    """Token-tree costs at the calibration context: the ``tree`` section of the cost model.

    Interleaved like :func:`time_pair` (every size once per round, shuffled; at least
    :data:`MIN_ROUNDS` rounds, then until ``budget_s``), each forward rolled back by
    :meth:`CachedForward.time_feed`:

    * target: one forward over the pending token plus N tree nodes (``N + 1`` rows, the decoder's
      verification block) under the tree mask, for N in ``n_grid``;
    * draft: one forward over a frontier of W sibling nodes under the tree mask, for W in ``w_grid``.

    Returns:
        ``{"n_grid", "t_target_tree": {N: median s}, "w_grid", "t_draft_width": {W: median s},
        "iqr": {"target:N" | "draft:W": [q25, q75]}, "rounds", "seconds", "method"}``.
    """
    n_grid, w_grid = sorted({int(n) for n in n_grid}), sorted({int(w) for w in w_grid})
    need = max(max(n_grid) + 1, max(w_grid))
    block = context[context_tokens : context_tokens + need]
    if len(block) < need:
        raise UserError(f"context too short for the tree block: need {context_tokens + need} tokens, have {len(context)}")
    draft = CachedForward(pair.draft, context[:context_tokens])
    target = CachedForward(pair.target, context[:context_tokens])
    jobs = [("target", n, target, block[: n + 1], _tree_parents(n)) for n in n_grid]
    jobs += [("draft", w, draft, block[:w], [-1] * w) for w in w_grid]
    for _, _, model, tokens, parents in jobs:  # warm-up: kernel choice per shape
        model.time_feed(tokens, tree_inputs(model, parents))
    samples: dict = {("target", n): [] for n in n_grid} | {("draft", w): [] for w in w_grid}
    rng = random.Random(seed)
    t_start, rounds = clock.now(), 0
    while True:
        rng.shuffle(jobs)
        for kind, size, model, tokens, parents in jobs:
            samples[(kind, size)].append(model.time_feed(tokens, tree_inputs(model, parents))[0])
        rounds += 1
        if rounds >= MIN_ROUNDS and clock.now() - t_start >= budget_s:
            break
    if progress:
        log.info("calibrate: token-tree costs timed in %d rounds", rounds)
    return {
        "n_grid": n_grid,
        "t_target_tree": {n: float(np.median(samples[("target", n)])) for n in n_grid},
        "w_grid": w_grid,
        "t_draft_width": {w: float(np.median(samples[("draft", w)])) for w in w_grid},
        # Spreads, for reading the medians (the tree table is not re-measured like the K table).
        "iqr": {f"{kind}:{size}": [float(np.percentile(v, 25)), float(np.percentile(v, 75))]
                for (kind, size), v in samples.items()},
        "rounds": rounds,
        "seconds": clock.now() - t_start,
        "method": "interleaved rounds, medians; target: pending token + N nodes (binary tree) under the tree "
                  "mask; draft: W sibling nodes under the tree mask",
    }


def linfit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R^2)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    a_mat = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
    ss_res = float(((y - (a + b * x)) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(a), float(b), r2


def time_policy_step(policy, pair, *, repeats: int = 50) -> float:
    """Seconds per ``should_stop`` call of ``policy`` on realistic draft logits/hidden states (batch 1),
    features included (softmax, top-k): what the decoder pays per draft step on top of the forward."""
    from specstop.probs import DecodingConfig

    dev = pair.draft_device
    policy.configure(DecodingConfig(), pair.vocab_size)
    logits = torch.randn(pair.draft_identity.logits_size, device=dev).to(next(pair.draft.parameters()).dtype)
    hidden = torch.randn(pair.draft_identity.hidden_size, device=dev).to(logits.dtype)
    ts = []
    for r in range(repeats + 5):
        policy.reset()
        policy.should_stop(logits, hidden, position=0)  # j = 1 (hidden heads skip it)
        sync(dev)
        t0 = clock.now()
        policy.should_stop(logits, hidden, position=1)
        sync(dev)
        if r >= 5:
            ts.append(clock.now() - t0)
    return float(np.median(ts))


def machine_record(pair, context_tokens: int) -> dict:
    """Where the costs were measured (the cost model's ``machine``)."""
    from specstop.pair.fast_paths import route_record
    from specstop.pair.hardware import cpu_flags, cpu_model_name

    dev = torch.device(pair.target_device)
    rec = {
        "device": dev.type,
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": pair.target_identity.dtype,
        "dtype_reason": pair.dtype_record().get("reason"),
        "linear_route": route_record(),
        "context_tokens": int(context_tokens),
        "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if getattr(pair.draft_identity, "quant", None):  # the same key calibrate-cost --engine vllm writes
        rec["draft_quant"] = pair.draft_identity.quant
    if getattr(pair, "compile_draft", False):
        rec["draft_compiled"] = True
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)
    return rec


def fit_cost(raw: dict, *, name: str, machine: dict, policy_steps: dict | None = None) -> CostModel:
    """A measured :class:`CostModel` from :func:`time_pair`'s raw timings."""
    med = {k: float(np.median(v)) for k, v in sorted(raw["target"].items())}
    q = {k: [float(np.percentile(v, 25)), float(np.percentile(v, 75))] for k, v in sorted(raw["target"].items())}
    ks = np.array([k for k, v in raw["target"].items() for _ in v if k >= 1], dtype=float)
    ts = np.array([t for k, v in raw["target"].items() for t in v if k >= 1], dtype=float)
    if len(set(ks)) >= 2:
        a, b, r2 = linfit(ks + 1, ts)
    else:
        a, b, r2 = float(ts.mean()) if len(ts) else med[min(med)], 0.0, 1.0
    t_draft = float(np.median(raw["draft"]))
    pred = dict(policy_steps or {})
    fit = {
        "method": "interleaved rounds; medians per K (t_target(K) table); line over K >= 1 for reference",
        "rounds": raw["rounds"],
        "seconds": raw["seconds"],
        "draft": {"median": t_draft, "iqr": [float(np.percentile(raw["draft"], 25)), float(np.percentile(raw["draft"], 75))],
                  "samples": len(raw["draft"])},
        "target_median_by_k": {str(k): v for k, v in med.items()},
        "target_iqr_by_k": {str(k): v for k, v in q.items()},
        "line": {"a": a, "b": b, "r2": r2},
    }
    return CostModel(
        t_draft=t_draft,
        t_target=max(a, 1e-9),
        verify_per_token=max(b, 0.0),
        t_target_single=med.get(0),
        target_by_k=med,
        policy_per_step=pred or None,
        provenance="measured",
        machine=machine,
        name=name,
        fit=fit,
    )


def suspect_ks(raw: dict) -> list[int]:
    """The K whose samples fail the spread or order check (both ends of an order problem)."""
    med = {k: float(np.median(v)) for k, v in raw["target"].items() if v}
    return sorted({k for ks, _ in spread_problems(raw["target"]) + order_problems(med) for k in ks})


def remeasure(pair, context: list[int], raw: dict, ks: list[int], *, context_tokens: int, budget_s: float,
              progress: bool = True) -> dict:
    """Time ``ks`` again and tell a burst of load from the kernels' own shape.

    A K whose new median is within :data:`~specstop.eval.cost_check.DROP_TOLERANCE` of its first one
    is *reproduced*: both sets of samples are kept, and its place in the table is the machine's
    (one-row bf16 GEMMs, for instance, cost more than three-row ones on some CPUs). Any other K keeps
    only its new samples: the first ones met other load.
    """
    from specstop.eval.cost_check import DROP_TOLERANCE

    again = time_pair(pair, context, context_tokens=context_tokens, budget_s=budget_s, k_grid=tuple(ks),
                      progress=progress, seed=1)
    target = dict(raw["target"])
    reproduced = []
    for k, new in again["target"].items():
        old = target[k]
        if abs(np.median(new) - np.median(old)) <= DROP_TOLERANCE * np.median(old):
            reproduced.append(int(k))
            target[k] = list(old) + list(new)
        else:
            target[k] = list(new)
    return {**raw, "target": target, "remeasured": list(ks), "reproduced": reproduced,
            "seconds": raw["seconds"] + again["seconds"]}


def settle_order(pair, context: list[int], raw: dict, *, context_tokens: int, budget_s: float,
                 progress: bool = True) -> dict:
    """Order problems a re-measure left open, timed again side by side.

    A re-measured K can contradict K that were not re-measured (a spread K = 0 re-measured at 0.247 s
    against a K = 1 timed at 0.197 s in the first run): every K of such a problem is timed again in
    one interleaved run and keeps only its new samples. Where the order problem recurs there, side
    by side, it is the kernels' shape (reproduced, priced as measured); where it does not, it was noise.
    """
    reproduced = set(raw.get("reproduced") or [])
    med = {k: float(np.median(v)) for k, v in raw["target"].items() if v}
    open_ks = sorted({k for ks, _ in order_problems(med) if not set(ks) <= reproduced for k in ks})
    if not open_ks:
        return raw
    log.info("calibrate: timing K = %s again side by side (an order problem is left)", ", ".join(map(str, open_ks)))
    again = time_pair(pair, context, context_tokens=context_tokens, budget_s=budget_s, k_grid=tuple(open_ks),
                      progress=progress, seed=2)
    target = {**raw["target"], **{k: list(v) for k, v in again["target"].items()}}
    new_med = {k: float(np.median(v)) for k, v in again["target"].items()}
    recurred = {k for ks, _ in order_problems(new_med) for k in ks}
    return {**raw, "target": target, "remeasured": sorted(set(raw.get("remeasured") or []) | set(open_ks)),
            "reproduced": sorted((reproduced - set(open_ks)) | recurred),
            "seconds": raw["seconds"] + again["seconds"]}


def window_round_cost(window: dict, k: int) -> float:
    """What the table's forwards timed in ``window`` price a round of ``k`` drafted tokens at (a
    target-only step for K = 0), interpolated between the K timed, as the cost model does."""
    cost = CostModel(t_draft=window["draft"], t_target=1e-9, target_by_k=window["target"], provenance="measured")
    return cost.round_cost(int(k))


def decoder_check(raw: dict) -> dict:
    """Each of the decoder's runs against the table's forwards timed beside its rounds.

    Every round of :func:`time_pair`'s decoder runs is set against the round cost the window timed right
    after it predicts (:func:`window_round_cost`): like with like, in the same minute, so a machine that
    moves between levels moves both sides. A run's ratio is the median of its rounds' ratios.

    Returns:
        ``{run: {"measured": s, "predicted": s, "ratio": median measured / predicted, "ratio_iqr": [q1, q3],
        "rounds": n}}``, seconds per round (medians).
    """
    out = {}
    windows = raw.get("windows") or []
    for name in dict.fromkeys(r["run"] for r in raw.get("decoder") or []):
        rows = [(r["seconds"], window_round_cost(windows[r["window"]], r["k"])) for r in raw["decoder"]
                if r["run"] == name and r["window"] < len(windows)]
        if not rows:
            continue
        measured = np.array([m for m, _ in rows])
        predicted = np.array([p for _, p in rows])
        ratios = measured / predicted
        out[name] = {"measured": float(np.median(measured)), "predicted": float(np.median(predicted)),
                     "ratio": float(np.median(ratios)),
                     "ratio_iqr": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
                     "rounds": len(rows)}
    return out


#: Two levels are reported when the windows split into groups whose medians differ by this factor...
LEVEL_GAP = 1.15
#: ... and the smaller group holds at least this share of the windows.
LEVEL_SHARE = 0.15


def levels(values) -> list[dict] | None:
    """Two cost levels in a series of window timings, or None when it sits at one.

    The split of the sorted log-timings into a low and a high group with the least within-group
    variance (one-dimensional 2-means, exact); reported when the groups' medians differ by at least
    :data:`LEVEL_GAP` and the smaller holds at least :data:`LEVEL_SHARE` of the windows.

    Returns:
        ``[{"seconds": low median, "share": fraction}, {"seconds": high median, "share": fraction}]``.
    """
    v = np.sort(np.asarray([x for x in values if x > 0], dtype=np.float64))
    n = len(v)
    if n < 6:
        return None
    logs = np.log(v)
    best = None
    for i in range(1, n):
        lo, hi = logs[:i], logs[i:]
        sse = float(((lo - lo.mean()) ** 2).sum() + ((hi - hi.mean()) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, i)
    i = best[1]
    low, high = float(np.median(v[:i])), float(np.median(v[i:]))
    if high / low < LEVEL_GAP or min(i, n - i) / n < LEVEL_SHARE:
        return None
    return [{"seconds": low, "share": i / n}, {"seconds": high, "share": (n - i) / n}]


def machine_levels(raw: dict) -> dict:
    """``{"draft step" | "target K=k": levels}`` for every forward whose windows sat at two levels."""
    windows = raw.get("windows") or []
    out = {}
    series = {"draft step": [w["draft"] for w in windows]}
    for k in sorted({k for w in windows for k in w["target"]}):
        series[f"target K={k}"] = [w["target"][k] for w in windows if k in w["target"]]
    for name, values in series.items():
        found = levels(values)
        if found:
            out[name] = found
    return out


def describe_levels(found: dict, most: int = 3) -> str:
    """One line of the levels :func:`machine_levels` found (the ``most`` widest apart, and how many more)."""
    names = sorted(found, key=lambda n: found[n][0]["seconds"] / found[n][1]["seconds"])
    parts = [f"{name} {found[name][0]['seconds']:.3f} s ({100 * found[name][0]['share']:.0f}% of windows) and "
             f"{found[name][1]['seconds']:.3f} s ({100 * found[name][1]['share']:.0f}%)" for name in names[:most]]
    more = f"; {len(names) - most} more forwards alike" if len(names) > most else ""
    return "; ".join(parts) + more


def pearl_split(pair, cost: CostModel, *, context_tokens: int) -> dict | None:
    """PEARL's costs on this machine's core split (:class:`~specstop.decode.pearl.PearlDecoder`'s
    default): each model on its share, alone and beside the other; None where PEARL does not split
    cores (a GPU, or fewer than 2 cores).

    The target is timed on a post-verify pass of gamma + 1 tokens (gamma from the whole-machine
    table, PEARL's Theorem 1) and set against the same pass in the table: ``target_scale``.
    """
    from specstop.decode.pearl_spec import available_cores, split_cores
    from specstop.decode.pearl_timing import time_split
    from specstop.decode.pearl_workers import PearlWorkers
    from specstop.eval.pearl import pearl_gamma

    if pair.target_device.type != "cpu" or len(available_cores()) < 2:
        return None
    gamma = pearl_gamma(cost)
    with PearlWorkers(pair, split_cores(None)) as workers:
        m = time_split(workers, target_tokens=gamma + 1, context=context_tokens)
    return {"draft_step": m["draft_beside_target_s"], "target_scale": m["target_beside_draft_s"] / cost.target_cost(gamma),
            "measured": m}


def calibrate(pair, *, context: list[int], context_tokens: int, budget_s: float = 60.0, k_grid=K_GRID,
              policies: dict | None = None, name: str = "calibrated", progress: bool = True,
              check_decoder: bool = True, measure_pearl: bool = False,
              measure_tree: bool = False) -> tuple[CostModel, dict]:
    """Time ``pair`` at ``context_tokens`` of context, re-measure suspect K once and check the table
    against the decoder; returns the measured :class:`CostModel` (its ``fit`` carries the check) and
    the raw timings (for :func:`calibration_plot`). ``measure_tree`` adds the token-tree costs
    (:func:`time_tree`, a quarter of ``budget_s``) as the cost model's ``tree`` section."""
    raw = time_pair(pair, context, context_tokens=context_tokens, budget_s=budget_s, k_grid=k_grid, progress=progress,
                    decoder=check_decoder)
    suspects = suspect_ks(raw)
    if suspects:
        log.info("calibrate: re-measuring K = %s (spread or order check failed)", ", ".join(map(str, suspects)))
        raw = remeasure(pair, context, raw, suspects, context_tokens=context_tokens, budget_s=budget_s / 2,
                        progress=progress)
        raw = settle_order(pair, context, raw, context_tokens=context_tokens, budget_s=budget_s / 2,
                           progress=progress)
    steps = {n: time_policy_step(p, pair) for n, p in (policies or {}).items()}
    cost = fit_cost(raw, name=name, machine=machine_record(pair, context_tokens), policy_steps=steps)
    if check_decoder:
        cost.fit["decoder_check"] = decoder_check(raw)
    found = machine_levels(raw)
    if found:
        cost.fit["levels"] = found
    cost.fit["check"] = {"remeasured": raw.get("remeasured", []), "reproduced": raw.get("reproduced", [])}
    cost.fit["check"]["problems"] = table_problems(cost)
    cost.fit["check"]["warnings"] = table_warnings(cost)
    if measure_pearl:
        split = pearl_split(pair, cost, context_tokens=context_tokens)
        if split:
            cost = replace(cost, pearl_split=split)
    if measure_tree:
        cost = replace(cost, tree=checked_side_table(
            "token-tree", lambda: time_tree(pair, context, context_tokens=context_tokens, budget_s=budget_s / 4,
                                            progress=progress), lambda t: tree_disagreement(t, cost)))
    return cost, raw


def tree_disagreement(tree: dict, cost: CostModel) -> str | None:
    """Where the tree table times the chain's forwards (a tree of N nodes in a chain = K = N; one
    draft node = a draft step), do the two agree? One line if not."""
    k_max = max((int(k) for k in cost.target_by_k or {}), default=0)
    target = {int(n): t for n, t in tree["t_target_tree"].items() if int(n) <= k_max}
    draft = {int(w): t for w, t in tree["t_draft_width"].items() if int(w) == 1}
    problems = []
    if out := section_disagreement(target, {n: cost.target_cost(n) for n in target}):
        problems.append(f"target: {out[1]}")
    if out := section_disagreement(draft, {1: cost.t_draft}):
        problems.append(f"draft: {out[1]}")
    return "; ".join(problems) or None


def batch_disagreement(batch: dict, cost: CostModel) -> str | None:
    """Does the batch table's B = 1 row agree with the K table it repeats? One line if not."""
    one = batch["t_target"].get(1, batch["t_target"].get("1"))
    if not one:
        return None
    out = section_disagreement(one, {k: cost.target_cost(int(k)) for k in one})
    return f"B=1: {out[1]}" if out else None


def checked_side_table(what: str, measure, disagreement) -> dict:
    """``measure()`` a side table (token trees, batch sizes) and check it against the K table with
    ``disagreement(table) -> str | None``; a table that disagrees is measured once more (a burst of
    load is not a verdict), and what still disagrees is recorded under ``check`` and warned about.

    Where the second measurement repeats the first (its timings' median ratio within 10%), the disagreement is
    the side path's own cost on this device, not load: on a GPU, for one, a tree forward's 4D mask
    adds launches a chain step does not have. That is said as such (``reproduced``), not blamed on
    a busy machine.
    """
    table = measure()
    problem = disagreement(table)
    reproduced = False
    if problem:
        log.info("calibrate: %s costs disagree with the K table (%s); measuring them once more", what, problem)
        first, table = table, measure()
        problem = disagreement(table)
        reproduced = problem is not None and tables_repeat(first, table)
        if reproduced:
            log.info("calibrate: %s costs differ from the K table in both measurements (%s): that is this "
                     "path's own cost on this device, kept as measured", what, problem)
        elif problem:
            log.warning("calibrate: %s costs still disagree with the K table after a re-measure (%s); the "
                        "machine was probably busy - rerun calibrate-cost on an idle machine", what, problem)
    table["check"] = {"agrees_with_k_table": problem is None, "problem": problem}
    if reproduced:
        table["check"]["reproduced"] = True
    return table


def tables_repeat(first: dict, second: dict, tolerance: float = 0.10) -> bool:
    """Do two measurements of one side table agree: the median ratio of their timings (its ``t_*``
    sections), entry by entry, within ``tolerance`` of 1?"""
    def leaves(table, prefix=()):
        for key, value in table.items():
            if isinstance(value, dict):
                yield from leaves(value, (*prefix, str(key)))
            elif isinstance(value, int | float) and value > 0:
                yield (*prefix, str(key)), float(value)

    def timings(table):
        return dict(leaves({k: v for k, v in table.items() if str(k).startswith("t_") and isinstance(v, dict)}))

    a, b = timings(first), timings(second)
    shared = sorted(a.keys() & b.keys())
    # The median ratio, as the K-table check itself judges a side table: one noisy size is not a verdict.
    return bool(shared) and abs(float(np.median([a[k] / b[k] for k in shared])) - 1) <= tolerance


def calibration_plot(path: Path, cost: CostModel, raw: dict) -> Path:
    """Every timed target pass, the per-K medians (the table the cost model interpolates) and the
    least-squares line; the draft step's spread in the corner."""
    from specstop.eval.plots import _plt

    plt = _plt()
    fig, (ax, axd) = plt.subplots(1, 2, figsize=(9.6, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    rng = np.random.default_rng(0)
    for k, v in raw["target"].items():
        ax.plot(k + rng.uniform(-0.15, 0.15, len(v)), v, ".", color="tab:blue", alpha=0.35, ms=4)
    kmax = max(raw["target"])
    ks = np.arange(kmax + 1)
    ax.plot(ks, cost.target_costs(kmax), "-", color="tab:blue", lw=2, label="t_target(K): medians, interpolated")
    line = cost.fit["line"]
    ax.plot(ks[1:], line["a"] + line["b"] * (ks[1:] + 1), "--", color="tab:gray",
            label=f"line over K>=1: {line['a']:.3f} + {line['b']:.4f}(K+1), R^2 {line['r2']:.2f}")
    ax.set_xlabel("K drafted tokens (target pass over K + 1 tokens; K = 0: one token)")
    ax.set_ylabel("seconds per target pass")
    m = cost.machine or {}
    ax.set_title(f"{m.get('cpu') if m.get('device') == 'cpu' else m.get('gpu', m.get('device'))}, {m.get('dtype')}, "
                 f"context {m.get('context_tokens')}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    axd.boxplot([raw["draft"]], tick_labels=["draft step"])
    axd.set_ylim(bottom=0)
    axd.set_title(f"t_draft {cost.t_draft:.4f} s", fontsize=9)
    axd.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
