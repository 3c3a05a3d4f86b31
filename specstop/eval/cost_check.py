"""Is a cost table fit to price rounds? Checked before anything trusts it.

A t_target(K) table is only as good as its samples. On a 2-core AMD EPYC (Zen 5) a float32
calibration read 1.94 / 0.86 / 3.77 / 0.65 s at K = 1 / 2 / 3 / 8: a longer verification cannot
be 4x cheaper than a shorter one, yet the tuner priced rounds with it and the report showed the
Oracle slower than Static SL-opt. Three checks catch such a table:

* **spread**: the interquartile range of each K's samples, relative to its median, stays within
  :data:`SPREAD_LIMIT`; calibration re-measures the K that do not, and reports what still spreads
  (:func:`table_warnings`) without refusing it - medians are robust to spread, orders are not;
* **order**: t_target(K) does not fall as K grows, beyond :data:`DROP_TOLERANCE` of noise - unless a
  re-measure reproduced it. Kernels do have such shapes: on a 2-core AMD EPYC (Zen 4) a one-row bf16
  GEMM costs more than a three-row one (2.2 vs 1.8 ms for the 1.5B target's MLP), and float32 sgemm
  costs 2x and 3x one row at two and three rows, then less at four (``benchmarks/float32_gemm.py``).
  A shape that reproduces is the machine's and is priced as measured; one that does not is noise;
* **decoder agreement**: the rounds the real decoder runs cost what the table says, within
  :data:`DECODER_TOLERANCE` (calibrate-cost decodes a few tokens after timing the table).

``tune``, ``eval`` and the pipeline refuse a table that fails, in one line naming the K and the
figure, unless forced (``--force-cost`` / ``force_cost: true``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specstop.errors import UserError

SPREAD_LIMIT = 0.20
DROP_TOLERANCE = 0.10
DECODER_TOLERANCE = 0.15
# Differences below this many seconds are timer and interpreter noise, not what the checks are about
# (they matter for millisecond forwards of tiny test models, never for a real pair's).
NOISE_FLOOR_S = 0.005


def spread_problems(samples: Mapping[int, Sequence[float]], limit: float = SPREAD_LIMIT) -> list[tuple[tuple[int, ...], str]]:
    """``((k,), "K=k spread x% ...")`` for every K whose samples' IQR / median exceeds ``limit``."""
    out = []
    for k, v in sorted(samples.items()):
        if len(v) < 3:
            continue
        q1, med, q3 = np.percentile(v, [25, 50, 75])
        out += _spread(k, float(q1), float(med), float(q3), limit)
    return out


def _spread(k: int, q1: float, med: float, q3: float, limit: float) -> list[tuple[tuple[int, ...], str]]:
    rel = (q3 - q1) / med if med > 0 else np.inf
    if rel <= limit or q3 - q1 <= NOISE_FLOOR_S:
        return []
    return [((k,), f"K={k} spread {100 * rel:.0f}% (IQR {q1:.3f}-{q3:.3f} s around {med:.3f} s; limit {100 * limit:.0f}%)")]


def order_problems(medians: Mapping[int, float], tolerance: float = DROP_TOLERANCE) -> list[tuple[tuple[int, ...], str]]:
    """``((a, b1, b2, ...), "t_target(K=a) ... is above longer verifications ...")`` for every K = a that
    costs more, beyond noise, than verifications of more tokens (K = b1, b2, ... > a): one problem per
    suspect K, naming the longer passes it contradicts."""
    out = []
    ks = sorted(medians)
    for i, a in enumerate(ks):
        below = [b for b in ks[i + 1 :]
                 if medians[b] < medians[a] * (1.0 - tolerance) and medians[a] - medians[b] > NOISE_FLOOR_S]
        if below:
            lows = ", ".join(f"K={b} {medians[b]:.3f} s" for b in below)
            out.append(((a, *below), f"t_target(K={a}) {medians[a]:.3f} s is above longer verifications ({lows}): "
                                     "verifying more tokens cannot be cheaper"))
    return out


def decoder_problems(check: Mapping | None, tolerance: float = DECODER_TOLERANCE) -> list[str]:
    """The decoder-agreement part of a calibration's check (see :func:`specstop.measure.calibrate.decoder_check`)."""
    out = []
    for name, rec in (check or {}).items():
        ratio = rec.get("ratio")
        if ratio is not None and abs(ratio - 1.0) > tolerance and abs(rec["measured"] - rec["predicted"]) > NOISE_FLOOR_S:
            out.append(f"{name}: the decoder measured {rec['measured']:.3f} s per round where the table predicts "
                       f"{rec['predicted']:.3f} s ({ratio:.2f}x)")
    return out


def table_problems(cost) -> list[str]:
    """Every problem of a :class:`~specstop.eval.cost.CostModel`'s table (empty: fit to use).

    Presets are not checked (they say they are presets wherever they are used); measured tables are
    checked on their medians, on their samples' spread where the file kept it, and on the decoder
    agreement its calibration recorded.
    """
    if cost.is_preset or not cost.target_by_k:
        return []
    fit = cost.fit or {}
    problems = []
    reproduced = set((fit.get("check") or {}).get("reproduced") or [])
    problems += [msg for ks, msg in order_problems(cost.target_by_k) if not set(ks) <= reproduced]
    problems += decoder_problems(fit.get("decoder_check"))
    return problems


def table_warnings(cost) -> list[str]:
    """The K whose samples still spread beyond :data:`SPREAD_LIMIT` after calibration's re-measure.

    A wide spread makes a K a suspect to re-measure, but the median it leaves is robust to it; on a
    noisy host (a 2-core VM measured 20-28% IQR at K = 0 with nothing else running) a refusal would
    fail every other calibration. So spread is reported, and what is refused is what spread can
    hide: an order no re-measure reproduced, and rounds the decoder does not pay.
    """
    if cost.is_preset or not cost.target_by_k:
        return []
    out = []
    for k, (q1, q3) in sorted((int(k), v) for k, v in ((cost.fit or {}).get("target_iqr_by_k") or {}).items()):
        if k in cost.target_by_k:
            out += [msg for _, msg in _spread(k, q1, cost.target_by_k[k], q3, SPREAD_LIMIT)]
    return out


def require_usable(cost, *, force: bool = False, flag: str = "--force-cost") -> list[str]:
    """Refuse a cost table that fails :func:`table_problems` unless ``force``; returns the problems.

    Raises:
        UserError: one line naming the cost model, each problem and the two ways out.
    """
    problems = table_problems(cost)
    if problems and not force:
        raise UserError(
            f"cost model {cost.name} fails its check: {'; '.join(problems)}. Re-run `specstop calibrate-cost` (a "
            f"pipeline rerun measures again) on an idle machine, or pass {flag} (pipeline: force_cost: true) to price "
            "with it anyway"
        )
    return problems


#: A side table (token trees, batch sizes) timed after the K table must agree with it where both
#: time the same forward, within this ratio either way. They run different code paths (a tree mask,
#: B copies of the context), so small differences are real; a burst of load on the machine is not.
SECTION_TOLERANCE = 0.20


def section_disagreement(measured: Mapping, reference: Mapping) -> tuple[float, str] | None:
    """``(median ratio, one-line description)`` when ``measured`` and ``reference`` (both ``{size:
    seconds}``) disagree beyond :data:`SECTION_TOLERANCE` on the sizes they share, else None.

    The median over the shared sizes is used so one noisy size does not condemn a table, and a
    table whose every entry ran under load (all ratios high) does not pass.
    """
    shared = sorted({float(k) for k in measured} & {float(k) for k in reference})
    if not shared:
        return None
    m = {float(k): float(v) for k, v in measured.items()}
    r = {float(k): float(v) for k, v in reference.items()}
    ratios = [m[k] / r[k] for k in shared if r[k] > 0]
    if not ratios:
        return None
    ratio = float(np.median(ratios))
    if abs(ratio - 1.0) <= SECTION_TOLERANCE:
        return None
    sizes = ", ".join(f"{k:g}: {m[k]:.3f} vs {r[k]:.3f} s" for k in shared)
    return ratio, f"median ratio {ratio:.2f} to the K table ({sizes})"
