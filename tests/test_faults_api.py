"""Fault injection, the Python API and numbers out of range: every public decoder refuses a
malformed prompt, an id outside the vocabulary or a request beyond the context window in one
UserError (never a raw torch error, never decoding past the window); the chain and batched decoders
read policies through one parser; the CLI refuses huge seeds, bad temperatures and the like in one
line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specstop.decode import BatchedSpeculativeDecoder, PearlDecoder, PearlSpec, TreeDecoder, parse_tree_policy
from specstop.decode.chain import SpeculativeDecoder
from specstop.errors import UserError
from specstop.export.runtime import StoppingPolicy


def _decoders(pair):
    """``{name: generate(prompt_ids, max_new_tokens)}`` for the four public decoders."""
    pearl = PearlDecoder(pair, PearlSpec(gamma=2), backend="threads")
    return {
        "chain": SpeculativeDecoder(pair, StoppingPolicy.from_string("static:3")).generate,
        "tree": TreeDecoder(pair, parse_tree_policy("mcsd:2,1")).generate,
        "pearl": pearl.generate,
        "batched": lambda ids, n, **kw: BatchedSpeculativeDecoder(pair, "static:3").generate([ids], n, **kw),
    }, pearl


@pytest.fixture(scope="module")
def decoders(pair):
    gens, pearl = _decoders(pair)
    yield gens
    pearl.close()


BAD_PROMPTS = {
    "out-of-vocabulary": (lambda v: [1, 2, v + 5], "= {v5} is not a token id of this pair: ids run from 0 to {last}"),
    "negative": (lambda v: [1, -3], "= -3 is not a token id of this pair"),
    "float-tensor": (lambda v: torch.tensor([1.0, 2.0]), "must hold integer token ids, got dtype torch.float32"),
    "batch-of-one": (lambda v: torch.tensor([[1, 2, 3]]), "got shape [1, 3]: pass ids[0]"),
    "float-ids": (lambda v: [1, 2.5], "= 2.5 is not an integer token id"),
    "text": (lambda v: "hello", "is text, not token ids"),
    "empty": (lambda v: [], "is empty"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
@pytest.mark.parametrize("name", ["chain", "tree", "pearl", "batched"])
def test_decoders_refuse_malformed_prompts_in_one_line(pair, decoders, name, case):
    make, fragment = BAD_PROMPTS[case]
    vocab = pair.vocab_size
    with pytest.raises(UserError) as err:
        decoders[name](make(vocab), 4)
    assert fragment.format(v5=vocab + 5, last=vocab - 1) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["chain", "tree", "pearl", "batched"])
def test_decoders_refuse_a_request_beyond_the_context_window(pair, decoders, name):
    window = pair.target.config.max_position_embeddings
    with pytest.raises(UserError, match=rf"needs {window + 8} positions but the models' context window is {window}"):
        decoders[name]([1] * (window - 8), 16)


@pytest.mark.parametrize("name", ["chain", "tree", "pearl", "batched"])
@pytest.mark.parametrize("bad", [0, -1, 2.5, "8"])
def test_decoders_refuse_bad_max_new_tokens(decoders, name, bad):
    with pytest.raises(UserError, match="max_new_tokens must be an integer >= 1"):
        decoders[name]([1, 2, 3], bad)


@pytest.mark.parametrize("name", ["chain", "tree", "batched"])
def test_decoders_refuse_a_seed_torch_cannot_take(decoders, name):
    with pytest.raises(UserError, match=r"seed must be an integer from 0 to 2\*\*63 - 1, got 18446744073709551616"):
        decoders[name]([1, 2, 3], 4, seed=2**64)


def test_integer_tensors_and_arrays_are_prompts_too(pair):
    dec = SpeculativeDecoder(pair, "static:3")
    ref = dec.generate([5, 6, 7], 6).token_ids
    assert dec.generate(torch.tensor([5, 6, 7]), 6).token_ids == ref
    assert dec.generate(np.array([5, 6, 7], dtype=np.int32), 6).token_ids == ref


def test_chain_and_batched_decoders_parse_policies_alike(pair):
    chain = SpeculativeDecoder(pair, "confidence:0.5")
    batched = BatchedSpeculativeDecoder(pair, "confidence:0.5")
    assert chain.policy.spec == batched.policy.spec
    assert chain.generate([5, 6, 7], 8).token_ids == batched.generate([[5, 6, 7]], 8).row(0).token_ids
    for cls in (SpeculativeDecoder, BatchedSpeculativeDecoder):
        with pytest.raises(UserError, match="unknown policy 'stattic:4'"):
            cls(pair, "stattic:4")
        with pytest.raises(UserError, match="policy must be a StoppingPolicy, a policy string"):
            cls(pair, 4)


def test_chain_decoder_loads_an_export_folder_like_the_batched_one(pair, exports):
    chain = SpeculativeDecoder(pair, str(exports["disco"]))
    batched = BatchedSpeculativeDecoder(pair, exports["disco"])
    assert chain.policy.spec == batched.policy.spec
    assert chain.generate([5, 6, 7], 8).token_ids == batched.generate([[5, 6, 7]], 8).row(0).token_ids


# ------------------------------------------------------------------------------ numbers and strings out of range
def _one_line(capsys, argv, *fragments):
    from test_faults_inputs import one_line_error

    from specstop.cli import main

    return one_line_error(capsys, main(argv), *fragments)


NO_PAIR = ["--pair", "/nonexistent/pair"]  # every refusal below comes before a model would load


@pytest.mark.parametrize("argv, fragment", [
    (["decode", *NO_PAIR, "--prompt", "hi", "--temperature", "1e308"], "--temperature must be 0 (greedy) or from 0.0001 to 10000, got 1e+308"),
    (["decode", *NO_PAIR, "--prompt", "hi", "--temperature", "1e-30"], "--temperature must be 0 (greedy) or from 0.0001"),
    (["decode", *NO_PAIR, "--prompt", "hi", "--seed", str(2**64)], "--seed must be an integer from 0 to 2**63 - 1, got 18446744073709551616"),
    (["decode", *NO_PAIR, "--prompt", "hi", "--seed", "-1"], "--seed must be an integer from 0 to 2**63 - 1, got -1"),
    (["generate", *NO_PAIR, "--prompts", "p.jsonl", "--generation.seed", str(2**63), "--data", "ds"],
     "--generation.seed must be an integer from 0 to 2**63 - 1"),
    (["generate", *NO_PAIR, "--prompts", "p.jsonl", "--prompts.seed", str(2**64), "--data", "ds"],
     "--prompts.seed must be an integer from 0 to 2**63 - 1"),
    (["generate", *NO_PAIR, "--prompts", "p.jsonl", "--generation.temperature", "1e300", "--data", "ds"],
     "--generation.temperature must be 0 (greedy) or from 0.0001 to 10000"),
    (["calibrate-cost", *NO_PAIR, "--context-tokens", "0"], "--context-tokens must be >= 1 (and finite), got 0"),
    (["calibrate-cost", *NO_PAIR, "--context-tokens", "-5"], "--context-tokens must be >= 1 (and finite), got -5"),
], ids=["temperature-huge", "temperature-tiny", "seed-2**64", "seed-negative", "generate-seed", "prompts-seed",
        "generate-temperature", "context-0", "context-negative"])
def test_numbers_out_of_range_are_one_line(argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _one_line(capsys, argv, fragment)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"temperature": float("nan")}, "temperature must be >= 0 (and finite), got nan"),
    ({"temperature": float("inf")}, "temperature must be >= 0 (and finite), got inf"),
    ({"temperature": 1e308}, "temperature must be 0 (greedy) or from 0.0001 to 10000"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_p": float("nan")}, "top_p must be > 0 and <= 1 (and finite), got nan"),
])
def test_decoding_config_refuses_what_no_decoder_can_use(kwargs, fragment):
    from specstop.probs import DecodingConfig

    with pytest.raises(UserError) as err:
        DecodingConfig(**kwargs)
    assert fragment in str(err.value)


def test_deeply_nested_files_are_one_line(tmp_path, capsys):
    deep_json = tmp_path / "deep.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 5000 + "1" + "]" * 5000 + "\n")
    deep_jsonl = tmp_path / "deep.jsonl"
    deep_jsonl.write_text('{"prompt": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    nested = "nested deeper than"
    _one_line(capsys, ["tune", "--data", str(tmp_path), "--cost-model", str(deep_json), "--out", str(tmp_path / "t.json")],
              f"{deep_json}: JSON {nested}")
    _one_line(capsys, ["export", "--tuned", str(deep_json), "--out", str(tmp_path / "e")], f"{deep_json}: JSON {nested}")
    _one_line(capsys, ["decode", "--config", str(deep_yaml)], f"{deep_yaml}: YAML {nested}")
    from specstop.prompts.jsonfile import read_json_records

    with pytest.raises(UserError, match=f"{deep_jsonl}:2: JSON {nested}"):
        read_json_records(deep_jsonl)


def test_paths_longer_than_the_os_allows_are_one_line(tmp_path, capsys):
    long = tmp_path / ("x" * 300)
    tuned = tmp_path / "t.json"
    tuned.write_text(json.dumps({"schema_version": 1, "policies": {}, "best": None}))
    _one_line(capsys, ["export", "--tuned", str(tuned), "--out", str(long / "e")], "path too long:", "255 bytes per name",
              "give a shorter path")
    _one_line(capsys, ["info", "--pair", str(long)], "path too long:", "give a shorter path")
    _one_line(capsys, ["decode", "--config", str(long)], "path too long:")


def test_non_utf8_stdin_prompt_is_one_line(monkeypatch, capsys):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f(x):\xff\xfe return x\n"), encoding="utf-8"))
    _one_line(capsys, ["decode", *NO_PAIR, "--prompt", "-"], "--prompt -: stdin is not UTF-8 text", "at byte 9")
