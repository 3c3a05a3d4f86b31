"""Time the pair's own forwards in every candidate CPU dtype: what ``dtype: auto`` decides from.

A synthetic matmul is not what the two models do: on a 2-core AMD EPYC (Zen 5) a one-row bf16
matmul timed 0.71x float32 while the real pair decoded 2.5x faster in bf16, so the old check picked
the slower dtype for every stage. This module loads each model once, in float32, and times the
three forwards decoding is made of, at a realistic context, then casts the same weights to bf16 in
place and times them again (one copy in memory at a time; casting back to float32 for the next
round is exact, so rounds alternate and drift hits both dtypes alike):

* ``step``: one token after ``CONTEXT_TOKENS`` of KV cache (a draft step, a target-only step);
* ``verify``: ``VERIFY_TOKENS`` tokens at once (the target verifying K = 8 drafted tokens);
* ``batch``: ``BATCH_ROWS`` sequences stepping one token each (batched data generation).

In each dtype every linear route that applies (``F.linear``, ``torch.mv`` for one row, one row
padded to two, oneDNN's packed weights: :mod:`specstop.pair.fast_paths`) is timed in the same
rounds, so the dtype and the route are settled by one measurement. About two minutes for the
0.5B/1.5B reference pair on a 2-core CPU, once per CPU, torch version, thread count and pair (the
result is cached).
"""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 64
VERIFY_TOKENS = 9  # K = 8 drafted tokens plus the token before them
BATCH_ROWS = 8
BATCH_CONTEXT = 16
ROUNDS = 2
REPS = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def variants() -> tuple[str, ...]:
    """``dtype+route`` for every linear route that applies to each candidate dtype in this torch build."""
    from specstop.pair.fast_paths import ROUTES, route_applies

    return tuple(f"{name}+{route}" for name, dtype in DTYPES.items() for route in ROUTES if route_applies(route, dtype))


def _cached_forward(model, rows: int, context: int, seed: int):
    """``(CachedForward over ``context`` random tokens for ``rows`` rows, the random tokens to feed)``."""
    from specstop.pair.cached_forward import CachedForward

    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (context + VERIFY_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return CachedForward(model, ids[:context], batch=rows), ids[context:]


def _time_dtype(model, routes: tuple[str, ...], *, verify: bool, reps: int, seed: int) -> list[dict[str, list[float]]]:
    """Per linear route in ``routes``, ``{"step": [...], "batch": [...][, "verify": [...]]}`` seconds for
    ``model`` in its current dtype. The routes share the filled caches and alternate rep by rep, so
    drift hits all alike."""
    from specstop.pair.fast_paths import apply_route

    single, feed = _cached_forward(model, 1, CONTEXT_TOKENS, seed)
    batch, batch_feed = _cached_forward(model, BATCH_ROWS, BATCH_CONTEXT, seed + 1)
    kinds = {"step": lambda: single.time_feed(feed[:1])[0], "batch": lambda: batch.time_feed(batch_feed[:1])[0]}
    if verify:
        kinds["verify"] = lambda: single.time_feed(feed[:VERIFY_TOKENS])[0]
    out: list[dict[str, list[float]]] = [{k: [] for k in kinds} for _ in routes]
    for rep in range(reps + 1):  # rep 0 warms up: allocator, kernel selection per shape
        for i, route in enumerate(routes):
            apply_route(model, route, keep_packed=True)
            for kind, fn in kinds.items():
                t = fn()
                if rep:
                    out[i][kind].append(t)
    return out


def time_model(source: str | torch.nn.Module, *, verify: bool, rounds: int = ROUNDS, reps: int = REPS,
               seed: int = 0) -> dict[str, dict[str, float]]:
    """Median seconds per forward kind for each of :data:`VARIANTS`.

    Args:
        source: a Hugging Face folder or hub id (loaded in float32), or a float32 model in memory
            (tests); it is cast in place and left in float32.
        verify: also time the ``VERIFY_TOKENS`` forward (the target's verification).

    Returns:
        ``{variant: {"step": s, "batch": s[, "verify": s]}}`` for every ``dtype+route`` of :func:`variants`.
    """
    from specstop.pair.fast_paths import apply_route, contiguous_output_head

    if isinstance(source, torch.nn.Module):
        model = source
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()
    contiguous_output_head(model)
    names = variants()
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in names}
    try:
        for r in range(rounds):
            for name, dtype in DTYPES.items():
                apply_route(model, "linear")  # packed copies are of the old dtype's weights
                model.to(dtype)  # bf16 -> float32 is exact: later float32 rounds time the same weights' shapes
                routes = tuple(v.split("+")[1] for v in names if v.split("+")[0] == name)
                got = _time_dtype(model, routes, verify=verify, reps=reps, seed=seed + r)
                for route, kinds in zip(routes, got):
                    for kind, ts in kinds.items():
                        samples[f"{name}+{route}"].setdefault(kind, []).extend(ts)
    finally:
        apply_route(model, "linear")
        model.to(torch.float32)
    return {v: {k: float(np.median(ts)) for k, ts in kinds.items()} for v, kinds in samples.items()}


def float32_room(draft: str, target: str) -> str | None:
    """Why the larger model cannot be timed in float32 here (not enough free memory), or None."""
    from pathlib import Path

    from specstop.errors import ResourceLimitError
    from specstop.memory import check_fits
    from specstop.pair.weights import estimated_load_bytes

    sizes = [estimated_load_bytes(s, 4) or 0 for s in (draft, target) if Path(s).is_dir()]
    try:
        check_fits(int(max(sizes, default=0) * 1.2), "timing the target in float32", "use --dtype bfloat16")
    except ResourceLimitError as err:
        return str(err).split(";")[0]
    return None


def measure_pair_dtypes(draft: str, target: str) -> dict:
    """Time the draft and then the target (one model in memory at a time) and decide.

    Returns:
        ``{"draft": {variant: {...}}, "target": {variant: {...}}, "routes": {dtype: route}, "decode":
        {dtype: s}, "generate": {dtype: s}, "seconds": s}`` where ``decode`` is a draft step + a target
        step + a K = 8 verification and ``generate`` a batched draft step + a batched target step,
        each in its dtype's fastest linear route.
    """
    t0 = time.perf_counter()
    log.info("dtype auto: timing the draft's and the target's forwards in float32 and bfloat16 "
             "(once per CPU, torch, threads and pair; about a minute)")
    figures = {}
    for role, src in (("draft", draft), ("target", target)):
        figures[role] = time_model(src, verify=role == "target")
        gc.collect()
    return {**figures, **decide(figures), "seconds": time.perf_counter() - t0}


def decide(figures: dict) -> dict:
    """Each dtype's linear route and each workload's total per dtype, from :func:`time_model` figures.

    A dtype's route is the one whose decoding (draft step + target step + K = 8 verification) is
    fastest; the stock ``linear`` route unless another beats it by 5% (a tie keeps the stock kernel).
    """
    d, t = figures["draft"], figures["target"]

    def decode(v: str) -> float:
        return d[v]["step"] + t[v]["step"] + t[v]["verify"]

    routes = {}
    for name in DTYPES:
        options = [v for v in d if v.split("+")[0] == name and v in t]
        if not options:
            continue
        best = min(options, key=decode)
        stock = f"{name}+linear"
        routes[name] = (best if stock not in options or decode(best) * 1.05 < decode(stock) else stock).split("+")[1]
    chosen = {dt: f"{dt}+{route}" for dt, route in routes.items()}
    return {"routes": routes,
            "decode": {dt: decode(v) for dt, v in chosen.items()},
            "generate": {dt: d[v]["batch"] + t[v]["batch"] for dt, v in chosen.items()}}


def describe(m: dict, workload: str) -> str:
    """One line of the figures that decided ``workload`` ("decode" or "generate")."""
    d, t = m["draft"], m["target"]
    parts = []
    for dt, route in m["routes"].items():
        v = f"{dt}+{route}"
        if workload == "generate":
            parts.append(f"{dt} ({route} route) batch-{BATCH_ROWS} steps draft {d[v]['batch']:.3f} s + target "
                         f"{t[v]['batch']:.3f} s")
        else:
            parts.append(f"{dt} ({route} route) draft step {d[v]['step']:.3f} s, target step {t[v]['step']:.3f} s, "
                         f"K=8 verification {t[v]['verify']:.3f} s")
    return "; ".join(parts)


def describe_routes(m: dict, dtype: str) -> str:
    """One line: the linear route chosen for ``dtype`` and every route's draft + target step on the pair."""
    d, t = m["draft"], m["target"]
    figures = ", ".join(f"{v.split('+')[1]} {d[v]['step'] + t[v]['step']:.3f} s"
                        for v in d if v.split("+")[0] == dtype and v in t)
    return (f"{dtype} linears via the {m['routes'][dtype]} route (timed on this pair, draft + target one-row step: "
            f"{figures})")
