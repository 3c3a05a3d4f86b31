"""What makes an export folder a Hugging Face Hub repository: model_type, card metadata,
hub-id resolution and the ``custom_generate/`` entry point transformers loads.

Imports only the standard library and ``huggingface_hub`` (a transformers dependency), so the
runtime stays free of Lightning, datasets and transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specstop.errors import MissingInputError, UserError

#: ``config.json``'s ``model_type`` (the Hub and AutoConfig-style tools key on it).
MODEL_TYPE = "specstop_stopping_policy"
LIBRARY_NAME = "specstop"
CUSTOM_GENERATE_DIR = "custom_generate"
#: Files that make up an export (what a hub download fetches): its config, the predictor's weights, a
#: token tree's node head, the card and the ``custom_generate/`` entry point. (A test keeps the weight
#: names equal to :mod:`specstop.export.folder`'s.)
EXPORT_PATTERNS = ["config.json", "model.safetensors", "node_head.safetensors", "README.md", f"{CUSTOM_GENERATE_DIR}/*"]

_GENERATE_PY = '''"""transformers ``custom_generate`` entry point of a specstop stopping policy (written by specstop export).

    out = target.generate(**inputs, assistant_model=draft, custom_generate=REPO_OR_DIR,
                          trust_remote_code=True, max_new_tokens=128)

Runs transformers' assisted generation with the draft length of every round decided by the
stopping policy stored in this repository (config.json, model.safetensors): the predictor scores
each drafted token and drafting stops when the tuned rule says so. Decoding stays lossless.
Needs ``pip install specstop`` (the core install is enough). The policy is read from the folder or
repository ``custom_generate=`` named, wherever it was moved or pushed; ``stopping_policy=DIR_OR_REPO_ID``
picks another one.
"""


def generate(model, *args, stopping_policy=None, **kwargs):
    import specstop

    policy = stopping_policy or specstop.custom_generate_source()
    return specstop.generate_with_policy(model, *args, policy=policy, **kwargs)
'''

_REQUIREMENTS = "# specstop's core install provides the runtime this entry point calls\nspecstop\n"


def write_custom_generate(folder: str | Path) -> Path:
    """Write ``folder/custom_generate/generate.py`` (and its requirements.txt).

    The file names no path and no repository: :func:`custom_generate_source` finds the policy from
    the ``custom_generate=`` argument at call time, so a moved folder or a pushed repository works
    as written.

    Returns:
        The path of ``generate.py``.
    """
    cg = Path(folder) / CUSTOM_GENERATE_DIR
    cg.mkdir(parents=True, exist_ok=True)
    path = cg / "generate.py"
    path.write_text(_GENERATE_PY)
    (cg / "requirements.txt").write_text(_REQUIREMENTS)
    return path


def custom_generate_source() -> str:
    """The folder or hub id that the running ``generate(custom_generate=...)`` call named.

    transformers copies ``custom_generate/generate.py`` into its module cache before running it and
    does not pass ``custom_generate`` on, so the file cannot know where its policy lives. The value
    is still a local of the ``generate`` frame that loaded it, a few frames up: read it there.

    Raises:
        UserError: not called under ``generate(custom_generate=...)`` (pass ``stopping_policy=``).
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get("custom_generate") if frame.f_code.co_name == "generate" else None
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        frame = frame.f_back
    raise UserError(
        "no generate(custom_generate=...) call found to read the stopping policy's location from; "
        "pass stopping_policy=EXPORT_DIR_OR_REPO_ID"
    )


def is_local_name(name: str | None) -> bool:
    """True for a filesystem path (absolute, relative or existing), False for a ``owner/name`` hub id."""
    if not name:
        return True
    return os.path.isabs(name) or name.startswith((".", "~")) or Path(name).exists() or name.count("/") != 1


def names_hub_repo(text: str) -> bool:
    """True when a policy argument names a hub repository (``owner/name``, no ``:``, no such local path):
    policy specs (``confidence:0.4``, ``mcsd:4,2``) and paths never do."""
    return ":" not in str(text) and not is_local_name(str(text))


def card_metadata(config: dict) -> dict:
    """The YAML front matter of an export's README (Hub model-card metadata).

    ``base_model`` names the draft when it is a hub id (the predictor reads that draft's outputs).
    """
    from huggingface_hub import ModelCardData

    policy = config.get("policy") or {}
    pred = config.get("predictor") or {}
    pair = config.get("pair") or {}
    draft = (pair.get("draft") or {}).get("name_or_path")
    target = (pair.get("target") or {}).get("name_or_path")
    tags = ["specstop", "speculative-decoding", "stopping-policy", f"policy-{policy.get('kind', 'unknown')}"]
    if pred.get("family"):
        tags.append(pred["family"].replace("_", "-"))
    extra = {
        "model_type": MODEL_TYPE,
        "specstop": {
            "policy": {k: policy.get(k) for k in ("kind", "rule", "threshold", "sl_max", "family")},
            "draft": draft,
            "target": target,
            "tokenizer_hash": pair.get("tokenizer_hash"),
        },
    }
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        tags=tags,
        base_model=draft if draft and not is_local_name(draft) else None,
        **extra,
    )
    return data.to_dict()


def front_matter(config: dict) -> str:
    """``---\\n<yaml>\\n---\\n`` for the README."""
    import yaml

    return "---\n" + yaml.safe_dump(card_metadata(config), sort_keys=False).strip() + "\n---\n\n"


def resolve_folder(
    path_or_repo_id: str | Path,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
) -> Path:
    """A local export folder as is, or a hub repository downloaded into the HF cache.

    Raises:
        MissingInputError: neither a folder nor a reachable hub repository (the message says which).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo_id)
    if is_local_name(name):
        raise MissingInputError(f"{name} is not a folder (and not an owner/name hub id); give an export folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                name, revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                force_download=force_download, allow_patterns=EXPORT_PATTERNS,
            )
        )
    except Exception as err:  # huggingface_hub raises several types for offline / missing repos
        raise MissingInputError(
            f"{name!r} is not a local folder, and fetching it as a hub id failed ({type(err).__name__}: {err}); "
            "give an export folder that exists, or a hub id with network (download it once to use it offline)"
        ) from err


def cache_blobs_folder(folder: str | Path) -> Path | None:
    """The ``blobs/`` folder of the Hugging Face cache repository whose snapshot ``folder`` is, else None.

    ``snapshot_download`` returns ``<cache>/models--owner--name/snapshots/<commit>``, whose files are
    symlinks to ``../../blobs/<etag>``: the repository's own content, stored once in the cache. A
    reader confined to the snapshot folder accepts links into that folder, and only that one.
    """
    snapshot = Path(folder).resolve()
    repo = snapshot.parent.parent
    if snapshot.parent.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    blobs = repo / "blobs"
    return blobs if blobs.is_dir() else None


def read_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
