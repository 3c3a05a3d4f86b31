"""Every script in benchmarks/ treats a bad argument as the ``specstop`` command does: one line on
stderr naming it, a non-zero exit, no traceback, nothing left at ``--out``, all before any model
loads or timing starts. The shared pieces (specstop.script_args, specstop.script_main) are tested
here too: the result writer, the ownership of an existing result, a user error raised deep inside a
script's work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _snippets import REPO, run_script

from specstop.errors import UserError
from specstop.script_args import WRITTEN_BY, check_result_path, write_result
from specstop.script_main import run_main

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))

#: script -> (bad numeric argument, the flag the message must name); ``{out}``/``{tmp}`` are filled in.
BAD_NUMBER = {
    "batch_throughput.py": ("--pair p --cost c --tuned t --repeats -1 --out {out}", "--repeats"),
    "compiled_draft_step.py": ("--pair p --steps 0 --json {out}", "--steps"),
    "data_gen_throughput.py": ("--max-new-tokens -5 --json {out}", "--max-new-tokens"),
    "float32_gemm.py": ("--reps -1", "--reps"),
    "linear_route.py": ("--pair p --rows 1,-2 --out {out}", "--rows"),
    "llamacpp_speculative.py": ("--data d --settings s --max-new-tokens -1 --out {out}", "--max-new-tokens"),
    "multi_level.py": ("--pair p --prompt hi --budget-s -1 --out {tmp}/levels", "--budget-s"),
    "online_speedup.py": ("--pair p --prompt hi --repeats 0 --out {out}", "--repeats"),
    "replay_speed.py": ("--tokens -1000", "--tokens"),
    "step_drift.py": ("--pair p --reps -2", "--reps"),
    "stopping_ceiling.py": ("--data d --cost c --sl-max 0 --out {tmp}/ceiling", "--sl-max"),
    "theorem1_check.py": ("--pair p --seeds 0 --out {out}", "--seeds"),
    "train_throughput.py": ("--epochs -1 --json {out}", "--epochs"),
    "vllm_serving.py": ("--smoke --max-new-tokens -1 --out {out}", "--max-new-tokens"),
}
#: Scripts without a numeric argument.
NO_NUMBER = {"dataset_stats.py", "stopping_headroom.py"}

#: script -> (arguments naming a missing input ``{missing}``, the flag the message must name or None).
MISSING_INPUT = {
    "batch_throughput.py": ("--pair p --cost {missing} --tuned {missing} --out {out}", "--cost"),
    "dataset_stats.py": ("{missing}", "data_dir"),
    "llamacpp_speculative.py": ("--data {missing} --settings {missing} --out {out}", "--data"),
    "multi_level.py": ("--pair p --data {missing} --out {tmp}/levels", "--data"),
    "online_speedup.py": ("--pair p --prompts {missing} --out {out}", "--prompts"),
    "stopping_ceiling.py": ("--data {missing} --cost c --out {tmp}/ceiling", "--data"),
    "stopping_headroom.py": ("--data {missing} --out {tmp}/headroom", "--data"),
    "train_throughput.py": ("--data {missing} --json {out}", "--data"),
    "vllm_serving.py": ("--smoke --vllm-python {missing} --out {out}", "--vllm-python"),
}
#: Scripts that read no file the user names (a pair or prompt source is a name or a path).
NO_INPUT_FILE = {"compiled_draft_step.py", "data_gen_throughput.py", "float32_gemm.py", "linear_route.py",
                 "replay_speed.py", "step_drift.py", "theorem1_check.py"}


def test_every_script_is_covered():
    assert set(BAD_NUMBER) | NO_NUMBER == set(SCRIPTS), "add the new script to BAD_NUMBER or NO_NUMBER"
    assert set(MISSING_INPUT) | NO_INPUT_FILE == set(SCRIPTS), "add the new script to MISSING_INPUT or NO_INPUT_FILE"


def _refused(script: str, argv: str, tmp_path, capsys) -> str:
    """Run ``script argv`` in this process; assert it exits non-zero with one line and leaves no output."""
    out, missing = tmp_path / "out.json", tmp_path / "nowhere" / "input.json"
    args = argv.format(out=out, tmp=tmp_path, missing=missing).split()
    code = run_script(BENCH / script, args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code != 0, f"{script} {argv}: exited 0"
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{script}: error: "), lines
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [], "an output was left behind"
    return lines[0]


@pytest.mark.parametrize("script", sorted(BAD_NUMBER))
def test_a_bad_number_is_one_line(script, tmp_path, capsys):
    argv, flag = BAD_NUMBER[script]
    line = _refused(script, argv, tmp_path, capsys)
    assert f"argument {flag}" in line and "give " in line, line


@pytest.mark.parametrize("script", sorted(MISSING_INPUT))
def test_a_missing_input_is_one_line(script, tmp_path, capsys):
    argv, flag = MISSING_INPUT[script]
    line = _refused(script, argv, tmp_path, capsys)
    assert flag in line and str(tmp_path / "nowhere") in line and "no such" in line, line


@pytest.mark.parametrize("script, argv", [
    ("theorem1_check.py", "--pair {tmp}/no-pair --out {out}"),
    ("multi_level.py", "--pair {tmp}/no-pair --prompt hi --out {tmp}/levels"),
    ("online_speedup.py", "--pair {tmp}/no-pair --prompt hi --out {out}"),
])
def test_a_run_refused_after_parsing_leaves_no_output(script, argv, tmp_path, capsys):
    """Inputs checked by the work itself (here: a pair that is not there) are one line too, and the
    --out file or folder is not created before there is a result."""
    line = _refused(script, argv, tmp_path, capsys)
    assert "no-pair" in line, line


def test_a_script_run_as_a_program_prints_one_line(tmp_path):
    """The same, in a process of its own as a user runs it: what reaches the terminal is one line."""
    done = subprocess.run([sys.executable, str(BENCH / "dataset_stats.py"), str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"dataset_stats.py: error: argument data_dir: {tmp_path / 'missing'}: no such folder; check the path "
        "(dataset_stats.py --help lists the flags)"]


def test_an_existing_file_the_script_did_not_write_is_refused(tmp_path, capsys):
    theirs = tmp_path / "notes.json"
    theirs.write_text('{"mine": true}\n')
    line = _refused_keeping(theirs, "theorem1_check.py", f"--pair p --out {theirs}", capsys)
    assert f"{theirs} already exists and theorem1_check.py did not write it" in line, line


def _refused_keeping(path, script, argv, capsys) -> str:
    before = path.read_bytes()
    assert run_script(BENCH / script, argv.split()) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert path.read_bytes() == before, "the file was touched"
    return lines[0]


def test_a_result_is_written_whole_and_marked_and_a_rerun_replaces_only_its_own(tmp_path):
    script = str(BENCH / "theorem1_check.py")
    out = tmp_path / "sub" / "r.json"
    check_result_path(out, script)  # nothing there yet: fine, and nothing is created
    assert not out.parent.exists()
    write_result(out, {"args": {"out": out}, "value": 1.5}, script)
    assert json.loads(out.read_text()) == {"args": {"out": str(out)}, "value": 1.5, WRITTEN_BY: "theorem1_check.py"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]  # no temporary file left
    check_result_path(out, script)  # its own result: a rerun may replace it
    with pytest.raises(UserError, match="train_throughput.py did not write it"):
        check_result_path(out, str(BENCH / "train_throughput.py"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="did not write it"):
        check_result_path(tmp_path / "list.json", script)


@pytest.mark.parametrize("error, expected", [
    (UserError("--pair nowhere: no such pair; give a pair name or folder"), "--pair nowhere: no such pair"),
    (FileNotFoundError(2, "No such file or directory", "/data/prompts.jsonl"),
     "/data/prompts.jsonl: no such file or folder; check the path"),
])
def test_a_user_error_raised_inside_the_work_is_one_line(error, expected, capsys):
    def main():
        raise error

    with pytest.raises(SystemExit) as exit_:
        run_main(main, "/repo/benchmarks/some_bench.py")
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"some_bench.py: error: {expected}"), lines


def test_a_bug_keeps_its_traceback():
    def main():
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        run_main(main, "some_bench.py")


def test_run_main_exits_with_mains_status():
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: 3, "some_bench.py")
    assert exit_.value.code == 3
