"""Fault injection, datasets: kill points, byte flips, concurrent writers and mixed pairs.

Nothing finished is lost (a rerun resumes to exactly the uninterrupted dataset), nothing is
silently mixed (another pair or dtype is refused), damage is detected (sha256 on read, always
before training, and by ``generate --verify``), and two writers never share a folder.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _data_gen_helpers import make_render, records

from specstop.cli import main
from specstop.data_gen import runner as runner_mod
from specstop.data_gen import storage
from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.runner import generate_dataset
from specstop.data_gen.schema import TABLES
from specstop.errors import UserError
from specstop.outputs import LOCK_DIR, FolderBusyError, FolderLock
from specstop.testing import tiny_pair

REPO = Path(__file__).resolve().parents[1]


def _cfg() -> DataGenConfig:
    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 8
    cfg.generation.batch_size = 2
    cfg.labels.rollouts.length = 3
    return cfg


def _gen(pair, out, n: int = 7, cfg: DataGenConfig | None = None, **kw):
    return generate_dataset(pair, records(n), cfg or _cfg(), out, render=make_render(pair.tokenizer), progress=False, **kw)


def _dump(out) -> dict:
    return {t: storage.load_table(out, t).to_list() for t in TABLES}


@pytest.fixture(scope="module")
def reference(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ds"
    _gen(pair, out)
    return out


def _flip(path: Path, n: int = 4) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(n):
        raw[len(raw) // 2 + i] ^= 0xFF
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------ kill points
KILL_POINTS = ["before_first_table", "between_tables", "before_marker", "before_rename", "before_manifest"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_points_resume_to_the_same_dataset(reference, pair, tmp_path, monkeypatch, point):
    """A crash at each point of the second shard's write loses nothing and duplicates nothing."""
    import datasets

    out = tmp_path / "ds"
    calls = {"shards": 0, "tables": 0}
    real_save, real_json, real_replace = datasets.Dataset.save_to_disk, storage.atomic_write_json, os.replace

    def killed():
        raise KeyboardInterrupt("kill point")  # like SIGKILL: nothing after this line runs

    def save(self, path, *a, **kw):
        if calls["shards"] == 1:
            calls["tables"] += 1
            if point == "before_first_table" or (point == "between_tables" and calls["tables"] == 3):
                killed()
        return real_save(self, path, *a, **kw)

    def write_json(path, obj):
        if Path(path).name == storage.COMPLETE_MARKER:
            if calls["shards"] == 1 and point == "before_marker":
                killed()
        elif Path(path).name == storage.MANIFEST and point == "before_manifest":
            killed()
        return real_json(path, obj)

    def replace(src, dst):
        if Path(str(src)).name.startswith(".tmp-"):
            if calls["shards"] == 1 and point == "before_rename":
                killed()
            calls["shards"] += 1
        return real_replace(src, dst)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    monkeypatch.setattr(storage, "atomic_write_json", write_json)
    monkeypatch.setattr(runner_mod, "atomic_write_json", write_json)
    monkeypatch.setattr(storage.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _gen(pair, out)
    monkeypatch.undo()
    assert not (out / LOCK_DIR).exists()  # the lock went with the process
    res = _gen(pair, out)
    assert "train-00000" in res["skipped"]
    assert _dump(out) == _dump(reference)
    assert storage.read_manifest(out)["splits"] == storage.read_manifest(reference)["splits"]


def test_sigkill_of_a_real_run_resumes(tiny_pair_dir, tmp_path):
    """kill -9 of `specstop generate` while it writes; the rerun completes the same dataset."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}, please answer"}) + "\n" for i in range(8)))
    out = tmp_path / "ds"
    argv = [sys.executable, "-m", "specstop.cli", "generate", "--pair", str(tiny_pair_dir), "--prompts", str(prompts),
            "--split-scheme", "all:train", "--max-new-tokens", "6", "--prompts-per-shard", "1", "--batch-size", "1",
            "--out", str(out), "--device", "cpu", "--dtype", "float32", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(storage.complete_shards(out, strict=False)) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / storage.MANIFEST).exists()
    lock = out / LOCK_DIR / "all.lock"
    assert lock.is_file()  # left behind by the killed run: stale, detected by pid
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stale lock" in done.stderr
    seqs = storage.load_table(out, "sequences")
    assert sorted(seqs["prompt_id"]) == [f"q{i}" for i in range(8)]  # none lost, none duplicated
    assert not lock.exists()


# ------------------------------------------------------------------------------ byte flips
def test_byte_flip_is_detected_everywhere_and_repaired_by_rerun(reference, pair, tmp_path, capsys):
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    arrow = next((out / "shards" / "train-00001" / "tokens").glob("*.arrow"))
    _flip(arrow)
    with pytest.raises(UserError, match=r"shard train-00001: file tokens/.* does not match its recorded sha256"):
        storage.load_table(out, "tokens", "train")  # read side: never silently skipped
    rc = main(["generate", "--verify", "--out", str(out)])
    assert rc == 2
    captured = capsys.readouterr()
    assert "train-00001: file tokens/" in captured.out and "1 problem(s) in 4 shard(s)" in captured.err
    res = _gen(pair, out)  # the same command regenerates only the damaged shard
    assert res["done"] == ["train-00001"]
    assert _dump(out) == _dump(reference)
    assert main(["generate", "--verify", "--out", str(out)]) == 0
    assert "4 shard(s) intact" in capsys.readouterr().out


def test_shard_without_a_table_fails_verification(reference, tmp_path):
    """The shard a concurrent deleter used to produce (no `sequences` table) no longer verifies."""
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    shard = out / "shards" / "test-00000"
    rec = json.loads((shard / storage.COMPLETE_MARKER).read_text())
    rec.pop("tables")
    rec["files"] = {k: v for k, v in rec["files"].items() if not k.startswith("sequences/")}
    (shard / storage.COMPLETE_MARKER).write_text(json.dumps(rec))
    shutil.rmtree(shard / "sequences")
    assert storage.shard_problem(shard) == "table 'sequences' is missing from its completion record"
    with pytest.raises(UserError, match="test-00000: table 'sequences' is missing"):
        storage.load_table(out, "tokens")


def test_write_refuses_when_its_temporary_folder_is_deleted(pair, tmp_path, monkeypatch):
    import datasets

    real_save = datasets.Dataset.save_to_disk

    def save(self, path, *a, **kw):
        if Path(path).name == "tokens":  # a second writer deletes our live .tmp folder's first table
            shutil.rmtree(Path(path).parent / "sequences")
        return real_save(self, path, *a, **kw)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    with pytest.raises(RuntimeError, match="vanished"):
        _gen(pair, tmp_path / "ds", n=2)
    assert not list((tmp_path / "ds" / "shards").glob("train-*"))


# ------------------------------------------------------------------------------ concurrent writers
@pytest.fixture
def live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _fake_lock(folder: Path, role: str, pid: int, process_start: float | None = None) -> Path:
    import socket

    import psutil

    (folder / LOCK_DIR).mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_DIR / f"{role}.lock"
    start = psutil.Process(pid).create_time() if process_start is None and psutil.pid_exists(pid) else process_start
    path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "process_start": start,
                                "created": time.time(), "command": "specstop generate --out X", "role": role}))
    return path


def test_second_writer_is_refused_and_touches_nothing(pair, tmp_path, live_process, capsys):
    out = tmp_path / "ds"
    tmp_shard = out / "shards" / ".tmp-train-00000-abcdef12"
    tmp_shard.mkdir(parents=True)  # the first run's live temporary shard
    _fake_lock(out, "all", live_process.pid)
    with pytest.raises(FolderBusyError, match=rf"being written by another run: `specstop generate --out X` \(pid {live_process.pid}"):
        _gen(pair, out)
    assert tmp_shard.is_dir()  # not deleted from under the first run
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    rc = main(["generate", "--pair", "unused", "--prompts", str(prompts), "--split-scheme", "all:train", "--out", str(out)])
    assert rc == 2 and f"pid {live_process.pid}" in capsys.readouterr().err


def test_workers_share_a_folder_but_not_with_a_whole_run(pair, tmp_path, live_process):
    out = tmp_path / "ds"
    _fake_lock(out, "worker-0-of-2", live_process.pid)
    _gen(pair, out, num_shards=2, shard_index=1)  # another worker of the same job: fine
    with pytest.raises(FolderBusyError):
        _gen(pair, out)  # a single-process run would write worker 0's shards too
    with pytest.raises(FolderBusyError):
        _gen(pair, out, num_shards=3, shard_index=1)  # another job layout


def test_stale_locks_are_taken_over(pair, tmp_path, live_process):
    out = tmp_path / "ds"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _fake_lock(out, "all", int(dead.stdout))  # that process has exited
    _gen(pair, out, n=2)
    _fake_lock(out, "all", live_process.pid, process_start=1.0)  # a live pid, but started after the lock: reused
    _gen(pair, out, n=2)
    assert not (out / LOCK_DIR).exists()


def test_lock_is_reentrant_within_one_process(tmp_path):
    with FolderLock(tmp_path, "all") as outer:
        with FolderLock(tmp_path, "all"):
            pass
        assert outer.path.is_file()  # the inner claim did not release the outer one
    assert not outer.path.exists()


# ------------------------------------------------------------------------------ mixed pairs
def test_resume_with_another_pair_or_dtype_is_refused(pair, tmp_path, monkeypatch):
    import torch

    from specstop.pair.loader import pair_from_models

    out = tmp_path / "ds"
    real_write = runner_mod.write_shard
    calls = {"n": 0}

    def crash_after_two(*a, **kw):
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        calls["n"] += 1
        return real_write(*a, **kw)

    monkeypatch.setattr(runner_mod, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        _gen(pair, out)
    monkeypatch.undo()
    other = tiny_pair(seed=5)  # same names, sizes and tokenizer; other weights
    other.name = pair.name
    with pytest.raises(UserError, match=r"another model pair or dtype.*draft weights \(fingerprint\)"):
        _gen(other, out)
    bf16 = pair_from_models(copy.deepcopy(pair.draft).to(torch.bfloat16), copy.deepcopy(pair.target).to(torch.bfloat16),
                            pair.tokenizer, draft_name="tiny-draft", target_name="tiny-target", name="tiny")
    with pytest.raises(UserError, match=r"another model pair or dtype.*draft dtype 'float32' vs 'bfloat16'"):
        _gen(bf16, out)
    assert len(storage.complete_shards(out, strict=False)) == 2  # nothing mixed in, nothing lost
    _gen(pair, out)
    assert storage.read_manifest(out)["shards"]


def test_merge_refuses_workers_that_loaded_another_pair(pair, tmp_path):
    from specstop.data_gen.runner import plan_shards, write_manifest

    out = tmp_path / "ds"
    _gen(pair, out, num_shards=2, shard_index=0)
    other = tiny_pair(seed=5)
    other.name = pair.name
    with pytest.raises(UserError, match="cannot write the manifest: shard .* another model pair"):
        _gen(other, out, num_shards=2, shard_index=1)  # the last worker merges: refused
    with pytest.raises(UserError, match="cannot write the manifest: shard .* another model pair"):
        write_manifest(out, _cfg(), plan_shards(records(7), 2))  # and so is an explicit --merge
    assert not (out / storage.MANIFEST).exists()


def test_verify_finds_a_shard_of_another_pair(reference, pair, tmp_path):
    from specstop.data_gen.verify import dataset_problems

    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    man = json.loads((out / storage.MANIFEST).read_text())
    man["pair"]["draft"]["weights_sha256"] = man["pair"]["draft"]["weights_sha256"][:-4] + "0000"
    (out / storage.MANIFEST).write_text(json.dumps(man))
    problems, n = dataset_problems(out)
    assert n == 4 and len(problems) == 4 and "another pair or dtype" in problems[0]


# ------------------------------------------------------------------------------ swapped / re-typed shards
@pytest.fixture(scope="module")
def tuned_synthetic(tmp_path_factory):
    """A finished synthetic dataset (two shards per split, each recorded in the manifest with its
    digest, as `specstop generate` records them) and a tuned file made on it."""
    from specstop.testing import write_synthetic_dataset

    root = tmp_path_factory.mktemp("digests")
    data = write_synthetic_dataset(root / "data", {"validation": 4, "test": 4}, 24, shards_per_split=2,
                                   with_rollouts=True)
    man = json.loads((data / storage.MANIFEST).read_text())
    man["shards"] = sorted(p.name for p in storage.shards_root(data).iterdir())
    man["shard_digests"] = {n: storage.shard_digest(storage.read_shard_record(storage.shards_root(data) / n))
                            for n in man["shards"]}
    (data / storage.MANIFEST).write_text(json.dumps(man))
    tuned = root / "tuned.json"
    assert main(["tune", "--data", str(data), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8",
                 "--out", str(tuned)]) == 0
    return data, tuned


def _swap(a: Path, b: Path) -> None:
    a.rename(a.with_name("swap"))
    b.rename(a)
    a.with_name("swap").rename(b)


def _retype(shard: Path, table: str = "tokens", column: str = "entropy") -> None:
    """Rewrite one table with another column type and a completion record that matches the new files
    (what a script re-saving the shard with `datasets` would leave): every file checks out on its own."""
    from datasets import Value, load_from_disk

    from specstop.digest import sha256_file

    retyped = load_from_disk(str(shard / table)).cast_column(column, Value("float64"))
    retyped.save_to_disk(str(shard.parent / ".retyped"))
    del retyped
    shutil.rmtree(shard / table)
    (shard.parent / ".retyped").rename(shard / table)
    rec = storage.read_shard_record(shard)
    rec["files"] = {str(p.relative_to(shard)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                    for p in sorted(shard.rglob("*")) if p.is_file() and p.name != storage.COMPLETE_MARKER}
    (shard / storage.COMPLETE_MARKER).write_text(json.dumps(rec))


@pytest.mark.parametrize("damage", ["swapped", "retyped", "retyped-without-digests"])
def test_tune_and_eval_refuse_a_swapped_or_retyped_shard(tuned_synthetic, tmp_path, capsys, damage):
    from test_faults_inputs import one_line_error

    data, tuned = tuned_synthetic
    out = tmp_path / "data"
    shutil.copytree(data, out)
    shards = storage.shards_root(out)
    if damage == "swapped":  # a validation shard and a test shard trade places: each is intact on its own
        _swap(shards / "validation-00001", shards / "test-00000")
        bad = {"tune": "validation-00001", "eval": "test-00000"}
    else:
        _retype(shards / "validation-00000")
        _retype(shards / "test-00001")
        bad = {"tune": "validation-00000", "eval": "test-00001"}
        if damage == "retyped-without-digests":  # a manifest written before shard digests existed
            man = json.loads((out / storage.MANIFEST).read_text())
            del man["shard_digests"]
            (out / storage.MANIFEST).write_text(json.dumps(man))
    tuned_here = tmp_path / "tuned.json"
    tuned_here.write_text(tuned.read_text().replace(str(data), str(out)))
    capsys.readouterr()
    for command, args in (
        ("tune", ["--data", str(out), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8",
                  "--out", str(tmp_path / "t2.json")]),
        ("eval", ["--data", str(out), "--tuned", str(tuned_here), "--out", str(tmp_path / "report")]),
    ):
        line = one_line_error(capsys, main([command, *args]), f"dataset {out} is damaged", f"shard {bad[command]}",
                              "specstop generate --verify --data")
        # Intact on its own, a rerun of generate would keep it: the line says to remove it first.
        assert f"delete (or move away) {shards / bad[command]} and rerun the `specstop generate` command" in line
    assert not (tmp_path / "t2.json").exists() and not (tmp_path / "report" / "report.md").exists()
    assert main(["generate", "--verify", "--data", str(out)]) == 2  # and --verify lists both
    listed = capsys.readouterr().out
    assert all(f"shard {name}: " in listed for name in bad.values()) and "delete that shard folder first" in listed


def _retype_arrow_file(shard: Path, table: str = "tokens", column: str = "entropy") -> None:
    """Rewrite one table's Arrow file with another column type under its old ``dataset_info.json``,
    then forge the completion record to match: every file checks out on its own."""
    import pyarrow as pa

    from specstop.digest import sha256_file

    state = json.loads((shard / table / "state.json").read_text())
    arrow = shard / table / state["_data_files"][0]["filename"]
    tbl = pa.ipc.open_stream(arrow.read_bytes()).read_all()
    i = tbl.schema.get_field_index(column)
    tbl = tbl.set_column(i, pa.field(column, pa.float64()), tbl.column(i).cast(pa.float64()))
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, tbl.schema) as writer:
        writer.write_table(tbl)
    rec = storage.read_shard_record(shard)
    rec["files"] = {str(p.relative_to(shard)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                    for p in sorted(shard.rglob("*")) if p.is_file() and p.name != storage.COMPLETE_MARKER}
    (shard / storage.COMPLETE_MARKER).write_text(json.dumps(rec))


def test_verify_refuses_what_the_readers_refuse(tuned_synthetic, tmp_path, capsys):
    """An Arrow file re-typed under its old dataset_info.json, with the shard's sha256 record and
    the manifest's digest both forged to match, fails `generate --verify` as it fails `tune`."""
    from test_faults_inputs import one_line_error

    data, _ = tuned_synthetic
    out = tmp_path / "data"
    shutil.copytree(data, out)
    shard = storage.shards_root(out) / "validation-00000"
    _retype_arrow_file(shard)
    man = json.loads((out / storage.MANIFEST).read_text())
    man["shard_digests"]["validation-00000"] = storage.shard_digest(storage.read_shard_record(shard))
    (out / storage.MANIFEST).write_text(json.dumps(man))
    capsys.readouterr()
    assert main(["generate", "--verify", "--data", str(out)]) == 2
    listed = capsys.readouterr().out
    assert "shard validation-00000: table 'tokens' column 'entropy' is float64" in listed
    one_line_error(capsys, main(["tune", "--data", str(out), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8",
                                 "--out", str(tmp_path / "t.json")]),
                   f"dataset {out} is damaged", "shard validation-00000", "column 'entropy' is float64")
    assert not (tmp_path / "t.json").exists()
