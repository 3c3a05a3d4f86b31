"""Pair loading: tokenizer checks, padded logits, identities and how --pair resolves."""

from __future__ import annotations

import json

import pytest
import torch

from specstop.pair import TokenizerMismatchError, check_same_tokenizer, load_pair, resolve_pair
from specstop.pair.registry import KNOWN_PAIRS, load_named_pair
from specstop.probs import DecodingConfig, logits_to_probs
from specstop.testing import tiny_pair, tiny_tokenizer

REF = "qwen2.5-coder-0.5b-1.5b"


# ---- tokenizer check -------------------------------------------------------------------------


def test_different_vocab_names_both_models_and_first_differing_token():
    a, b = tiny_tokenizer(extra_tokens=["<alpha>"]), tiny_tokenizer(extra_tokens=["<beta>"])
    with pytest.raises(TokenizerMismatchError) as err:
        check_same_tokenizer(a, b, "org/draft-x", "org/target-y")
    msg = str(err.value)
    assert "org/draft-x" in msg and "org/target-y" in msg
    assert "'<alpha>'" in msg and "'<beta>'" in msg and f"token id {len(a) - 1}" in msg


def test_extra_token_in_one_tokenizer_is_a_mismatch():
    with pytest.raises(TokenizerMismatchError, match="None"):
        check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer(extra_tokens=["<x>"]), "d", "t")


def test_different_special_tokens_are_a_mismatch():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    b.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatchError, match="eos_token"):
        check_same_tokenizer(a, b, "d", "t")


def test_same_tokenizer_passes():
    check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer(), "d", "t")


def test_load_pair_rejects_mismatched_folders(tiny_pair_dir, tmp_path):
    other = tmp_path / "other"
    tiny_tokenizer(extra_tokens=["<zzz>"]).save_pretrained(other)
    # Copy the draft model but give it a different tokenizer.
    for f in (tiny_pair_dir / "draft").iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            (other / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TokenizerMismatchError, match="<zzz>"):
        load_pair(str(other), str(tiny_pair_dir / "target"), dtype="float32", device="cpu")


# ---- padded logits ---------------------------------------------------------------------------


def test_padded_logits_are_sliced_to_the_shared_vocab():
    pair = tiny_pair()
    v = len(pair.tokenizer)
    assert pair.vocab_size == v
    assert pair.draft_identity.logits_size > v and pair.target_identity.logits_size > v
    ids = torch.tensor([pair.tokenizer("def f(x):")["input_ids"]])
    logits = pair.target(ids).logits
    assert logits.shape[-1] == pair.target_identity.logits_size
    for decoding in (DecodingConfig(), DecodingConfig(temperature=0.7, top_k=20, top_p=0.9)):
        probs = logits_to_probs(logits, decoding, vocab_size=v)
        assert probs.shape[-1] == v and probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    vh = pair.vocab_handling()
    assert vh["shared_vocab_size"] == v and vh["target_logits_size"] == v + 16


# ---- identities ------------------------------------------------------------------------------


def test_identity_fields():
    pair = tiny_pair()
    for ident, model in ((pair.draft_identity, pair.draft), (pair.target_identity, pair.target)):
        assert ident.architecture == "Qwen2ForCausalLM"
        assert ident.num_parameters == sum(p.numel() for p in model.parameters())
        assert ident.dtype == "float32" and ident.hidden_size == 32 and ident.num_hidden_layers == 2
        assert ident.source_sha256 is None
    d = pair.to_dict()
    assert set(d) == {"name", "draft", "target", "tokenizer_hash", "vocab", "dtype"}
    json.dumps(d)  # manifests need it serialisable


def test_identity_reads_source_hash_from_converted_folder(tiny_pair_dir):
    (tiny_pair_dir / "target" / "specstop_source.json").write_text(json.dumps({"sha256": "ab" * 32}))
    try:
        pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
        assert pair.target_identity.source_sha256 == "ab" * 32
        assert pair.draft_identity.source_sha256 is None
        assert pair.name == "tiny" and pair.target_identity.name_or_path == str(tiny_pair_dir / "target")
    finally:
        (tiny_pair_dir / "target" / "specstop_source.json").unlink()


# ---- resolve_pair ----------------------------------------------------------------------------


def test_resolve_explicit_draft_and_target(tiny_pair_dir):
    r = resolve_pair(draft=str(tiny_pair_dir / "draft"), target=str(tiny_pair_dir / "target"))
    assert r.local and r.name == "draft+target"
    with pytest.raises(ValueError, match="both --draft and --target"):
        resolve_pair(draft="x")


def test_resolve_pair_folder(tiny_pair_dir, tmp_path):
    r = resolve_pair(str(tiny_pair_dir))
    assert (r.draft, r.target, r.name, r.local) == (str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), "tiny", True)
    with pytest.raises(ValueError, match="draft/ and target/"):
        resolve_pair(str(tmp_path))


def test_resolve_known_name(tmp_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("SPECSTOP_OFFLINE", raising=False)
    r = resolve_pair(REF)  # not converted: the hub ids
    assert (r.draft, r.target, r.local) == (KNOWN_PAIRS[REF].draft.hub_id, KNOWN_PAIRS[REF].target.hub_id, False)
    monkeypatch.setenv("SPECSTOP_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="fetch-pair"):
        resolve_pair(REF)
    for role in ("draft", "target"):  # converted: the cache folders
        (tmp_cache / "pairs" / REF / role).mkdir(parents=True)
        (tmp_cache / "pairs" / REF / role / "config.json").write_text("{}")
    r = resolve_pair(REF)
    assert r.local and r.draft == str(tmp_cache / "pairs" / REF / "draft")


def test_resolve_unknown_and_missing():
    with pytest.raises(ValueError, match="unknown pair"):
        resolve_pair("no-such-pair")
    with pytest.raises(ValueError, match="no model pair given"):
        resolve_pair(None)


def test_load_named_pair_from_saved_folder(tiny_pair_dir):
    pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
    assert pair.vocab_size == len(pair.tokenizer) and pair.tokenizer.padding_side == "left"
    assert not pair.draft.training and not any(p.requires_grad for p in pair.target.parameters())


# ---- GGUF tokenizer clean-up -----------------------------------------------------------------


def test_gguf_pad_placeholders_are_trimmed(tmp_path):
    from transformers import AutoTokenizer

    from specstop.pair.convert import trim_gguf_padding_tokens

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    data = json.loads(path.read_text())
    n = len(tok)
    # Like a GGUF tokenizer: one placeholder per padded embedding row after the real tokens.
    for i in range(n, n + 5):
        data["model"]["vocab"][f"[PAD{i}]"] = i
    path.write_text(json.dumps(data))
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == n + 5
    assert trim_gguf_padding_tokens(tmp_path) == 5
    trimmed = AutoTokenizer.from_pretrained(tmp_path)
    assert len(trimmed) == n and trimmed("a b")["input_ids"] == tok("a b")["input_ids"]
    assert trim_gguf_padding_tokens(tmp_path) == 0  # idempotent


def test_pad_lookalike_inside_the_vocab_is_kept(tmp_path):
    from specstop.pair.convert import trim_gguf_padding_tokens

    tiny_tokenizer().save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    data = json.loads(path.read_text())
    data["model"]["vocab"]["[PAD3]"] = data["model"]["vocab"].pop(next(t for t, i in data["model"]["vocab"].items() if i == 3))
    path.write_text(json.dumps(data))
    assert trim_gguf_padding_tokens(tmp_path) == 0
