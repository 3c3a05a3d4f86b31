"""Fault injection, models and exports: broken model folders, devices, offline hub ids, edited or
foreign exports, and the memory guard. Each is one line naming the problem and the fix."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from _export_fixtures import random_exports, single_thread, write_checkpoint, write_manifest, write_tuned  # noqa: F401
from test_faults_inputs import one_line_error

from specstop.cli import main
from specstop.errors import ResourceLimitError, UserError
from specstop.export.export import ExportError, export_from_files
from specstop.export.runtime import DraftMismatchError, StoppingPolicy
from specstop.policy import PolicySpec
from specstop.testing import save_tiny_pair, tiny_pair


def _info(*argv: str) -> list[str]:
    return ["info", *argv, "--dtype", "float32", "--device", "cpu"]


def _copy_pair(tiny_pair_dir, tmp_path) -> Path:
    dst = tmp_path / "pair"
    shutil.copytree(tiny_pair_dir, dst)
    return dst


# ------------------------------------------------------------------------------ model folders
def test_empty_draft_folder(tiny_pair_dir, tmp_path, capsys):
    d = _copy_pair(tiny_pair_dir, tmp_path)
    shutil.rmtree(d / "draft")
    (d / "draft").mkdir()
    one_line_error(capsys, main(_info("--pair", str(d))), f"draft folder {d / 'draft'} is empty", "save_pretrained")


def test_target_without_tokenizer(tiny_pair_dir, tmp_path, capsys):
    d = _copy_pair(tiny_pair_dir, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / "target" / f).unlink()
    one_line_error(capsys, main(_info("--pair", str(d))), "target folder", "has no tokenizer files")


def test_truncated_safetensors(tiny_pair_dir, tmp_path, capsys):
    d = _copy_pair(tiny_pair_dir, tmp_path)
    w = d / "target" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    one_line_error(capsys, main(_info("--pair", str(d))), str(w), "truncated")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_link_to_nothing_names_the_link(name, tiny_pair_dir, tmp_path, capsys):
    """A model folder of links (into a cache since cleaned): the line names the link and where it led,
    not a missing config.json or a raw FileNotFoundError."""
    d = _copy_pair(tiny_pair_dir, tmp_path)
    link = d / "draft" / name
    link.unlink()
    link.symlink_to(tmp_path / "cleaned" / name)
    one_line_error(capsys, main(_info("--pair", str(d))),
                   f"{link} is a symbolic link to {tmp_path / 'cleaned' / name}, which does not exist")


def test_missing_model_folder(tmp_path, capsys):
    one_line_error(capsys, main(_info("--draft", str(tmp_path / "nope"), "--target", str(tmp_path / "nope2"))),
                   "draft model folder", "does not exist")


def test_cuda_without_cuda(tiny_pair_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line_error(capsys, main(["info", "--pair", str(tiny_pair_dir), "--device", "cuda"]),
                   "--device cuda asks for CUDA", "--device cpu")
    one_line_error(capsys, main(["info", "--pair", str(tiny_pair_dir), "--device", "tpu9"]), "unknown device 'tpu9'")


def test_hub_id_offline_is_fast_and_named(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    rc = main(_info("--draft", "Qwen/Qwen2.5-0.5B", "--target", "Qwen/Qwen2.5-1.5B"))
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Retrying" not in err  # one line (hint on it), no retries, nothing twice
    assert rc == 2 and "draft model 'Qwen/Qwen2.5-0.5B'" in err and "HF_HUB_OFFLINE=1 is set" in err


def test_hub_id_unreachable_without_offline_flag(capsys, monkeypatch):
    from specstop.pair import sources

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SPECSTOP_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda endpoint=None: False)
    one_line_error(capsys, main(_info("--draft", "Qwen/Qwen2.5-0.5B", "--target", "Qwen/Qwen2.5-1.5B")),
                   "'Qwen/Qwen2.5-0.5B'", "cannot be reached", "huggingface-cli download")


def test_hub_probe_times_out_quickly(monkeypatch):
    import socket

    from specstop.pair.sources import hub_reachable

    monkeypatch.setenv("SPECSTOP_HUB_TIMEOUT", "0.5")
    silent = socket.socket()  # accepts connections (kernel backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        t0 = time.perf_counter()
        assert hub_reachable(f"http://127.0.0.1:{silent.getsockname()[1]}") is False
        assert hub_reachable(f"http://127.0.0.1:{closed.getsockname()[1]}") is False
        assert time.perf_counter() - t0 < 5
    finally:
        silent.close()
        closed.close()


# ------------------------------------------------------------------------------ weights identity
def test_weights_fingerprint_tells_same_named_drafts_apart(tmp_path):
    from specstop.pair.loader import load_pair

    a = save_tiny_pair(tmp_path / "a" / "tiny", seed=0)
    b = save_tiny_pair(tmp_path / "b" / "tiny", seed=3)  # same folder names, sizes and tokenizer
    pa = load_pair(str(a / "draft"), str(a / "target"), dtype="float32", device="cpu")
    pb = load_pair(str(b / "draft"), str(b / "target"), dtype="float32", device="cpu")
    assert pa.draft_identity.weights_sha256.startswith("files-v1:")
    assert pa.draft_identity.weights_sha256 != pb.draft_identity.weights_sha256
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)  # the same weights in another folder are the same model
    pm = load_pair(str(moved / "draft"), str(moved / "target"), dtype="float32", device="cpu")
    assert pm.draft_identity.weights_sha256 == pa.draft_identity.weights_sha256
    assert pa.tokenizer_hash == pb.tokenizer_hash and pa.draft_identity.num_parameters == pb.draft_identity.num_parameters


def test_large_weight_files_are_sampled_not_read_whole(tmp_path, monkeypatch):
    from specstop.pair import weights

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * (3 << 20))
    monkeypatch.setattr(weights, "FULL_HASH_LIMIT", 1 << 20)
    first = weights.folder_fingerprint(tmp_path)
    with open(f, "r+b") as fh:
        fh.seek(weights.HEAD_BYTES + 5)  # inside the first sampled block
        fh.write(b"\1")
    assert weights.folder_fingerprint(tmp_path) != first


def test_export_for_another_draft_with_same_name_is_refused(pair, exports):
    other = tiny_pair(seed=5)  # same name, size and tokenizer; other weights
    assert other.draft_identity.name_or_path == pair.draft_identity.name_or_path
    with pytest.raises(DraftMismatchError, match="draft weights fingerprint"):
        StoppingPolicy.from_pretrained(exports["disco"], draft_identity=other.draft_identity,
                                       tokenizer_hash=other.tokenizer_hash)
    StoppingPolicy.from_pretrained(exports["disco"], draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)


def test_export_and_eval_refuse_a_checkpoint_of_another_pair(pair, tmp_path):
    from specstop.models.checkpoint import save_predictor_checkpoint

    other = tiny_pair(seed=5)
    ck = tmp_path / "c.ckpt"
    model = write_checkpoint(tmp_path / "raw.ckpt", "disco_ffn")
    save_predictor_checkpoint(ck, model, {"dataset": {"pair": other.to_dict()}})
    ds = write_manifest(tmp_path / "data", pair)
    tuned = write_tuned(tmp_path / "t.json", {"d": PolicySpec(kind="predictor", family="disco_ffn", threshold=0.5)},
                        ds, {"d": ck}, best="d")
    with pytest.raises(ExportError, match=r"another model pair.*draft weights \(fingerprint\)"):
        export_from_files(tmp_path / "e", tuned=tuned)
    assert not (tmp_path / "e").exists()
    from specstop.eval.scoring import score_checkpoints

    with pytest.raises(UserError, match=r"checkpoint d=.* another model pair than"):
        score_checkpoints(None, ds, "test", {"d": str(ck)})  # what tune and eval run first


# ------------------------------------------------------------------------------ export folders
def _edited(exports, tmp_path, edit) -> Path:
    d = tmp_path / "edited"
    shutil.copytree(exports["disco"], d)
    edit(d)
    return d


def _edit_config(key_path, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        obj = cfg
        for k in key_path[:-1]:
            obj = obj[k]
        obj[key_path[-1]] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (_edit_config(("predictor", "weights"), "../x.safetensors"), "points outside"),
        (_edit_config(("predictor", "weights"), "/etc/passwd"), "must be a file name inside"),
        (_edit_config(("predictor", "config", "hidden_dim"), 65), "does not match the predictor that config.json describes"),
        (_edit_config(("predictor", "config", "width"), 3), "predictor.config does not fit family"),
        (_edit_config(("policy", "threshold"), 5.0), "policy: policy threshold tau (stop when score < tau) must be in [0, 1]"),
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]),
         "not a readable safetensors file"),
        (lambda d: (d / "config.json").write_text('{"format": "specstop-stopping-policy",\n "schema_version": 1,,}'),
         "config.json:2: not valid JSON"),
        (_edit_config(("surprise",), 1), "unknown config key 'surprise'"),
        (_edit_config(("predictor", "activation"), "gelu"), "unknown config key 'predictor.activation'"),
    ],
    ids=["weights-dotdot", "weights-absolute", "shape", "config-key", "threshold", "truncated", "malformed",
         "unknown-top-level", "unknown-predictor-key"],
)
def test_edited_exports_are_refused(exports, tmp_path, edit, fragment):
    d = _edited(exports, tmp_path, edit)
    with pytest.raises(UserError) as info:
        StoppingPolicy.from_pretrained(d)
    assert fragment in str(info.value)


def test_weights_linked_out_of_an_export_blame_the_link_not_config_json(exports, tmp_path, capsys):
    """config.json names the default model.safetensors, which is a symbolic link to a file elsewhere:
    the line names the link and where it leads, not config.json."""
    d = _edited(exports, tmp_path, lambda d: None)
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(UserError) as info:
        StoppingPolicy.from_pretrained(d)
    line = str(info.value)
    assert line.startswith(f"{d / 'model.safetensors'} is a symbolic link that points outside {d}, to {outside}")
    assert "copy the file into the folder" in line and "config.json" not in line


def test_decode_with_an_edited_export_is_one_line(exports, tiny_pair_dir, tmp_path, capsys):
    d = _edited(exports, tmp_path, _edit_config(("predictor", "config", "hidden_dim"), 65))
    rc = main(["decode", "--pair", str(tiny_pair_dir), "--policy", str(d), "--prompt", "hi", "--device", "cpu",
               "--dtype", "float32", "--allow-draft-mismatch"])
    one_line_error(capsys, rc, "does not match the predictor")


def test_export_out_is_not_overwritten_silently(pair, tmp_path, capsys, monkeypatch):
    ds = write_manifest(tmp_path / "data", pair)
    tuned = write_tuned(tmp_path / "t.json", {"s": PolicySpec(kind="static", k=3)}, ds, {}, best="s")
    out = tmp_path / "export"
    out.mkdir()
    (out / "mine.txt").write_text("not an export")
    # A folder specstop did not write is never replaced, not even with --overwrite.
    for extra in ([], ["--overwrite"]):
        one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(out), *extra]),
                       "not a specstop export", "only replaces an earlier export")
        assert (out / "mine.txt").read_text() == "not an export"
    (out / "mine.txt").unlink()
    assert main(["export", "--tuned", str(tuned), "--out", str(out)]) == 0
    # An earlier export is replaced only with --overwrite.
    one_line_error(capsys, main(["export", "--tuned", str(tuned), "--out", str(out)]), "already exists", "--overwrite")
    assert main(["export", "--tuned", str(tuned), "--out", str(out), "--overwrite"]) == 0
    assert (out / "config.json").is_file()
    # A failing export leaves the previous one untouched.
    from specstop.export import export as export_mod

    def broken(*a, **kw):
        raise ExportError("check failed")

    monkeypatch.setattr(export_mod.StoppingPolicy, "from_pretrained", broken)
    before = (out / "config.json").read_text()
    with pytest.raises(ExportError):
        export_from_files(out, tuned=tuned, overwrite=True)
    assert (out / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []


# ------------------------------------------------------------------------------ memory guard
def test_pair_that_does_not_fit_is_refused_before_loading(tiny_pair_dir, capsys, monkeypatch):
    from specstop import memory

    monkeypatch.setattr(memory, "POLL_SECONDS", 60.0)  # the up-front estimate, not the monitor, must refuse
    monkeypatch.setenv("SPECSTOP_MEMORY_RESERVE", "100000G")
    line = one_line_error(capsys, main(_info("--pair", str(tiny_pair_dir))), "loading the pair in float32",
                          "draft", "target", "available")
    assert "bfloat16" in line


def test_low_memory_stops_generate_cleanly_and_it_resumes(tiny_pair_dir, tmp_path, capsys, monkeypatch):
    from specstop import memory
    from specstop.data_gen import storage

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(4)))
    argv = ["generate", "--pair", str(tiny_pair_dir), "--prompts", str(prompts), "--split-scheme", "all:train",
            "--max-new-tokens", "4", "--prompts-per-shard", "1", "--batch-size", "1", "--out", str(tmp_path / "ds"),
            "--device", "cpu", "--dtype", "float32", "--no-progress"]
    real = memory.memory_status
    calls = {"n": 0}

    def shrinking():
        status = real()
        calls["n"] += 1
        if calls["n"] > 4:  # 1 check before loading the pair, 1 per batch: memory runs out at the fourth shard
            return memory.MemoryStatus(available=10 << 20, total=status.total, rss=status.rss)
        return status

    monkeypatch.setattr(memory, "memory_status", shrinking)
    monkeypatch.setattr(memory, "POLL_SECONDS", 60.0)  # only the cooperative checks, deterministically
    line = one_line_error(capsys, main(argv), "stopped in specstop generate before the machine runs out of memory",
                          "Finished work is kept", "--batch-size")
    assert "RSS" in line
    kept = [p.name for p in storage.complete_shards(tmp_path / "ds", strict=False)]
    assert kept and len(kept) < 4
    monkeypatch.setattr(memory, "memory_status", real)
    assert main(argv) == 0
    assert sorted(storage.load_table(tmp_path / "ds", "sequences")["prompt_id"]) == [f"q{i}" for i in range(4)]


def test_monitor_thread_interrupts_a_busy_main_thread(monkeypatch):
    from specstop import memory

    monkeypatch.setattr(memory, "POLL_SECONDS", 0.05)
    low = memory.MemoryStatus(available=1 << 20, total=8 << 30, rss=7 << 30)
    monkeypatch.setattr(memory, "memory_status", lambda: low)
    with pytest.raises(ResourceLimitError, match=r"stopped in stage 'x' > inner before the machine runs out of memory"):
        with memory.guarded_stage("stage 'x'"), memory.guarded_stage("inner"):
            deadline = time.time() + 10
            while time.time() < deadline:  # a Python loop that never checks memory itself
                sum(range(1000))
    assert memory.current_stage() == "specstop"


def test_an_interrupt_a_library_turned_into_another_error_still_reports_memory(monkeypatch):
    """jsonargparse (or any broad except) may convert the guard's interrupt: the stage says why it stopped."""
    from specstop import memory

    monkeypatch.setattr(memory, "POLL_SECONDS", 0.01)
    low = memory.MemoryStatus(available=1 << 20, total=8 << 30, rss=7 << 30)
    monkeypatch.setattr(memory, "memory_status", lambda: low)
    with pytest.raises(ResourceLimitError, match="before the machine runs out of memory") as info:
        with memory.guarded_stage("stage 'y'"):
            try:
                deadline = time.time() + 10
                while time.time() < deadline:
                    sum(range(1000))
            except Exception:  # a library turning whatever lands here into its own error
                raise ValueError("does not validate") from None
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ResourceLimitError):  # lost altogether: the next cooperative check stops
        with memory.guarded_stage("stage 'z'"):
            try:
                deadline = time.time() + 10
                while time.time() < deadline:
                    sum(range(1000))
            except Exception:
                pass
            memory.raise_if_tripped()


def test_target_init_beyond_the_vocabulary_and_its_counters(tiny_pair_dir, capsys):
    """--target-init T above the vocabulary size is one line (it cannot draw T distinct tokens), and
    target-initialized counters never read more discarded than drafted: the target's own first-level
    tokens are neither drafted nor discarded."""
    from specstop.decode.tree_decoder import TreeDecoder
    from specstop.tree_policy import parse_tree_policy

    pair = tiny_pair(seed=3)
    vocab = pair.vocab_size
    with pytest.raises(UserError, match=f"the vocabulary has {vocab}: give T <= {vocab}"):
        TreeDecoder(pair, parse_tree_policy("mcsd:2,1"), target_init=vocab + 1)
    one_line_error(capsys, main(["decode", "--pair", str(tiny_pair_dir), "--device", "cpu", "--prompt", "hi",
                                 "--max-new-tokens", "4", "--policy", "mcsd:2,1", "--target-init", str(vocab + 5)]),
                   "target-initialized generation (--target-init T) draws T distinct target tokens",
                   f"give T <= {vocab}")
    for t_init in (2, 8):
        res = TreeDecoder(pair, parse_tree_policy("mcsd:2,1"), target_init=t_init).generate([5, 9, 17, 3], 16)
        c = res.counters
        assert 0 <= c["N_discarded"] <= c["N_draft"], c
        # Every drafted node is either emitted (the tokens after each round's first) or discarded.
        assert c["N_draft"] - c["N_discarded"] == sum(res.accepted_per_round), c

