"""sha256 of a file, read in blocks so memory stays flat for multi-GB weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 8 << 20  # 8 MiB: large enough for fast hashing, small enough to keep memory flat


def sha256_file(path: str | Path, block: int = BLOCK) -> str:
    """The hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
