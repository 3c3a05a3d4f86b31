"""data_gen end to end on the tiny pair: shards, resume after a crash, workers + merge, manifest,
read-back, config handling, bad input and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _data_gen_helpers import Rec, make_render, records

from specstop.data_gen import runner as runner_mod
from specstop.data_gen import storage
from specstop.data_gen.config import DataGenConfig, config_from_dict, load_config
from specstop.data_gen.readback import load_split_tensors
from specstop.data_gen.responses import prepare_prompts
from specstop.data_gen.runner import generate_dataset, plan_shards, write_manifest
from specstop.data_gen.schema import TABLES

REPO = Path(__file__).resolve().parents[1]


def _cfg(**over) -> DataGenConfig:
    cfg = DataGenConfig(prompts_per_shard=2)
    cfg.generation.max_new_tokens = 12
    cfg.generation.batch_size = 2
    cfg.labels.hidden_states = True
    cfg.labels.rollouts.length = 5
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _dump(out) -> dict:
    """Every table as plain Python rows (sorted by the row order on disk)."""
    return {t: storage.load_table(out, t).to_list() for t in TABLES}


@pytest.fixture(scope="module")
def reference(pair, tmp_path_factory):
    """An uninterrupted run over 7 prompts (shards of 2: train 3, validation 2, test 2)."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    res = generate_dataset(pair, records(7), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    assert res["manifest"] is not None
    return out


def test_manifest_and_tables(reference, pair):
    man = storage.read_manifest(reference)
    assert set(man) == {"schema_version", "specstop_version", "created", "pair", "prompts", "generation", "labels",
                        "splits", "bytes_per_token", "shards", "shard_digests"}
    assert man["shards"] == ["train-00000", "train-00001", "validation-00000", "test-00000"]
    assert man["pair"] == json.loads(json.dumps(pair.to_dict()))
    assert set(man["prompts"]) == {"source", "field", "template", "chat_template", "seed", "split_sizes", "counts"}
    assert set(man["generation"]) == {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "batch_size",
                                      "max_prompt_tokens", "prompt_overflow", "eos_token_id"}
    assert man["generation"]["eos_token_id"] == pair.tokenizer.eos_token_id
    lab = man["labels"]
    assert lab["topk_k"] == 10 and lab["hidden_states"] and lab["hidden_size"] == 32 and lab["hidden_layer"] == -1
    assert lab["mixing"]["splits"] == ["train"] and lab["rollouts"]["splits"] == ["test", "validation"]
    assert man["prompts"]["counts"] == {"train": 3, "validation": 2, "test": 2}
    seqs = storage.load_table(reference, "sequences")
    toks = storage.load_table(reference, "tokens")
    assert sorted(seqs["prompt_id"]) == sorted(f"p{i}" for i in range(7))  # none dropped or duplicated
    assert len(toks) == sum(seqs["num_tokens"])
    for split, counts in man["splits"].items():
        assert counts["tokens"] == len(storage.load_table(reference, "tokens", split))
        assert counts["prompts"] == len(storage.load_table(reference, "sequences", split))
    assert man["splits"]["train"]["mixed"] > 0 and man["splits"]["train"]["rollouts"] == 0
    assert man["splits"]["test"]["rollouts"] > 0 and man["splits"]["test"]["mixed"] == 0
    bpt = man["bytes_per_token"]
    assert 0 < bpt["without_hidden"] < bpt["with_hidden"]
    assert set(seqs["stop_reason"]) <= {"eos", "length"}
    rolls = storage.load_table(reference, "rollouts")
    for r in rolls:
        assert r["length"] == len(r["tokens"]) == len(r["entropy"]) == len(r["topk"]) // 10 == len(r["hidden"]) // 32
        assert r["length"] <= max(0, min(5, 12 - 2 - r["position"]))


def test_load_split_tensors(reference):
    t = load_split_tensors(reference, "train", ["topk", "accept_prob", "greedy_match", "hidden", "position"])
    n = len(storage.load_table(reference, "tokens", "train"))
    assert t["topk"].shape == (n, 10) and t["hidden"].shape == (n, 32)
    assert t["hidden"].dtype.is_floating_point and str(t["hidden"].dtype) == "torch.float16"
    assert str(t["greedy_match"].dtype) == "torch.bool"
    r = load_split_tensors(reference, "test", ["tokens", "length"], table="rollouts")
    assert r["tokens_offsets"][-1] == r["length"].sum() == len(r["tokens"])


def test_killed_run_resumes_to_the_same_dataset(reference, pair, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    real_write = storage.write_shard
    calls = {"n": 0}

    def crash_after_two(*a, **kw):
        if calls["n"] == 2:
            raise RuntimeError("killed")
        calls["n"] += 1
        return real_write(*a, **kw)

    monkeypatch.setattr(runner_mod, "write_shard", crash_after_two)
    with pytest.raises(RuntimeError, match="killed"):
        generate_dataset(pair, records(7), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    assert not (out / storage.MANIFEST).exists()
    done = storage.complete_shards(out)
    assert [p.name for p in done] == ["train-00000", "train-00001"]
    # A crash mid-write leaves a .tmp folder; a corrupt shard fails verification.
    (storage.shards_root(out) / ".tmp-validation-00000-dead").mkdir()
    arrow = next((done[1] / "tokens").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-10])
    monkeypatch.setattr(runner_mod, "write_shard", real_write)
    res = generate_dataset(pair, records(7), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    assert res["skipped"] == ["train-00000"]
    assert "train-00001" in res["done"]
    assert _dump(out) == _dump(reference)
    ref_man, man = storage.read_manifest(reference), storage.read_manifest(out)
    assert man["splits"] == ref_man["splits"]
    # Rerunning a finished dataset regenerates nothing.
    res = generate_dataset(pair, records(7), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    assert res["done"] == []


def test_workers_and_merge_match_single_run(reference, pair, tmp_path):
    out = tmp_path / "ds"
    cfg = _cfg()
    cfg.generation.batch_size = 1  # batching must not change labels
    for i in range(2):
        generate_dataset(pair, records(7), cfg, out, render=make_render(pair.tokenizer), num_shards=2, shard_index=i,
                         progress=False)
    (out / storage.MANIFEST).unlink()
    write_manifest(out, cfg, plan_shards(records(7), cfg.prompts_per_shard))
    dumped, ref = _dump(out), _dump(reference)
    for t in TABLES:
        assert [r["prompt_id"] for r in dumped[t]] == [r["prompt_id"] for r in ref[t]]
    for col in ("token", "draft_token", "verified", "greedy_match"):
        assert [r[col] for r in dumped["tokens"]] == [r[col] for r in ref["tokens"]]
    np.testing.assert_allclose([r["accept_prob"] for r in dumped["tokens"]],
                               [r["accept_prob"] for r in ref["tokens"]], atol=1e-5)


def test_merge_refuses_missing_shards(pair, tmp_path):
    out = tmp_path / "ds"
    cfg = _cfg()
    generate_dataset(pair, records(5), cfg, out, render=make_render(pair.tokenizer), num_shards=2, shard_index=0,
                     progress=False)
    with pytest.raises(ValueError, match="not finished"):
        write_manifest(out, cfg, plan_shards(records(5), cfg.prompts_per_shard))


def test_changed_settings_are_refused(reference, pair, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    cfg = _cfg()
    cfg.generation.max_new_tokens = 13
    with pytest.raises(ValueError, match="other label settings"):
        generate_dataset(pair, records(7), cfg, out, render=make_render(pair.tokenizer), progress=False)


def test_hidden_off_skips_mixing_and_sampled_gets_rejection_rollouts(pair, tmp_path):
    cfg = _cfg()
    cfg.labels.hidden_states = False
    cfg.generation.temperature = 1.0
    out = tmp_path / "ds"
    generate_dataset(pair, records(3), cfg, out, render=make_render(pair.tokenizer), progress=False)
    man = storage.read_manifest(out)
    assert man["labels"]["mixing"]["splits"] == []
    assert man["labels"]["hidden_size"] is None
    assert "hidden" not in storage.load_table(out, "tokens").column_names
    assert all(v["mixed"] == 0 for v in man["splits"].values())
    # Sampled eval splits carry rejection rollouts (what sampled replay continues with after a rejection).
    assert set(man["labels"]["rollouts"]["splits"]) == {"validation", "test"}
    tokens = storage.load_table(out, "tokens", "test")
    assert {"target_prob", "draft_prob", "reject_token", "reject_draft_prob"} <= set(tokens.column_names)
    assert man["bytes_per_token"]["with_hidden"] > man["bytes_per_token"]["without_hidden"]


def test_empty_prompt_and_long_prompts(pair, tmp_path):
    render = make_render(pair.tokenizer)
    with pytest.raises(ValueError, match="prompt 'e1' is empty"):
        generate_dataset(pair, [Rec("ok", "hi", "train", 0), Rec("e1", "", "train", 1)], _cfg(), tmp_path / "ds",
                         render=render, progress=False)
    with pytest.raises(ValueError, match="'bad'"):
        prepare_prompts([Rec("ok", "hello", "train", 0), Rec("bad", "  ", "train", 1)], render, None, "truncate")
    long = Rec("long", "x" * 100, "train", 0)
    full = render(long.text)
    got, skipped = prepare_prompts([long, Rec("short", "hi", "train", 1)], render, 40, "truncate")
    assert got[0].truncated and got[0].ids == full[-40:] and not got[1].truncated and skipped == []
    got, skipped = prepare_prompts([long, Rec("short", "hi", "train", 1)], render, 40, "skip")
    assert [g.record.prompt_id for g in got] == ["short"] and skipped == ["long"]


def test_truncated_prompt_in_dataset(pair, tmp_path):
    cfg = _cfg()
    cfg.generation.max_prompt_tokens = 30
    out = tmp_path / "ds"
    recs = [Rec("long", "y" * 80, "train", 0), Rec("short", "hi", "train", 1)]
    generate_dataset(pair, recs, cfg, out, render=make_render(pair.tokenizer), progress=False)
    seqs = storage.load_table(out, "sequences").to_list()
    assert [s["prompt_truncated"] for s in seqs] == [True, False]
    assert len(seqs[0]["prompt_ids"]) == 30


def test_unknown_config_keys(tmp_path):
    with pytest.raises(ValueError, match=r"'generation\.temprature'.*temperature"):
        config_from_dict({"generation": {"temprature": 0.5}})
    with pytest.raises(ValueError, match=r"'outdir'.*valid keys.*out"):
        config_from_dict({"outdir": "x"})
    with pytest.raises(ValueError, match=r"'labels\.mixing\.ratio'"):
        config_from_dict({"labels": {"mixing": {"ratio": 0.2}}})


def test_shipped_configs_load():
    names = sorted(p.name for p in (REPO / "configs" / "data").glob("*.yaml"))
    assert {"mbpp_greedy.yaml", "humaneval_greedy.yaml", "alpaca_greedy.yaml", "cnn_dm_greedy.yaml",
            "alpaca_sampled.yaml", "tiny_smoke.yaml"} <= set(names)
    for n in names:
        cfg = load_config(REPO / "configs" / "data" / n)
        cfg.validate()
    sampled = load_config(REPO / "configs" / "data" / "alpaca_sampled.yaml")
    assert sampled.generation.temperature == 1.0 and sampled.labels.hidden_states


def test_flags_override_yaml(tmp_path):
    from specstop.data_gen import cli

    y = tmp_path / "c.yaml"
    y.write_text("generation:\n  max_new_tokens: 64\n  temperature: 0.5\nlabels:\n  topk_k: 5\nout: a\n")
    cfg, _ = cli.build_config(["--config", str(y), "--max-new-tokens", "32", "--prompts", "f.jsonl", "--prompt-field",
                               "q", "--rollouts-on", "train,test", "--no-hidden-states", "--out", "b"])
    assert cfg.generation.max_new_tokens == 32 and cfg.generation.temperature == 0.5
    assert cfg.labels.topk_k == 5 and cfg.out == "b" and cfg.prompts.template == "field:q"
    assert cfg.labels.rollouts.splits == ["train", "test"] and cfg.labels.hidden_states is False


def test_cli_generate_and_merge(tiny_pair_dir, tmp_path, capsys):
    pytest.importorskip("specstop.prompts.sources")
    from specstop.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "question": f"question number {i}?"}) + "\n" for i in range(6)))
    out = tmp_path / "ds"
    argv = ["generate", "--pair", str(tiny_pair_dir), "--prompts", str(prompts), "--prompt-field", "question",
            "--split-scheme", "random", "--max-new-tokens", "8", "--out", str(out), "--prompts-per-shard", "2",
            "--device", "cpu", "--dtype", "float32", "--no-progress"]
    assert main(argv) == 0
    man = storage.read_manifest(out)
    assert sum(man["prompts"]["counts"].values()) == 6
    (out / storage.MANIFEST).unlink()
    assert main(argv + ["--merge"]) == 0
    assert storage.read_manifest(out)["splits"] == man["splits"]


def test_cli_tokenizer_mismatch(tmp_path, capsys, monkeypatch):
    from specstop.cli import main
    from specstop.data_gen import cli as dg_cli
    from specstop.testing import tiny_causal_lm, tiny_tokenizer

    for name, extra in (("draft", ["<x>"]), ("target", None)):
        tok = tiny_tokenizer(extra)
        tiny_causal_lm(len(tok) + 1, eos_token_id=tok.eos_token_id).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    monkeypatch.setattr(dg_cli, "load_records", lambda cfg: records(2))
    rc = main(["generate", "--draft", str(tmp_path / "draft"), "--target", str(tmp_path / "target"),
               "--out", str(tmp_path / "ds"), "--device", "cpu"])
    assert rc == 2
    assert "do not share a tokenizer" in capsys.readouterr().err


def test_quick_run_grows_into_full_run(reference, pair, tmp_path):
    """Shards of a smaller prompt set are kept when their prompts match and regenerated otherwise."""
    out = tmp_path / "ds"
    generate_dataset(pair, records(4), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    res = generate_dataset(pair, records(7), _cfg(), out, render=make_render(pair.tokenizer), progress=False)
    assert res["skipped"] == ["train-00000"]
    assert _dump(out) == _dump(reference)
