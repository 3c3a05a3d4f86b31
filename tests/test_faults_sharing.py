"""Fault injection, outputs others share: files and folders someone else touches while specstop runs.

* An export never deletes a file it did not write, even one dropped into ``--out`` while it runs;
  a second writer into the same folder is refused in one line (the folder lock holds).
* Files specstop writes get the mode a plain ``open()`` gives under the umask (``0666 & ~umask``),
  not the private mode of a temporary file.
* PEARL's shared-memory weights: a memfd, so a small ``/dev/shm`` does not matter; without memfd a
  small ``/dev/shm`` falls back to the temporary folder in one line, refused in one line only when
  that is too small too, and leftovers of killed runs are swept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _export_fixtures import write_manifest, write_tuned
from test_faults_inputs import one_line_error

from specstop import outputs
from specstop.cli import main
from specstop.policy import PolicySpec

REPO = Path(__file__).resolve().parents[1]


def _static_tuned(pair, tmp_path: Path) -> Path:
    ds = write_manifest(tmp_path / "data", pair)
    return write_tuned(tmp_path / "t.json", {"s": PolicySpec(kind="static", k=3)}, ds, {}, best="s")


def _during_export(monkeypatch, action):
    """Run ``action(folder)`` after the export's files are written, before they are put into --out."""
    from specstop.export import export as export_mod

    real = export_mod.write_export_folder

    def hooked(folder, *args, **kwargs):
        config = real(folder, *args, **kwargs)
        action()
        return config

    monkeypatch.setattr(export_mod, "write_export_folder", hooked)


# ------------------------------------------------------------------------------ export: others' files
@pytest.mark.parametrize("earlier", [False, True], ids=["new-folder", "overwrite"])
def test_export_keeps_a_file_dropped_into_out_while_it_runs(pair, tmp_path, monkeypatch, capsys, earlier):
    tuned = _static_tuned(pair, tmp_path)
    out = tmp_path / "exp"
    argv = ["export", "--tuned", str(tuned), "--out", str(out)]
    if earlier:
        assert main(argv) == 0
        (out / "vllm.json").write_text("{}")  # an engine file of the earlier export: replaced with it
        argv.append("--overwrite")
    _during_export(monkeypatch, lambda: (out.mkdir(exist_ok=True), (out / "notes.txt").write_text("mine")))
    assert main(argv) == 0, capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["policy"]["kind"] == "static"
    assert not (out / "vllm.json").exists()
    assert not (out / outputs.LOCK_DIR).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".exp")] == []  # no temporary folders left


def test_export_refuses_to_replace_a_file_of_its_name_that_appeared_meanwhile(pair, tmp_path, monkeypatch, capsys):
    tuned = _static_tuned(pair, tmp_path)
    out = tmp_path / "exp"
    _during_export(monkeypatch, lambda: (out.mkdir(exist_ok=True), (out / "README.md").write_text("my readme")))
    one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(out)]),
                   "README.md appeared in --out while the export ran", "nothing was replaced")
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    assert (out / "README.md").read_text() == "my readme"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".exp")] == []


_HOLD = textwrap.dedent("""
    import sys
    from specstop.outputs import FolderLock
    FolderLock(sys.argv[1], command="specstop export --out " + sys.argv[1]).acquire()
    print("held", flush=True)
    sys.stdin.read()
""")


def test_second_export_into_a_folder_being_written_is_refused(pair, tmp_path, capsys):
    """Another process holds the folder (an export running there): this one stops in one line."""
    tuned = _static_tuned(pair, tmp_path)
    out = tmp_path / "exp"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(out)]),
                       "is being written by another run", f"pid {holder.pid}")
        assert sorted(p.name for p in out.iterdir()) == [outputs.LOCK_DIR]  # nothing written beside the lock
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_two_exports_into_one_new_folder_one_is_refused(pair, tmp_path, monkeypatch, capsys):
    """A second export process started while the first writes the same new folder exits 2."""
    tuned = _static_tuned(pair, tmp_path)
    out = tmp_path / "exp"
    second = {}

    def start_second():
        second["run"] = subprocess.run(
            [sys.executable, "-m", "specstop.cli", "export", "--tuned", str(tuned), "--out", str(out)],
            capture_output=True, text=True, cwd=REPO, timeout=300,
        )

    _during_export(monkeypatch, start_second)
    assert main(["export", "--tuned", str(tuned), "--out", str(out)]) == 0
    run = second["run"]
    assert run.returncode == 2, run.stderr
    assert "is being written by another run" in run.stderr and "Traceback" not in run.stderr


def test_folder_lock_never_counts_a_lock_being_written_as_stale(tmp_path, monkeypatch):
    """The lock file appears with its holder already in it: a reader never sees an empty lock."""
    real_open = os.open
    seen = []

    def spy(path, flags, *args, **kwargs):
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            seen.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(outputs.os, "open", spy)
    lock = outputs.FolderLock(tmp_path / "f").acquire()
    try:
        assert seen == []  # never created empty under its final name
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not lock.path.exists()


# ------------------------------------------------------------------------------ file modes
@pytest.fixture
def umask():
    """``umask(value)`` sets the process umask for this test (restored afterwards)."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): p.stat().st_mode & 0o777 for p in files}


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)], ids=["umask-022", "umask-077"])
def test_written_files_get_the_mode_of_a_plain_open(pair, synth_dir, tmp_path, umask, mask, mode, capsys):
    from _data_gen_helpers import make_render, records

    from specstop.data_gen.config import DataGenConfig
    from specstop.data_gen.runner import generate_dataset
    from specstop.eval.cost import CostModel

    umask(mask)
    tuned_in = _static_tuned(pair, tmp_path)
    # a cost table, a tuned file, an export folder and engine settings
    CostModel(t_draft=0.01, t_target=0.03).save(tmp_path / "cost.json")
    assert main(["tune", "--data", str(synth_dir), "--cost-model", str(tmp_path / "cost.json"), "--sl-max-grid", "4",
                 "--out", str(tmp_path / "tuned.json")]) == 0, capsys.readouterr().err
    assert main(["export", "--tuned", str(tuned_in), "--out", str(tmp_path / "exp")]) == 0
    assert main(["export", "--tuned", str(tmp_path / "tuned.json"), "--out", str(tmp_path / "eng"), "--for", "vllm"]) == 0
    # a dataset: manifest, card and shards
    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 4
    cfg.labels.rollouts.length = 2
    generate_dataset(pair, records(3), cfg, tmp_path / "ds", render=make_render(pair.tokenizer), progress=False)
    found = {}
    for name in ("exp", "eng", "cost.json", "tuned.json", "ds"):
        found.update(_modes(tmp_path / name))
    assert {"exp/config.json", "eng/vllm.json", "cost.json", "tuned.json", "ds/manifest.json", "ds/README.md"} <= set(found)
    assert {k: oct(v) for k, v in found.items() if v != mode} == {}


# ------------------------------------------------------------------------------ /dev/shm
@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A private stand-in for /dev/shm (PEARL's session folders go there)."""
    from specstop.decode import pearl_workers

    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(pearl_workers, "SHM_DIR", str(folder), raising=False)
    return folder


def _small_folders(monkeypatch, folders) -> None:
    """``shutil.disk_usage`` (statvfs) says ``folders`` have 1 MB free, as a container's full 64 MB /dev/shm."""
    import shutil
    from collections import namedtuple

    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    small = {str(f) for f in folders}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 63 << 20, 1 << 20) if str(p) in small else real(p))


def _pearl_argv(command: str, tmp_path: Path, tiny_pair_dir: Path, monkeypatch) -> list[str]:
    from specstop.decode import pearl_spec

    monkeypatch.setattr(pearl_spec, "available_cores", lambda: [0, 1])  # PEARL splits cores (on any machine)
    argv = {"decode": ["decode", "--policy", "pearl:2", "--prompt", "hello", "--max-new-tokens", "4", "--pearl-cores", "1,1"],
            "calibrate-cost": ["calibrate-cost", "--budget", "0.2", "--k-grid", "0,1", "--no-tree", "--no-plot",
                               "--context-tokens", "16", "--out", str(tmp_path / "cost.json")]}[command]
    return [*argv, "--pair", str(tiny_pair_dir), "--device", "cpu"]


def _ours_in_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("specstop-pearl-*")} if Path("/dev/shm").is_dir() else set()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
@pytest.mark.parametrize("command", ["decode", "calibrate-cost"])
def test_pearl_runs_beside_a_small_shm(command, tiny_pair_dir, tmp_path, monkeypatch, capsys):
    """A container's /dev/shm (64 MB, nearly full here) and a full temporary folder: PEARL's weights
    travel as memfds, which neither limits, so the command runs and writes nothing there."""
    import tempfile

    _small_folders(monkeypatch, ["/dev/shm", tempfile.gettempdir()])
    before = _ours_in_shm()
    assert main(_pearl_argv(command, tmp_path, tiny_pair_dir, monkeypatch)) == 0, capsys.readouterr().err
    assert _ours_in_shm() <= before
    assert command != "calibrate-cost" or (tmp_path / "cost.json").is_file()


def test_without_memfd_a_small_shm_falls_back_to_the_temporary_folder(pair, tmp_path, monkeypatch, caplog):
    """No memfd (not Linux): a /dev/shm without room for the weights is passed over for the temporary
    folder, said in one line, and that folder is gone once the workers have mapped the weights."""
    import tempfile

    from specstop.decode import pearl_workers

    monkeypatch.setattr(pearl_workers, "_memfd", lambda name: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _small_folders(monkeypatch, ["/dev/shm"])
    before = _ours_in_shm()
    with caplog.at_level("WARNING", logger="specstop.decode.pearl_workers"):
        pearl_workers.check_room_for(pair)  # before any stage: not refused
        with pearl_workers.PearlWorkers(pair, ([0], [0]), backend="processes") as workers:
            # Two live workers with the weights mapped, and their files already gone.
            assert {workers.describe()[n]["pid"] for n in ("draft", "target")} == set(workers.pids())
            assert len(workers.pids()) == 2 and not list(tmp_path.glob("specstop-pearl-*"))
    lines = [r.getMessage() for r in caplog.records if "no room for PEARL" in r.getMessage()]
    assert lines and all(f"go through {tmp_path} instead" in line for line in lines)
    assert _ours_in_shm() <= before and not list(tmp_path.glob("specstop-pearl-*"))


@pytest.mark.parametrize("command", ["decode", "calibrate-cost"])
def test_without_memfd_pearl_refuses_a_small_shm_in_one_line(command, tiny_pair_dir, tmp_path, monkeypatch, capsys):
    """No memfd, and /dev/shm and the temporary folder both too small: one line before any file is
    written (calibrate-cost: before the timing), not a crash of torch half way."""
    import tempfile

    from specstop.decode import pearl_workers

    monkeypatch.setattr(pearl_workers, "_memfd", lambda name: None)
    _small_folders(monkeypatch, ["/dev/shm", tempfile.gettempdir()])
    before = _ours_in_shm()
    rc = main(_pearl_argv(command, tmp_path, tiny_pair_dir, monkeypatch))
    one_line_error(capsys, rc, "PEARL shares both models' weights", "MB there but", "has 1 MB free", "--shm-size=",
                   "--no-pearl-split")
    assert _ours_in_shm() <= before  # nothing written
    assert not (tmp_path / "cost.json").exists()


_KILLED_DURING_START = textwrap.dedent("""
    import sys, time
    from specstop.decode import pearl_workers
    pearl_workers.SHM_DIR = sys.argv[1]
    folder = pearl_workers._session_dir()
    (folder / "draft.pt").write_bytes(b"weights" * 1000)
    print(folder, flush=True)
    time.sleep(120)
""")


def test_leftovers_of_a_killed_pearl_start_are_swept_by_the_next_run(shm, request):
    import signal

    from specstop.decode import pearl_workers

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_DURING_START, str(shm)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    killed = Path(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)  # nothing in the process can clean up
    proc.wait(timeout=30)
    request.addfinalizer(lambda: __import__("shutil").rmtree(killed, ignore_errors=True))
    assert (killed / "draft.pt").is_file()
    live = pearl_workers._session_dir()  # this (live) process's own folder: kept
    assert not killed.exists()  # swept by the next run's start
    assert live.is_dir()
    ns = pearl_workers._pid_namespace()
    assert live.name.startswith(f"specstop-pearl-{os.getpid()}-{ns}-")
    other_ns = shm / f"specstop-pearl-{proc.pid}-{ns + 1}-abc"  # another pid namespace: its pids are not ours
    other_ns.mkdir()
    foreign = shm / "specstop-pearl-notes"  # not a session folder name
    foreign.mkdir()
    fresh = pearl_workers._session_dir()
    assert live.is_dir() and other_ns.is_dir() and foreign.is_dir() and fresh.is_dir()


def test_pipeline_passes_calibrate_settings_through(tmp_path):
    from specstop.measure.calibrate_cli import CalibrateOptions
    from specstop.measure.calibrate_cli import command as calibrate_command
    from specstop.pipeline.cli import command
    from specstop.pipeline.run import calibrate_argv

    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text("pair: x\ncalibrate: {no_pearl_split: true, batch_grid: '1,2,4'}\n")
    cfg, _ = command().parse(["--config", str(yaml_file)])
    assert isinstance(cfg.calibrate, CalibrateOptions)
    argv = calibrate_argv(cfg, tmp_path / "cost.json", tmp_path / "data")
    assert argv[0] == "calibrate-cost"
    args, _ = calibrate_command().parse(argv[1:])
    assert args.no_pearl_split is True and args.batch_grid == "1,2,4"
    assert args.budget == cfg.calibrate_budget and args.out == str(tmp_path / "cost.json")
    # each trained predictor's decision is timed too (tune prices a learned head's own cost per draft step)
    argv = calibrate_argv(cfg, tmp_path / "cost.json", tmp_path / "data", {"disco_ffn": "/r/best.ckpt"})
    args, _ = calibrate_command().parse(argv[1:])
    assert args.checkpoint == ["disco_ffn=/r/best.ckpt"]
    # the defaults add nothing (an earlier run's calibrate stage is not redone)
    yaml_file.write_text("pair: x\n")
    cfg, _ = command().parse(["--config", str(yaml_file)])
    assert cfg.stage_args("calibrate") == []
    yaml_file.write_text("pair: x\ncalibrate: {out: elsewhere.json}\n")
    with pytest.raises(Exception, match="unknown config key 'calibrate.out'"):
        command().parse(["--config", str(yaml_file)])
