"""Which model pair made a piece of data, and refusing to mix pairs.

A pair's identity is what :meth:`ModelPair.to_dict` records in shards, manifests, checkpoints and
exports: the pair name, both models' architecture, sizes, dtype and weights fingerprint, and the
tokenizer hash. :func:`pair_difference` names the first field two records disagree on; fields
missing on either side (records written before the field existed, synthetic datasets) are not
compared, and a weights fingerprint is only compared with one of its own kind (file-based vs
in-memory). A draft quantized by ``--draft-quant`` has the float draft's identity plus ``quant``:
data, checkpoints and exports of one are refused for the other.

``generate`` resumes only with the same pair *and dtype* (labels depend on both); later stages
(train, tune, eval, export) compare the models and the tokenizer but not the dtype or the pair's
name (a predictor may be evaluated on bfloat16 data of the same models, or on the pair loaded
under another name).
"""

from __future__ import annotations

from specstop.errors import UserError

MODEL_KEYS = ("architecture", "num_parameters", "hidden_size", "num_hidden_layers", "logits_size",
              "weights_sha256", "source_sha256")


def _kind(fp: str) -> str:
    return fp.split(":", 1)[0] if ":" in fp else ""


def _short(v) -> str:
    text = str(v)
    return repr(text[:26] + "..." if len(text) > 29 else text)


def pair_difference(expected: dict | None, actual: dict | None, *, dtype: bool = False, name: bool = False) -> str | None:
    """The first difference between two pair records, or None when they may be the same pair.

    Args:
        expected, actual: ``ModelPair.to_dict()``-style dicts (``name``, ``draft``, ``target``,
            ``tokenizer_hash``); None compares as unknown.
        dtype: also compare the models' dtypes.
        name: also compare the pair names.

    Returns:
        A phrase like ``draft weights_sha256 'files-v1:ab..' vs 'files-v1:cd..'``, or None.
    """
    if not isinstance(expected, dict) or not isinstance(actual, dict):
        return None
    if name and expected.get("name") and actual.get("name") and expected["name"] != actual["name"]:
        return f"pair name {expected['name']!r} vs {actual['name']!r}"
    a, b = expected.get("tokenizer_hash"), actual.get("tokenizer_hash")
    if a and b and a != b:
        return f"tokenizer hash {a!r} vs {b!r}"
    keys = (("dtype",) if dtype else ()) + MODEL_KEYS  # dtype first: it also changes in-memory fingerprints
    for role in ("draft", "target"):
        x, y = expected.get(role), actual.get(role)
        if not isinstance(x, dict) or not isinstance(y, dict):
            continue
        for key in keys:
            u, v = x.get(key), y.get(key)
            if u is None or v is None or u == v:
                continue
            if key == "weights_sha256" and _kind(str(u)) != _kind(str(v)):
                continue  # a file fingerprint and an in-memory one cannot be compared
            label = "weights (fingerprint)" if key == "weights_sha256" else key
            return f"{role} {label} {_short(u)} vs {_short(v)}"
        if quant_differs(x, y):
            return f"{role} quantization {quant_label(x)} vs {quant_label(y)}"
    return None


def quant_differs(a: dict, b: dict) -> bool:
    """Do two model records run different weight-only schemes? Only records that both say (``quant``,
    None meaning the float model) are compared; older records without the field are not."""
    return "quant" in a and "quant" in b and (a["quant"] or None) != (b["quant"] or None)


def quant_label(record: dict) -> str:
    return repr(record.get("quant") or "none (as loaded)")


def check_same_pair(
    expected: dict | None, actual: dict | None, *, what: str, fix: str, dtype: bool = False, name: bool = False
) -> None:
    """Raise a :class:`UserError` when :func:`pair_difference` finds one.

    Args:
        what: describes the two sides, e.g. ``"checkpoint X was trained on another pair than DATA"``.
        fix: what the user should do.
    """
    diff = pair_difference(expected, actual, dtype=dtype, name=name)
    if diff is not None:
        raise UserError(f"{what} ({diff}); {fix}")
