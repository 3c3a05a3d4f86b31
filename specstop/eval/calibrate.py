"""``specstop calibrate-cost``: measure draft and target step costs on this hardware (SpecDec++ 5.2).

With a KV cache filled by the prompt, we time (``time.perf_counter``, CUDA synchronised):

* draft-only greedy runs of n steps, n in {1, 2, 4, 8, 16}: total(n) = c + t_draft * n;
* target verification passes over K + 1 tokens, K in {0, 1, 2, 4, 8, 16}:
  t_target(K) = a + b * (K + 1).

Both lines are fitted by least squares over all prompts and repeats and reported with R^2; the
target's line over K >= 1 only, because a single token (K = 0) runs through other kernels
(matrix-vector on a CPU) and gets its own cost, t_target_single = the mean at K = 0. The cost
model gets t_draft (slope), t_target = a (intercept), verify_per_token = b (slope; clamped at 0 when
noise makes it negative) and t_target_single. SpecDec++ Eq. 5.1 assumes b = 0; on a CPU it is not.
Optionally ``--checkpoint`` times a stopping predictor per draft step.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from specstop.errors import MissingInputError, UserError
from specstop.eval.cost import CostModel

log = logging.getLogger("specstop")

DEFAULT_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a Python function that checks whether a string is a palindrome.\n",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Explain in one paragraph what a hash table is.\n",
)
DRAFT_STEPS = (1, 2, 4, 8, 16)
VERIFY_K = (0, 1, 2, 4, 8, 16)


def add_arguments(p) -> None:
    p.add_argument("--pair", help="pair name or folder with draft/ and target/")
    p.add_argument("--draft", help="draft model folder or hub id (with --target)")
    p.add_argument("--target", help="target model folder or hub id (with --draft)")
    p.add_argument(
        "--prompts",
        help="text file (one prompt per line) or JSONL with a 'prompt'/'text' field; default: 4 built-in prompts",
    )
    p.add_argument("--max-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (after one warm-up)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--checkpoint", default=None, help="also time this stopping predictor per draft step")
    p.add_argument("--out", default="cost.json", help="cost model JSON to write")


def read_prompts(path: str | None, limit: int) -> list[str]:
    if not path:
        return list(DEFAULT_PROMPTS)[:limit]
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(
            f"--prompts {path}: no such file (give a text file, one prompt per line, or JSONL)"
        )
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            rec = json.loads(line)
            text = rec.get("prompt") or rec.get("text")
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


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _reset(cache, length: int) -> None:
    """Drop cached tokens beyond ``length`` (transformers 5: crop takes minus the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _prefill(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.past_key_values, out.logits[:, -1]


@torch.no_grad()
def time_pair(
    pair, prompts: list[str], *, repeats: int = 3, draft_steps=DRAFT_STEPS, verify_k=VERIFY_K
) -> dict:
    """Raw timings: ``{"draft": [(n, seconds)], "target": [(K, seconds)]}``."""
    tok = pair.tokenizer
    d_dev, t_dev = pair.draft_device, pair.target_device
    draft_rows, target_rows = [], []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        if ids.shape[1] < 2:
            continue
        d_cache, d_last = _prefill(pair.draft, ids.to(d_dev))
        t_cache, _ = _prefill(pair.target, ids.to(t_dev))
        plen = ids.shape[1]
        # A greedy draft continuation gives realistic tokens to verify.
        cont = []
        nxt = d_last.argmax(-1, keepdim=True)
        for _ in range(max(verify_k) + 1):
            cont.append(nxt)
            out = pair.draft(input_ids=nxt, past_key_values=d_cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        _reset(d_cache, plen)
        cont = torch.cat(cont, dim=1)
        for n in draft_steps:
            for r in range(repeats + 1):
                nxt = cont[:, :1].to(d_dev)
                _sync(d_dev)
                t0 = time.perf_counter()
                for _ in range(n):
                    out = pair.draft(input_ids=nxt, past_key_values=d_cache, use_cache=True)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                _sync(d_dev)
                dt = time.perf_counter() - t0
                _reset(d_cache, plen)
                if r:  # the first run is a warm-up
                    draft_rows.append((n, dt))
        for k in verify_k:
            block = cont[:, : k + 1].to(t_dev)
            for r in range(repeats + 1):
                _sync(t_dev)
                t0 = time.perf_counter()
                out = pair.target(input_ids=block, past_key_values=t_cache, use_cache=True)
                out.logits[:, -1].argmax(-1)
                _sync(t_dev)
                dt = time.perf_counter() - t0
                _reset(t_cache, plen)
                if r:
                    target_rows.append((k, dt))
    if not draft_rows:
        raise UserError("no usable prompts (each needs at least 2 tokens)")
    return {"draft": draft_rows, "target": target_rows}


def linfit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R^2)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    a_mat = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
    ss_res = float(((y - (a + b * x)) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(a), float(b), r2


def time_predictor(path: str, repeats: int = 200) -> float:
    """Seconds per single-row predictor call (batch 1, as at decode time)."""
    from specstop.eval.scoring import load_checkpoint

    predictor, _ = load_checkpoint(path)
    x = torch.zeros(1, predictor.feature_spec.input_dim)
    with torch.no_grad():
        for _ in range(10):
            torch.sigmoid(predictor(x))
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.sigmoid(predictor(x))
    return (time.perf_counter() - t0) / repeats


def calibrate(
    pair,
    prompts: list[str],
    *,
    repeats: int = 3,
    predictor_checkpoint: str | None = None,
    name: str = "calibrated",
    draft_steps=DRAFT_STEPS,
    verify_k=VERIFY_K,
) -> CostModel:
    """Time ``pair`` and fit a :class:`CostModel` (see module docstring)."""
    raw = time_pair(pair, prompts, repeats=repeats, draft_steps=draft_steps, verify_k=verify_k)
    dn, dt = zip(*raw["draft"])
    c, t_draft, r2_d = linfit(np.array(dn), np.array(dt))
    tk, tt = zip(*raw["target"])
    tk, tt = np.array(tk), np.array(tt)
    multi = tk >= 1
    if multi.sum() >= 2 and len(set(tk[multi])) >= 2:
        a, b, r2_t = linfit(tk[multi] + 1, tt[multi])
    else:  # only K = 0 timed: a flat line through it
        a, b, r2_t = float(tt.mean()), 0.0, 1.0
    single = float(tt[tk == 0].mean()) if (tk == 0).any() else None
    if t_draft <= 0:
        t_draft = float(np.mean(np.array(dt) / np.array(dn)))  # noise swamped the slope: use the mean step
    pred = time_predictor(predictor_checkpoint) if predictor_checkpoint else 0.0
    fit = {
        "draft": {"intercept": c, "per_step": t_draft, "r2": r2_d},
        "target": {"a": a, "b": b, "r2": r2_t},
        "device": {"draft": str(pair.draft_device), "target": str(pair.target_device)},
        "prompts": len(prompts),
        "repeats": repeats,
        "target_mean_by_k": {
            str(k): float(np.mean([t for kk, t in raw["target"] if kk == k])) for k in sorted(set(tk))
        },
        "draft_mean_by_n": {
            str(n): float(np.mean([t for nn, t in raw["draft"] if nn == n])) for n in sorted(set(dn))
        },
    }
    return CostModel(
        t_draft=max(t_draft, 0.0),
        t_target=max(a, 1e-9),
        verify_per_token=max(b, 0.0),
        t_target_single=single,
        predictor_per_step=pred,
        name=name,
        fit=fit,
    )


def run(args) -> int:
    from specstop.pair.registry import load_named_pair

    pair = load_named_pair(
        args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device
    )
    prompts = read_prompts(args.prompts, args.max_prompts)
    cost = calibrate(
        pair, prompts, repeats=args.repeats, predictor_checkpoint=args.checkpoint, name=Path(args.out).name
    )
    cost.save(args.out)
    f = cost.fit
    log.info(
        "t_draft %.5f s/step (R^2 %.3f); single target step %.5f s; t_target(K >= 1) = %.5f + %.5f*(K+1) s "
        "(R^2 %.3f); predictor %.2e s/step -> %s",
        cost.t_draft,
        f["draft"]["r2"],
        cost.single_step,
        f["target"]["a"],
        f["target"]["b"],
        f["target"]["r2"],
        cost.predictor_per_step,
        args.out,
    )
    return 0
