"""Fault injection, outputs and named inputs: nothing lost, nothing silently wrong.

* A folder specstop did not make is never cleaned, overwritten or deleted (export, generate, eval).
* Every writing command checks its output before the long work: a read-only location or a full
  disk is one line, and nothing is half-written.
* A predictor named explicitly must load; tuned files work from any directory.
* Requests beyond the models' context window, duplicate YAML keys, copied-in shards, edited
  exports and mismatched hidden sizes are refused in one line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import lightning  # noqa: F401 - imported here so its log handler binds to the real stderr, not a test's
import pytest
from _data_gen_helpers import make_render, records
from _export_fixtures import random_exports, write_checkpoint, write_manifest, write_tuned
from test_faults_inputs import one_line_error

from specstop import outputs
from specstop.cli import main
from specstop.data_gen.config import DataGenConfig
from specstop.data_gen.ownership import clean_partial_shards
from specstop.data_gen.runner import generate_dataset
from specstop.errors import UserError
from specstop.policy import PolicySpec
from specstop.testing import tiny_pair

REPO = Path(__file__).resolve().parents[1]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _cfg() -> DataGenConfig:
    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 6
    cfg.generation.batch_size = 2
    cfg.labels.rollouts.length = 2
    return cfg


def _gen(pair, out, recs):
    return generate_dataset(pair, recs, _cfg(), out, render=make_render(pair.tokenizer), progress=False)


# ------------------------------------------------------------------------------ foreign folders
def test_export_overwrite_never_replaces_a_dataset(pair, tmp_path, capsys):
    ds = write_manifest(tmp_path / "data", pair)
    (ds / "notes.md").write_text("my notes")
    tuned = write_tuned(tmp_path / "t.json", {"s": PolicySpec(kind="static", k=3)}, ds, {}, best="s")
    before = _snapshot(ds)
    one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(ds), "--overwrite"]),
                   "not a specstop export", "only replaces an earlier export")
    assert _snapshot(ds) == before


@pytest.mark.parametrize("foreign", ["shards/train-00000/my_file.txt", "README.md", "manifest.json", "shards/notes.txt"])
def test_generate_never_cleans_or_overwrites_foreign_files(pair, tmp_path, foreign):
    out = tmp_path / "ds"
    (out / foreign).parent.mkdir(parents=True)
    (out / foreign).write_text("the user's own file")
    before = _snapshot(out)
    with pytest.raises(UserError, match="specstop generate did not write"):
        _gen(pair, out, records(4))
    assert _snapshot(out) == before


def test_partial_shard_cleanup_only_touches_specstop_folders(tmp_path):
    root = tmp_path / "ds" / "shards"
    (root / "train-00000").mkdir(parents=True)
    (root / "train-00000" / "my_file.txt").write_text("mine")
    (root / ".tmp-train-00001-0123abcd" / "tokens").mkdir(parents=True)  # an interrupted write of ours
    assert clean_partial_shards(tmp_path / "ds") == [".tmp-train-00001-0123abcd"]
    assert (root / "train-00000" / "my_file.txt").read_text() == "mine"


def test_eval_does_not_overwrite_a_report_without_overwrite(tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("an earlier report")
    one_line_error(capsys, main(["eval", "--data", "x", "--tuned", "y", "--out", str(out)]),
                   "already holds report.md", "--overwrite")
    # --overwrite replaces only a report specstop wrote (report.json with its rows).
    one_line_error(capsys, main(["eval", "--data", "x", "--tuned", "y", "--out", str(out), "--overwrite"]),
                   "not part of a specstop report")
    assert (out / "report.md").read_text() == "an earlier report"


# ------------------------------------------------------------------------------ read-only / full disk
def _readonly(folder):
    raise OSError(errno.EROFS, "Read-only file system", str(folder))


def _full(folder):
    raise OSError(errno.ENOSPC, "No space left on device", str(folder))


def _no_long_work(*a, **kw):
    raise AssertionError("long work started before the output was checked")


def _commands(tmp: Path, synth: Path) -> dict[str, list[str]]:
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    tuned = tmp / "t.json"
    tuned.write_text(json.dumps({"schema_version": 1, "policies": {}, "best": None}))
    return {
        "generate": ["generate", "--pair", "x", "--prompts", str(prompts), "--data", str(tmp / "o" / "ds")],
        "calibrate-cost": ["calibrate-cost", "--pair", "x", "--out", str(tmp / "o" / "cost.json")],
        "tune": ["tune", "--data", str(synth), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8", "--out", str(tmp / "o" / "t.json")],
        "eval": ["eval", "--data", str(synth), "--tuned", str(tuned), "--out", str(tmp / "o" / "rep")],
        "export": ["export", "--tuned", str(tuned), "--out", str(tmp / "o" / "exp")],
        "export-engines": ["export", "--tuned", str(tuned), "--out", str(tmp / "o" / "eng"), "--for", "vllm"],
        "sweep": ["sweep", "--config", str(REPO / "configs/train/disco_ffn.yaml"), "--data", str(synth),
                  "--out", str(tmp / "o" / "sweep")],
        "train": ["train", "--config", str(REPO / "configs/train/disco_ffn.yaml"), "--data", str(synth),
                  "--trainer.default_root_dir", str(tmp / "o" / "run"), "--trainer.max_epochs", "1"],
        "fetch-pair": ["fetch-pair", "qwen2.5-coder-0.5b-1.5b"],
    }


@pytest.mark.parametrize("fault, fragment", [(_readonly, "read-only file system"), (_full, "no space left")],
                         ids=["read-only", "full-disk"])
@pytest.mark.parametrize("command", ["generate", "calibrate-cost", "tune", "eval", "export", "export-engines",
                                     "sweep", "train", "fetch-pair"])
def test_every_writing_command_checks_its_output_first(command, fault, fragment, synth_dir, tmp_path, tmp_cache,
                                                       monkeypatch, capsys):
    from specstop import pair as pair_pkg
    from specstop.pair import fetch_cli, registry

    monkeypatch.setattr(outputs, "_probe", fault)
    monkeypatch.setattr(pair_pkg, "load_named_pair", _no_long_work)
    monkeypatch.setattr(registry, "load_named_pair", _no_long_work)
    monkeypatch.setattr(fetch_cli, "fetch_pair", _no_long_work)
    argv = _commands(tmp_path, synth_dir)[command]
    one_line_error(capsys, main(argv), fragment)
    assert not (tmp_path / "o").exists()  # nothing created, nothing half-written


def test_pipeline_checks_its_run_folder_first(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'o' / 'run'}\npair: {tmp_path / 'nopair'}\nfetch: false\n"
                   f"data: {{prompts: {{source: builtin:mbpp}}}}\n")
    monkeypatch.setattr(outputs, "_probe", _readonly)
    one_line_error(capsys, main(["pipeline", "--config", str(cfg)]), "read-only file system")
    assert not (tmp_path / "o").exists()


def test_full_disk_while_writing_leaves_no_half_file(synth_dir, tmp_path, monkeypatch, capsys):
    """ENOSPC in the middle of writing tuned.json: one line, no tuned.json, no temporary file."""
    from specstop import outputs

    class FullDisk:
        """The temporary file is created; writing into it fails as on a full disk."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_fdopen = outputs.os.fdopen
    def fdopen(fd, mode="r", *a, **kw):  # the output check's probe (binary) still passes: the disk fills later
        f = real_fdopen(fd, mode, *a, **kw)
        return f if "b" in mode else FullDisk(f)

    monkeypatch.setattr(outputs.os, "fdopen", fdopen)
    out = tmp_path / "tuned"
    out.mkdir()
    one_line_error(capsys, main(["tune", "--data", str(synth_dir), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8",
                                 "--out", str(out / "t.json")]), f"no space left on the device (or over quota) while "
                   f"writing {out / 't.json'} (", " MB free there)")
    assert list(out.iterdir()) == []


def test_a_full_disk_names_the_file_wherever_it_is_met(tmp_path):
    """Writes outside specstop's writers (a library's, a plain open()) name their file too, and the
    free space where it is; a dataset shard's table is named by its final path."""
    import re
    import shutil

    from specstop.outputs import naming_writes, write_error_message

    def plain_write(path):
        with open(path, "w") as f:
            f.write("x")
            raise OSError(errno.ENOSPC, "No space left on device")  # what f.write raises on a full disk

    try:
        plain_write(tmp_path / "notes.txt")
    except OSError as err:
        line = write_error_message(err)
    free_mb = shutil.disk_usage(tmp_path).free >> 20
    assert f"while writing {tmp_path / 'notes.txt'} (" in line and "MB free there)" in line
    assert abs(int(re.search(r"\((\d+) MB free there\)", line).group(1)) - free_mb) < 64
    shard_table = tmp_path / "ds" / "shards" / "train-00000" / "tokens"
    try:
        with naming_writes(shard_table):
            raise OSError(errno.ENOSPC, "No space left on device")  # pyarrow's writer names no file
    except OSError as err:
        assert err.filename == str(shard_table)
        assert f"while writing {shard_table} (" in write_error_message(err)


def test_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    from specstop.pair import fetch_cli

    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    monkeypatch.setenv("SPECSTOP_CACHE", str(cache))
    monkeypatch.setattr(fetch_cli, "fetch_pair", _no_long_work)
    one_line_error(capsys, main(["fetch-pair", "qwen2.5-coder-0.5b-1.5b"]), "SPECSTOP_CACHE", "is a file")


# ------------------------------------------------------------------------------ named inputs must load
@pytest.fixture(scope="module")
def predictor_inputs(pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pred")
    exports = random_exports(tmp, pair)
    return {
        "missing": tmp / "nope.ckpt",
        "export folder": exports["disco"],
        "tuned.json": tmp / "tuned.json",
        "safetensors": exports["disco"] / "model.safetensors",
    }


@pytest.mark.parametrize("kind, fragment", [
    ("missing", "no checkpoint at"), ("export folder", "is an export folder"),
    ("tuned.json", "a JSON file"), ("safetensors", "a safetensors weights file"),
])
def test_tune_refuses_a_named_checkpoint_that_cannot_load(predictor_inputs, synth_dir, tmp_path, kind, fragment, capsys):
    out = tmp_path / "t.json"
    rc = main(["tune", "--data", str(synth_dir), "--cost-model", "llama2-7b-70b", "--sl-max-grid", "4,8", "--out", str(out),
               "--checkpoint", f"mine={predictor_inputs[kind]}"])
    one_line_error(capsys, rc, "checkpoint mine=", fragment)
    assert not out.exists()


def test_tuned_paths_work_from_another_directory(synth_dir, tmp_path, monkeypatch):
    from specstop.eval.tuned_file import read_tuned
    from specstop.models.features import FeatureSpec  # noqa: F401 - the checkpoint below reads it

    ckpt = tmp_path / "run" / "disco.ckpt"
    ckpt.parent.mkdir()
    write_checkpoint(ckpt, "disco_ffn")
    monkeypatch.chdir(tmp_path / "run")
    tuned_path = tmp_path / "run" / "tuned.json"
    from specstop.eval.tune_cli import tune_dataset

    tuned = tune_dataset(os.path.relpath(synth_dir), "validation", {}, __import__("specstop.eval.cost", fromlist=["x"]).load_cost_model("llama2-7b-70b"),
                         sl_max_grid=(4, 8))
    assert Path(tuned["dataset"]).is_absolute()
    # A file with relative paths (older versions) resolves them beside itself, from any directory.
    tuned_path.write_text(json.dumps({**tuned, "dataset": os.path.relpath(synth_dir, tmp_path / "run"),
                                      "checkpoints": {"d": "disco.ckpt"}}))
    monkeypatch.chdir(tmp_path)
    got = read_tuned(tuned_path)
    assert Path(got["checkpoints"]["d"]) == ckpt and Path(got["dataset"]).resolve() == Path(synth_dir).resolve()


def test_eval_refuses_a_listed_checkpoint_that_cannot_load(synth_dir, tmp_path, capsys):
    tuned = write_tuned(tmp_path / "t.json", {"s": PolicySpec(kind="static", k=3)}, synth_dir,
                        {"gone": tmp_path / "gone.ckpt"}, best="s")
    one_line_error(capsys, main(["eval", "--data", str(synth_dir), "--tuned", str(tuned), "--cost-model",
                                 "llama2-7b-70b", "--out", str(tmp_path / "rep")]), "checkpoint gone=", "no checkpoint at")
    assert not (tmp_path / "rep").exists()


# ------------------------------------------------------------------------------ context window
def test_decode_refuses_a_prompt_beyond_the_context_window(tiny_pair_dir, capsys):
    from specstop.pair.context import context_window

    window = context_window(tiny_pair())
    rc = main(["decode", "--pair", str(tiny_pair_dir), "--prompt", "hello " * window, "--device", "cpu",
               "--dtype", "float32", "--max-new-tokens", "4"])
    one_line_error(capsys, rc, "context window is", "shorten the prompt")


def test_calibrate_refuses_context_tokens_beyond_the_window(tiny_pair_dir, tmp_path, capsys):
    rc = main(["calibrate-cost", "--pair", str(tiny_pair_dir), "--context-tokens", "1000000", "--device", "cpu",
               "--dtype", "float32", "--out", str(tmp_path / "cost.json")])
    one_line_error(capsys, rc, "--context-tokens 1000000", "context window is")
    assert not (tmp_path / "cost.json").exists()


# ------------------------------------------------------------------------------ YAML
def test_duplicate_yaml_sections_are_refused_with_the_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("generation:\n  batch_size: 2\nlabels:\n  topk_k: 4\ngeneration:\n  max_new_tokens: 8\n")
    one_line_error(capsys, main(["generate", "--config", str(cfg), "--data", str(tmp_path / "d")]),
                   "c.yaml:5: duplicate section 'generation' (first at line 1)")
    cfg.write_text("generation:\n  batch_size: 2\n  batch_size: 4\n")
    one_line_error(capsys, main(["generate", "--config", str(cfg), "--data", str(tmp_path / "d")]),
                   "c.yaml:3: duplicate key 'batch_size'")


def test_duplicate_keys_in_a_train_config_are_refused(synth_dir, tmp_path, capsys):
    cfg = tmp_path / "t.yaml"
    base = (REPO / "configs/train/disco_ffn.yaml").read_text()
    cfg.write_text(base + "\ntrainer:\n  max_epochs: 1\n")
    one_line_error(capsys, main(["train", "--config", str(cfg), "--data", str(synth_dir)]), "duplicate section 'trainer'")


def test_alias_bomb_error_is_short(tmp_path, capsys):
    lines = ["a: &a ['lol','lol','lol','lol','lol','lol','lol','lol','lol']"]
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]")
    lines.append("generation:\n  max_new_tokens: *i")
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    line = one_line_error(capsys, main(["generate", "--config", str(cfg), "--data", str(tmp_path / "d")]))
    assert len(line) < 1000


# ------------------------------------------------------------------------------ datasets
def test_verify_detects_a_shard_copied_from_another_dataset(pair, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _gen(pair, a, records(4))
    recs = records(4)
    for r in recs:
        r.prompt_id = "other-" + r.prompt_id  # another split seed / prompt set: other prompts per shard
    _gen(pair, b, recs)
    assert main(["generate", "--verify", "--data", str(a)]) == 0
    shutil.rmtree(a / "shards" / "train-00000")
    shutil.copytree(b / "shards" / "train-00000", a / "shards" / "train-00000")
    rc = main(["generate", "--verify", "--data", str(a)])
    assert rc == 2
    assert "copied in from another dataset" in capsys.readouterr().out


# ------------------------------------------------------------------------------ wording
def test_prompt_file_that_is_a_folder_or_fifo_says_what_it_is(tmp_path):
    from specstop.prompts.jsonfile import read_json_records

    with pytest.raises(UserError, match="is a folder, not a file"):
        read_json_records(tmp_path)
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"is a named pipe \(FIFO\), not a file"):
        read_json_records(fifo)


def test_other_hidden_size_is_named_not_same_size(pair):
    from specstop.export.runtime import identity_matches

    mine = {"name_or_path": "d", "hidden_size": 32, "weights_sha256": "files-v1:aa"}
    theirs = {"draft": {"name_or_path": "d", "hidden_size": 64, "weights_sha256": "files-v1:bb"}}
    ok, why = identity_matches(mine, theirs)
    assert not ok and "hidden_size 32 (yours) vs 64 (export)" in why and "same name and size" not in why


def test_draft_mismatch_with_another_hidden_size_is_one_line(pair, tmp_path):
    from specstop.export.runtime import StoppingPolicy, check_policy_inputs

    exports = random_exports(tmp_path, pair)
    policy = StoppingPolicy.from_pretrained(exports["sdpp"])
    with pytest.raises(UserError, match="cannot bridge different sizes"):
        check_policy_inputs(policy, pair.draft_identity.hidden_size + 8, "export sdpp")


# ------------------------------------------------------------------------------ train: last epoch kept
def test_train_keeps_the_last_epoch_and_ctrl_c_prints_how_to_resume(synth_dir, tmp_path, monkeypatch, capsys):
    from lightning.pytorch.callbacks import Callback

    from specstop.train import cli as train_cli

    class CtrlCAtEpoch2(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                raise KeyboardInterrupt

    real = train_cli.SpecstopCLI.before_fit

    def before_fit(self):
        real(self)
        self.trainer.callbacks.append(CtrlCAtEpoch2())

    monkeypatch.setattr(train_cli.SpecstopCLI, "before_fit", before_fit)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--config", str(REPO / "configs/train/disco_ffn.yaml"), "--data.data_dir", str(synth_dir),
            "--trainer.max_epochs", "5", "--trainer.enable_progress_bar", "false"]
    import signal

    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            main(argv)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-C while it shuts down
    err = capsys.readouterr().err
    hint = next(ln for ln in err.splitlines() if ln.startswith("specstop train: interrupted"))
    last = sorted(tmp_path.rglob("last.ckpt"))
    assert last, "no last.ckpt: the latest epoch would be lost"
    # Stopped as epoch 2 starts: epochs 0 and 1 are done, and last.ckpt holds epoch 1.
    assert f"--ckpt_path {last[0].resolve()}" in hint and "during epoch 2; epoch 1 (step " in hint


def test_export_weights_take_the_umask_like_every_other_file(tmp_path):
    """safetensors writes its files 0600; an export's weights (and node head) are read by others, so under
    umask 022 they are 0644 like its config.json."""
    import os
    import stat

    from specstop.export.export import export_policy
    from specstop.models import build_predictor
    from specstop.policy import PolicySpec

    old = os.umask(0o022)
    try:
        predictor = build_predictor("disco_ffn", k=4)
        spec = PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5)
        export_policy(tmp_path / "export", spec=spec, predictor=predictor, allow_missing_pair=True)
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "export").iterdir() if f.is_file()}
    assert modes["model.safetensors"] == 0o644 and modes["config.json"] == 0o644
