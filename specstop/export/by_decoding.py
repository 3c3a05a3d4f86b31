"""Thresholds per decoding setting: one export, the policy tuned at each temperature / top-k / top-p.

A policy tuned on greedy data stops too late at T = 1 (the draft's tokens are accepted less often
there), and one tuned at T = 1 too early when greedy. ``specstop export --also-tuned T1.json`` carries,
beside the export's own policy (tuned on its dataset's setting), the same policy as ``specstop tune``
set it on data at other settings: same kind, and for a learned policy the same predictor (the
thresholds were tuned on its scores), so only the rule and its numbers change - threshold, SL_max, K. The
export's ``config.json`` lists them under ``by_decoding``::

    "by_decoding": [
        {"decoding": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "policy": {...}, "speedup": 1.81,
         "source": {"tuned": "runs/greedy/tuned.json", "dataset": "runs/greedy/data"}},
        {"decoding": {"temperature": 1.0, ...}, "policy": {...}, ...}
    ]

A decoder hands the runtime its request's setting (``StoppingPolicy.configure``: our decoders, HF's
``custom_generate`` hook, PEARL's workers), and :func:`pick` chooses the entry: greedy requests the
greedy entry; sampled requests the entry at the nearest temperature, then the one with the same top-k
and top-p. Dependency-light: the runtime's own imports (:mod:`specstop.policy`, :mod:`specstop.probs`).
"""

from __future__ import annotations

from typing import Any

from specstop.errors import UserError
from specstop.policy import PolicySpec
from specstop.probs import DecodingConfig

ENTRY_KEYS = frozenset({"decoding", "policy", "speedup", "source", "stats"})
DECODING_KEYS = frozenset({"temperature", "top_k", "top_p"})


def setting_of(decoding: Any, where: str = "") -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` of a DecodingConfig or a ``{temperature, top_k, top_p}`` mapping
    (missing or null values: greedy, no top-k, no top-p).

    Args:
        decoding: the setting.
        where: what holds it (``by_decoding[1].decoding``), named by an error.

    Raises:
        UserError: a value that is not a valid setting (:meth:`DecodingConfig.from_generation`: one rule for
            every reader), or ``decoding`` is neither a mapping nor a DecodingConfig.
    """
    d = decoding if isinstance(decoding, DecodingConfig) else DecodingConfig.from_generation(decoding, where)
    return d.temperature, d.top_k, d.top_p


def describe(decoding: Any) -> str:
    """``greedy`` or ``T=0.7, top-p 0.9`` (the cuts that apply)."""
    t, k, p = setting_of(decoding)
    if not t:
        return "greedy"
    return ", ".join([f"T={t:g}", *([f"top-k {k}"] if k else []), *([f"top-p {p:g}"] if p < 1.0 else [])])


def pick(entries: list[dict], decoding: Any) -> int:
    """Index of the entry whose setting serves ``decoding`` best: the same greedy-or-sampled mode first,
    then the nearest temperature, then the same top-k and top-p, then the lower temperature."""
    if not entries:
        raise ValueError("no entries to pick from")
    t, k, p = setting_of(decoding)

    def distance(i: int) -> tuple:
        et, ek, ep = setting_of(entries[i]["decoding"])
        return (bool(et) != bool(t), abs(et - t), ek != k, ep != p, et)

    return min(range(len(entries)), key=distance)


def check_entries(entries: Any, base: PolicySpec, where: str) -> list[tuple[dict, PolicySpec]]:
    """``[(entry, its PolicySpec)]`` of a config's ``by_decoding``, each checked: the known keys, a
    decoding setting, a policy of the base's kind (and family and inputs, for a learned one; the rule
    reading its scores may differ: tune picks per setting), and no setting twice.

    Raises:
        UserError: naming the entry and the fix (re-export).
    """
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: by_decoding must be a non-empty list of settings; re-export the policy")
    out, seen = [], {}
    for i, entry in enumerate(entries):
        at = f"{where}: by_decoding[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("decoding"), dict):
            raise UserError(f"{at} must be a mapping with a 'decoding' setting; re-export the policy")
        # A misspelt key would otherwise read as its default (greedy, no cut) and serve the wrong requests.
        odd = sorted(str(k) for k in entry["decoding"] if k not in DECODING_KEYS)
        if odd:
            raise UserError(f"{at}.decoding: unknown key {odd[0]!r} (valid: {', '.join(sorted(DECODING_KEYS))}); "
                            "re-export the policy")
        try:
            key = setting_of(entry["decoding"], f"{at}.decoding")
        except UserError as err:
            raise UserError(f"{err}; re-export the policy") from None
        unknown = sorted(str(k) for k in entry if k not in ENTRY_KEYS)
        if unknown:
            raise UserError(f"{at}: unknown key {unknown[0]!r} (valid: {', '.join(sorted(ENTRY_KEYS))}); re-export it")
        try:
            spec = PolicySpec.from_dict(entry.get("policy"))
        except UserError as err:
            raise UserError(f"{at}: policy: {err}") from None
        if (spec.kind, spec.family, spec.reads) != (base.kind, base.family, base.reads):
            raise UserError(f"{at}: a {spec.label} policy beside the export's {base.label}: every setting must be "
                            "the same kind of policy (the same predictor); re-export it")
        if key in seen:
            raise UserError(f"{at}: {describe(entry['decoding'])} is also by_decoding[{seen[key]}]; re-export it")
        seen[key] = i
        out.append((entry, spec))
    return out
