"""Small bridges over differences between transformers 5.x releases.

The KV cache keyword of a model's ``forward`` was renamed from ``past_key_values`` to ``cache``
within transformers 5 (5.24 accepts both but warns on every call site with a FutureWarning that
says the old name goes in 5.40). specstop supports ``transformers>=5.16,<6``, so it asks each
model's ``forward`` which name it takes instead of pinning one.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

__all__ = ["cache_kwarg", "output_cache"]


@lru_cache(maxsize=64)
def _cache_name(forward_cls: type) -> str:
    try:
        params = inspect.signature(forward_cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins / compiled wrappers
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model, cache) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever ``model.forward`` takes."""
    return {_cache_name(type(model)): cache}


def output_cache(out):
    """The KV cache a forward returned (``out.cache`` on newer releases, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


#: The releases specstop runs with: pyproject.toml declares the same ranges (a test keeps them equal).
#: torch's bound is the oldest release anything was tested on (2.11, the GPU check; every CPU test runs on
#: 2.13): older ones lack ops specstop calls (the int4 draft's ``_weight_int4pack_mm_for_cpu``).
SUPPORTED = {"torch": ("2.11", None), "transformers": ("5.16", "6")}


def _release(text: str) -> tuple[int, ...]:
    """``"5.17.0.dev0"`` -> ``(5, 17, 0)``; local tags (``+cu130``) and pre-release suffixes ignored."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def supported_range(package: str) -> str:
    low, high = SUPPORTED[package]
    return f"{package}>={low}" + (f",<{high}" if high else "")


def check_supported_versions(found: dict[str, str | None] | None = None) -> None:
    """Refuse, in one line naming the versions needed, a torch or transformers outside :data:`SUPPORTED`.

    Args:
        found: ``{package: version}`` to check (default: the installed ones, read from package
            metadata, so neither is imported).
    """
    from importlib.metadata import PackageNotFoundError, version

    from specstop.errors import UserError

    for package, (low, high) in SUPPORTED.items():
        if found is not None:
            have = found.get(package)
        else:
            try:
                have = version(package)
            except PackageNotFoundError:
                have = None
        if have is None:
            raise UserError(f"specstop needs {supported_range(package)}, and {package} is not installed; "
                            f"pip install '{supported_range(package)}'")
        rel = _release(have)
        if rel < _release(low) or (high and rel >= _release(high)):
            raise UserError(f"specstop needs {supported_range(package)}, found {package} {have}; "
                            f"pip install '{supported_range(package)}'")
