"""Reading an export folder (or hub repo): its config.json, the draft it was made for, its weights.

Every check refuses with one line naming the file and the fix: an unknown format or schema version,
an unknown key (an edited file or a newer writer), weights outside the folder or not matching the
recorded predictor, and an export made for another draft or tokenizer (:class:`DraftMismatchError`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specstop.errors import MissingInputError, UserError
from specstop.export.by_decoding import check_entries
from specstop.export.folder import CONFIG_NAME, EXPORT_FORMAT, SCHEMA_VERSION, WEIGHTS_NAME
from specstop.export.hub import cache_blobs_folder, resolve_folder
from specstop.models import FeatureSpec, StoppingPredictor, build_predictor
from specstop.names import confined_file
from specstop.policy import PolicySpec

__all__ = ["DraftMismatchError", "identity_matches", "load_predictor_weights", "read_export", "read_export_config"]


class DraftMismatchError(UserError):
    """The export was made for another draft model or tokenizer."""


def identity_matches(expected: Any, exported: dict) -> tuple[bool, str]:
    """Compare a caller's draft identity with the one recorded in an export.

    Args:
        expected: a draft name/path (str), a ``ModelIdentity``-like object or dict (compared on
            ``weights_sha256`` - which, when both sides have one of the same kind, replaces the name
            check - and ``name_or_path``, ``architecture``, ``hidden_size``, ``num_hidden_layers``,
            ``num_parameters`` when both sides have them), or a dict ``{"draft": ..., "tokenizer_hash": ...}``.
        exported: the export's ``pair`` section.

    Returns:
        ``(ok, reason)``; ``reason`` names both sides when they differ.
    """
    exp_draft = exported.get("draft") or {}
    exp_hash = exported.get("tokenizer_hash")
    if isinstance(expected, dict) and ("draft" in expected or "tokenizer_hash" in expected):
        want_draft, want_hash = expected.get("draft"), expected.get("tokenizer_hash")
    else:
        want_draft, want_hash = expected, None
    if want_hash is not None and exp_hash is not None and want_hash != exp_hash:
        return False, f"tokenizer hash {want_hash!r} (yours) vs {exp_hash!r} (export)"
    if want_draft is None:
        return True, ""
    if hasattr(want_draft, "to_dict"):
        want_draft = want_draft.to_dict()
    if isinstance(want_draft, str):
        name = exp_draft.get("name_or_path")
        if name is not None and not _same_name(want_draft, name):
            return False, f"draft {want_draft!r} (yours) vs {name!r} (export)"
        return True, ""
    from specstop.pair.identity import quant_differs, quant_label

    if quant_differs(want_draft, exp_draft):
        return False, (f"draft quantization {quant_label(want_draft)} (yours) vs {quant_label(exp_draft)} (export): "
                       "the predictor learned the features and acceptance of the draft it was trained with")
    # The weights fingerprint decides when both sides have one of the same kind (file-based or
    # in-memory): a draft with the same name and size but other weights is another model, and the
    # same weights under another folder name are the same model.
    wa, wb = want_draft.get("weights_sha256"), exp_draft.get("weights_sha256")
    comparable = isinstance(wa, str) and isinstance(wb, str) and wa.split(":", 1)[0] == wb.split(":", 1)[0]
    if comparable and wa != wb:
        # Another shape is the plainer (and truer) reason: say it rather than "same size".
        for key in ("architecture", "hidden_size", "num_hidden_layers", "num_parameters"):
            a, b = want_draft.get(key), exp_draft.get(key)
            if a is not None and b is not None and a != b:
                return False, f"draft {key} {a!r} (yours) vs {b!r} (export)"
        na, nb = want_draft.get("name_or_path"), exp_draft.get("name_or_path")
        same_name = na is not None and nb is not None and _same_name(str(na), str(nb))
        return False, (
            f"draft weights fingerprint {wa[:24]}... (yours) vs {wb[:24]}... (export): "
            f"{'same name and size' if same_name else 'same size'}, other weights"
        )
    for key in ("name_or_path", "architecture", "hidden_size", "num_hidden_layers", "num_parameters"):
        a, b = want_draft.get(key), exp_draft.get(key)
        if a is None or b is None:
            continue
        if key == "name_or_path" and (comparable or _same_name(str(a), str(b))):
            continue
        if a != b:
            return False, f"draft {key} {a!r} (yours) vs {b!r} (export)"
    return True, ""


def read_export_config(cfg_path: Path) -> dict:
    """An export's config.json as a mapping (one-line errors for anything else)."""
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{cfg_path}:{err.lineno}: not valid JSON ({err.msg}); re-export the policy") from None
    except UnicodeDecodeError:
        raise UserError(f"{cfg_path}: not a UTF-8 JSON file; re-export the policy") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}; re-export the policy")
    return config


def export_draft_quant(folder: str | Path) -> str | None:
    """The weight-only scheme of the draft a learned export was trained with (its ``pair.draft.quant``;
    None: the float draft, or an export from before the field)."""
    config = read_export_config(Path(folder) / "config.json")
    return ((config.get("pair") or {}).get("draft") or {}).get("quant") or None


# Every key an export's config.json may hold (export.py's schema); anything else is an edit or a
# newer writer, and a reader that ignored it could run with settings the file does not mean.
CONFIG_KEYS = frozenset({
    "format", "model_type", "schema_version", "specstop_version", "created", "name", "policy", "predictor",
    "features", "decoding", "cost_model", "validation", "pair", "source", "export_check", "tree", "by_decoding", "stats",
    "levels",
})
PREDICTOR_KEYS = frozenset({"family", "config", "label", "num_parameters", "weights", "dtype"})


def check_config_keys(cfg_path: Path, config: dict) -> None:
    """Refuse unknown keys at the top level and in ``predictor`` (docs/errors.md)."""
    for section, keys, allowed in (("", config, CONFIG_KEYS), ("predictor.", config.get("predictor"), PREDICTOR_KEYS)):
        if not isinstance(keys, dict):
            continue
        unknown = sorted(str(k) for k in keys if k not in allowed)
        if unknown:
            raise UserError(
                f"{cfg_path}: unknown config key {section + unknown[0]!r}; valid keys"
                f"{' in predictor' if section else ''}: {', '.join(sorted(allowed))} (the export was edited or "
                "written by a newer specstop: re-export it)"
            )


def _feature_spec_or_none(d: dict) -> FeatureSpec | None:
    try:
        return FeatureSpec(**d)
    except (TypeError, UserError):
        return None


def load_predictor_weights(path: Path, cfg_path: Path, pred_cfg: Any) -> StoppingPredictor:
    """Build the predictor named by ``config.json`` and load its weights, refusing anything inconsistent."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(pred_cfg, dict) or not isinstance(pred_cfg.get("family"), str) or not isinstance(
        pred_cfg.get("config"), dict
    ):
        raise UserError(f"{cfg_path}: 'predictor' must hold a family name and a config mapping; re-export the policy")
    # The weights file is named by an editable file: it must stay inside the export folder (for a
    # hub download, a link into that repository's blobs in the Hugging Face cache).
    weights = confined_file(path, pred_cfg.get("weights", WEIGHTS_NAME), f"{cfg_path.name} predictor.weights",
                            links_into=cache_blobs_folder(path))
    if not weights.is_file():
        raise MissingInputError(f"{path}: config.json names weights {weights.name} but the file is missing")
    try:
        predictor = build_predictor(pred_cfg["family"], **pred_cfg["config"])
    except (TypeError, UserError) as err:  # UserError: a key or value type the family's config refuses
        raise UserError(f"{cfg_path}: predictor.config does not fit family {pred_cfg['family']!r}: {err}") from None
    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError) as err:
        raise UserError(
            f"{weights}: not a readable safetensors file ({err}); it is truncated or corrupt - re-export the policy"
        ) from None
    try:
        predictor.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise UserError(
            f"{weights} does not match the predictor that {cfg_path.name} describes ({first}); the export was "
            "edited or mixed with another one - re-export it with `specstop export`"
        ) from None
    return predictor


def _same_name(a: str, b: str) -> bool:
    # A converted local folder and its hub id name the same model: compare the last path part too.
    return a == b or Path(a).name == Path(b).name




def read_export(
    path: str | Path,
    *,
    draft_identity: Any = None,
    tokenizer_hash: str | None = None,
    allow_draft_mismatch: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
) -> tuple[PolicySpec, StoppingPredictor | None, dict]:
    """``(policy spec, predictor or None, config.json)`` of an export folder or hub id, every part
    checked (see :meth:`specstop.export.runtime.StoppingPolicy.from_pretrained` for the arguments).
    """
    path = resolve_folder(
        path, revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
        force_download=force_download,
    )
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise MissingInputError(f"{path} has no {CONFIG_NAME}: not a specstop export (create one with `specstop export`)")
    config = read_export_config(cfg_path)
    version = config.get("schema_version")
    if config.get("format") != EXPORT_FORMAT or version != SCHEMA_VERSION:
        raise UserError(
            f"{cfg_path}: export format {config.get('format')!r} schema version {version!r} is not supported "
            f"by this runtime (it reads {EXPORT_FORMAT!r} version {SCHEMA_VERSION}); upgrade specstop "
            "or re-export the checkpoint with this version"
        )
    check_config_keys(cfg_path, config)
    pair = config.get("pair") or {}
    expected = {"draft": draft_identity, "tokenizer_hash": tokenizer_hash}
    ok, why = identity_matches(expected, pair)
    if not ok and not allow_draft_mismatch:
        raise DraftMismatchError(
            f"export {path} was made for another draft model or tokenizer: {why}. Its predictor reads that "
            "draft's features, so its stopping decisions would be meaningless. Export a predictor trained "
            "on your pair, or pass allow_draft_mismatch=True (CLI: --allow-draft-mismatch) to override."
        )
    try:
        spec = PolicySpec.from_dict(config.get("policy"))
    except UserError as err:
        raise UserError(f"{cfg_path}: policy: {err}") from None
    if config.get("by_decoding") is not None:
        check_entries(config["by_decoding"], spec, str(cfg_path))
    predictor = None
    pred_cfg = config.get("predictor")
    if pred_cfg is not None:
        predictor = load_predictor_weights(path, cfg_path, pred_cfg)
        expected_fs = config.get("features")
        if expected_fs is not None and (
            not isinstance(expected_fs, dict) or _feature_spec_or_none(expected_fs) != predictor.feature_spec
        ):
            raise UserError(
                f"{cfg_path}: the recorded feature spec {expected_fs} differs from the one family "
                f"{pred_cfg['family']!r} builds ({predictor.feature_spec.to_dict()}); the export is inconsistent"
            )
    return spec, predictor, config
