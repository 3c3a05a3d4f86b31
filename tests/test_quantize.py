"""Weight-only int8 / int4 drafts (specstop.pair.quantize), checked against brute-force references.

The quantized layers must multiply by exactly the weight the quantization rule gives (recomputed here
element by element), stay close to the float weight, and a quantized draft must leave decoding
lossless: the chain decoder's greedy output stays the target's own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specstop.errors import UserError
from specstop.pair.quantize import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    check_scheme,
    quantize_weights,
)
from specstop.testing import tiny_pair, tiny_pair_models


def _linear(out_features=48, in_features=64, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
    return lin


def _int8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: scale = max |w| / 127, q = round(w / scale) in -127..127. Returns (q, scale per row)."""
    q = torch.empty(w.shape, dtype=torch.int64)
    scales = torch.empty(w.shape[0], dtype=torch.float64)
    for i in range(w.shape[0]):
        scales[i] = float(w[i].float().abs().max()) / 127.0
        for j in range(w.shape[1]):
            q[i, j] = max(-127, min(127, round(float(w[i, j]) / float(scales[i]))))
    return q, scales


def _int4_reference(w: torch.Tensor, group: int) -> torch.Tensor:
    """Per row and group of inputs: scale = (max - min) / 15, q = round((w - min) / scale) in 0..15."""
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(w.shape[0]):
        for g in range(0, w.shape[1], group):
            block = w[i, g:g + group].float()
            lo, hi = float(block.min()), float(block.max())
            scale = (hi - lo) / 15.0
            for j in range(group):
                q = max(0, min(15, round((float(block[j]) - lo) / scale)))
                out[i, g + j] = q * scale + lo
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_multiplies_by_the_rounded_weight(dtype):
    lin = _linear(dtype=dtype)
    q = Int8WeightOnlyLinear(lin)
    ref_q, ref_scale = _int8_reference(lin.weight.detach())
    diff = (q.qweight.long() - ref_q).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99  # off by one only at .5 boundaries (float32 vs float64 division)
    # Within half a step of the weight, plus the scale's own rounding to the layer's dtype (bf16: up to half a step more).
    bound = ref_scale.float()[:, None] * (0.5 if dtype == torch.float32 else 1.0) * 1.001 + 1e-6
    assert ((q.dequantized() - lin.weight.float()).abs() <= bound).all()
    x = torch.randn(5, 3, 64, dtype=dtype)
    y = q(x)
    assert y.shape == (5, 3, 48) and y.dtype == dtype
    expected = x.float() @ q.dequantized().t() + lin.bias.float()
    assert torch.allclose(y.float(), expected, rtol=2e-2, atol=3e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_layer_multiplies_by_the_grouped_rounded_weight(group):
    lin = _linear(bias=False)
    q = Int4WeightOnlyLinear(lin, group_size=group)
    ref_w = _int4_reference(lin.weight.detach(), group)
    assert torch.allclose(q.dequantized(), ref_w, atol=1e-4)
    x = torch.randn(7, 64)
    expected = x @ ref_w.t()
    assert torch.allclose(q(x), expected, rtol=1e-3, atol=1e-3)
    one = q(x[:1])  # the one-row decode step takes the same kernel path
    assert torch.allclose(one, expected[:1], rtol=1e-3, atol=1e-3)
    # Error within half a step of every group.
    w = lin.weight.float().reshape(48, -1, group)
    half_step = ((w.amax(-1) - w.amin(-1)) / 30.0)[..., None]
    assert ((q.dequantized().reshape(48, -1, group) - w).abs() <= half_step + 1e-5).all()


def test_int4_needs_a_dividing_group():
    with pytest.raises(ValueError, match="multiple of the int4 group size"):
        Int4WeightOnlyLinear(_linear(in_features=48), group_size=32)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_weights_replaces_every_linear_and_keeps_the_model_close(scheme):
    draft, _, tok = tiny_pair_models(seed=3, hidden_size=64, num_heads=2, num_kv_heads=1)
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():
        before = draft(ids).logits
    embed = draft.get_input_embeddings().weight.detach().clone()
    import copy

    float_copy = copy.deepcopy(draft)
    float_copy.config.tie_word_embeddings = False
    record = quantize_weights(draft, scheme)
    assert record["layers"] == 1 + 7 * 2 and record["kept"] == 0  # head + (q, k, v, o, gate, up, down) x 2 layers
    assert not any(type(m) is nn.Linear for m in draft.modules())
    assert record["bytes_after"] < record["bytes_before"] / (1.9 if scheme == "int8" else 3.0)
    assert draft.specstop_draft_quant == record and draft.config.tie_word_embeddings is False
    assert torch.equal(draft.get_input_embeddings().weight, embed)  # embeddings stay float
    with torch.no_grad():
        after = draft(ids).logits
    # Brute force: the float model with every linear weight replaced by the weight its quantized layer
    # multiplies by gives the same logits.
    import copy

    reference = copy.deepcopy(float_copy)
    with torch.no_grad():
        for name, mod in reference.named_modules():
            if type(mod) is nn.Linear:
                mod.weight = nn.Parameter(draft.get_submodule(name).dequantized().to(mod.weight.dtype))
        expected = reference(ids).logits
    assert torch.allclose(after, expected, rtol=1e-3, atol=1e-3)
    rel = float((after - before).norm() / before.norm())
    assert rel < (0.08 if scheme == "int8" else 0.8)  # random weights of init range 0.3: coarser than a trained model's


def test_int4_keeps_layers_no_group_divides():
    lin_model = nn.Sequential(nn.Linear(40, 8), nn.Linear(8, 64))
    record = quantize_weights(lin_model, "int4")
    assert record["kept"] == 1 and record["layers"] == 1 and record["group_sizes"] == [8 * 4] or record["kept"] == 2


def test_scheme_names_and_errors():
    assert check_scheme(None) is None and check_scheme("none") is None and check_scheme(" INT4 ") == "int4"
    with pytest.raises(UserError, match="unknown draft quantization 'int3'; choose one of: none, int8, int4"):
        check_scheme("int3")
    with pytest.raises(UserError, match="needs a scheme"):
        quantize_weights(nn.Linear(4, 4), "none")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_draft_keeps_greedy_decoding_lossless(scheme):
    from specstop.decode.chain import SpeculativeDecoder

    pair = tiny_pair(seed=5, hidden_size=64, num_heads=2, num_kv_heads=1)
    quantize_weights(pair.draft, scheme)
    padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
    for prompt in ([5, 9, 13, 2, 40], [7, 7, 31]):
        with torch.no_grad():
            reference = pair.target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                             suppress_tokens=padded)[0, len(prompt):].tolist()
        res = SpeculativeDecoder(pair, "confidence:0.3").generate(prompt, 24)
        assert res.token_ids == reference
        assert sum(res.accepted_per_round) > 0  # the quantized draft still proposes what the target accepts


def test_a_quantized_draft_is_a_pair_option_recorded_in_its_identity(tiny_pair_dir, tmp_path):
    """load_pair(draft_quant=...) quantizes the draft and records the scheme in its identity: the float and the
    quantized draft are otherwise the same model (files, sizes, fingerprint), so only ``quant`` tells data,
    checkpoints and exports of one from the other, and both checks refuse to mix them (older records without
    the field are not compared)."""
    from specstop.export.reading import identity_matches
    from specstop.pair.identity import pair_difference
    from specstop.pair.loader import load_pair

    d, t = str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target")
    plain = load_pair(d, t, dtype="float32", device="cpu")
    quant = load_pair(d, t, dtype="float32", device="cpu", draft_quant="int8")
    assert plain.draft_identity.quant is None and quant.draft_identity.quant == "int8"
    assert quant.draft.specstop_draft_quant["scheme"] == "int8" and plain.target_identity.quant is None
    a, b = plain.to_dict(), quant.to_dict()
    assert a["draft"]["weights_sha256"] == b["draft"]["weights_sha256"]  # same files: the fingerprint cannot tell
    assert pair_difference(a, b) == "draft quantization 'none (as loaded)' vs 'int8'"
    older = {**a, "draft": {k: v for k, v in a["draft"].items() if k != "quant"}}
    assert pair_difference(older, b) is None
    ok, why = identity_matches(quant.draft_identity, {"draft": a["draft"]})
    assert not ok and "quantization 'int8' (yours) vs 'none (as loaded)' (export)" in why
    assert identity_matches(quant.draft_identity, {"draft": b["draft"]}) == (True, "")
    with pytest.raises(UserError, match="choose one of"):
        load_pair(d, t, dtype="float32", device="cpu", draft_quant="int3")


def test_generate_with_a_quantized_draft_records_it(tiny_pair_dir, tmp_path):
    """`specstop generate --draft-quant int8` labels with the quantized draft and says so in the manifest."""
    import json

    from specstop.cli import main
    from specstop.data_gen import storage

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "question": f"question number {i}?"}) + "\n" for i in range(4)))
    out = tmp_path / "ds"
    assert main(["generate", "--pair", str(tiny_pair_dir), "--prompts", str(prompts), "--prompt-field", "question",
                 "--split-scheme", "random", "--max-new-tokens", "8", "--out", str(out), "--device", "cpu",
                 "--dtype", "float32", "--draft-quant", "int8", "--no-progress"]) == 0
    assert storage.read_manifest(out)["pair"]["draft"]["quant"] == "int8"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_blocks_of_many_rows_run_on_the_float_copy(scheme):
    """With ``prefill_rows``, a block of at least that many rows (a prefill) multiplies by the float weight and
    a shorter one (a decode step) by the packed one; the float copies are counted apart from the packed bytes."""
    lin = _linear(out_features=48, in_features=128, dtype=torch.bfloat16, seed=3)
    packed = Int8WeightOnlyLinear(lin) if scheme == "int8" else Int4WeightOnlyLinear(lin, 32)
    hybrid = Int8WeightOnlyLinear(lin, prefill_rows=4) if scheme == "int8" else Int4WeightOnlyLinear(lin, 32, 4)
    few, many = torch.randn(1, 3, 128, dtype=torch.bfloat16), torch.randn(1, 4, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(hybrid(few), packed(few), rtol=0, atol=0)
    expected = torch.nn.functional.linear(many.reshape(4, 128), lin.weight) + lin.bias
    torch.testing.assert_close(hybrid(many).reshape(4, 48), expected, rtol=1e-2, atol=1e-2)
    assert not torch.equal(hybrid(many), packed(many))
    model = nn.Sequential(_linear(64, 128, dtype=torch.bfloat16), nn.ReLU(), _linear(16, 64, dtype=torch.bfloat16))
    plain = quantize_weights(copy.deepcopy(model), scheme)
    record = quantize_weights(model, scheme, prefill_rows=16)
    assert record["bytes_after"] == plain["bytes_after"] and record["prefill_rows"] == 16 and record["kept"] == 0
    assert record["prefill_copy_bytes"] == (64 * 128 + 16 * 64) * 2 and plain["prefill_copy_bytes"] == 0


def test_data_generation_scores_response_rows_with_the_packed_kernels(tiny_pair_dir):
    """A draft loaded for data generation (``draft_prefill_copy=False``) runs every row of a teacher-forced
    block on the packed kernels, so its labels are what its one-token decode steps compute; the decoder's
    load (a float copy for blocks of PREFILL_ROWS rows and more) would score the block with the float weights."""
    from transformers import DynamicCache

    from specstop.pair.loader import load_pair
    from specstop.pair.quantize import PREFILL_ROWS

    d, t = str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target")
    seq = [5, 9, 13, 2, 40, *range(60, 80)]
    assert len(seq) >= PREFILL_ROWS["int8"]

    def steps(model):  # one token per forward: the packed kernels whatever the load
        cache, rows = DynamicCache(config=model.config), []
        with torch.no_grad():
            for tok in seq:
                rows.append(model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1])
        return torch.stack(rows)

    for float_copy, close in ((False, True), (True, False)):
        pair = load_pair(d, t, dtype="float32", device="cpu", draft_quant="int8", draft_prefill_copy=float_copy)
        layers = [m for m in pair.draft.modules() if hasattr(m, "prefill_rows") and m is not pair.draft]
        assert layers and all((m.prefill_rows is None) != float_copy for m in layers)
        with torch.no_grad():
            block = pair.draft(input_ids=torch.tensor([seq])).logits[0]
        diff = float((block - steps(pair.draft)).abs().max())
        assert (diff < 1e-4) == close, (float_copy, diff)
