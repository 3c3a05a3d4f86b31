"""The output-head contiguity fix, cuDNN attention on CUDA and the ``dtype: auto`` choice."""

from __future__ import annotations

import pytest
import torch

from specstop.pair import dtype_choice, dtype_timing, fast_paths
from specstop.pair.fast_paths import _dense, contiguous_output_head
from specstop.testing import tiny_causal_lm


def test_output_head_gets_row_major_input_and_same_logits():
    model = tiny_causal_lm(64, seed=3)
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    ref = model(input_ids=ids).logits[:, -1:]
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0]))
    contiguous_output_head(model)
    contiguous_output_head(model)  # idempotent: one hook
    out = model(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(out, ref)
    x = seen[-1]
    assert x.shape[1] == 1 and x.storage_offset() == 0 and _dense(x)


def test_dense_strides():
    h = torch.zeros(1, 2, 8)
    assert _dense(h)
    assert not _dense(h[:, -1:, :].as_strided((1, 1, 8), (16, 8, 1)))


def test_auto_is_float32_without_bf16_units(monkeypatch):
    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx2", "fma"})
    c = dtype_choice.choose_dtype("cpu")
    assert c.dtype == "float32" and "no native bf16" in c.reason


def _figures(f32: float, bf16_linear: float, bf16_mv: float, batch_f32: float = 1.0, batch_bf16: float = 1.0) -> dict:
    """Pair timings as :func:`dtype_timing.time_model` returns them (every forward kind of a variant alike)."""
    def model(verify: bool) -> dict:
        out = {}
        for v, s, b in (("float32", f32, batch_f32), ("bfloat16+linear", bf16_linear, batch_bf16),
                        ("bfloat16+mv", bf16_mv, batch_bf16)):
            out[v] = {"step": s, "batch": b, **({"verify": 2 * s} if verify else {})}
        return out
    figures = {"draft": model(False), "target": model(True)}
    return {**figures, **dtype_timing.decide(figures), "seconds": 1.0}


def test_auto_picks_the_dtype_whose_pair_decodes_fastest(monkeypatch, tmp_cache):
    # Zen 5: a synthetic one-row matmul said bf16 was 0.71x float32, the pair itself decoded 2.5x faster in bf16.
    from specstop.pair import dtype_timing

    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: _figures(0.25, 0.10, 0.12))
    c = dtype_choice.choose_dtype("cpu", pair=("d", "t"))
    assert c.dtype == "bfloat16" and "2.50x faster decoding" in c.reason and "F.linear" in c.reason
    # Cached per CPU / torch / threads / pair: a second call does not time again.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: (_ for _ in ()).throw(AssertionError))
    assert dtype_choice.choose_dtype("cpu", pair=("d", "t")).dtype == "bfloat16"
    # ... but another pair is timed.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: _figures(0.10, 0.25, 0.26))
    c = dtype_choice.choose_dtype("cpu", pair=("d2", "t"))
    assert c.dtype == "float32" and "faster decoding than bfloat16" in c.reason


def test_auto_per_workload_and_single_row_route(monkeypatch, tmp_cache):
    from specstop.pair import dtype_timing, fast_paths

    monkeypatch.setattr(fast_paths, "_CHOICES", {})
    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"amx_bf16"})
    # One-row steps faster in bf16 via torch.mv; batched steps faster in float32.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes",
                        lambda d, t: _figures(0.20, 0.15, 0.10, batch_f32=0.5, batch_bf16=0.8))
    assert dtype_choice.choose_dtype("cpu", pair=("d", "t")).dtype == "bfloat16"
    assert fast_paths.single_row_mv_gain(torch.bfloat16)["use_mv"] is True
    gen = dtype_choice.choose_dtype("cpu", pair=("d", "t"), workload="generate")
    assert gen.dtype == "float32" and "batched generation" in gen.reason


def test_auto_without_a_pair_says_it_did_not_measure(monkeypatch):
    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx512_bf16"})
    c = dtype_choice.choose_dtype("cpu")
    assert c.dtype == "bfloat16" and "not measured" in c.reason


def test_pair_timing_on_a_tiny_model_measures_every_variant(fresh_single_row_choice):
    from specstop.pair import dtype_timing

    model = tiny_causal_lm(64, seed=5)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    got = dtype_timing.time_model(model, verify=True, rounds=1, reps=1)
    assert set(got) == set(dtype_timing.VARIANTS)
    assert all(set(kinds) == {"step", "batch", "verify"} and min(kinds.values()) > 0 for kinds in got.values())
    # Left as it came: float32, stock kernels (bf16 -> float32 rounds the weights, nothing else).
    assert next(model.parameters()).dtype == torch.float32
    assert not any(getattr(m, "_specstop_single_row_mv", False) for m in model.modules())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref[k].to(torch.bfloat16).float())


def test_cuda_without_bf16_units_gets_float16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    c = dtype_choice.choose_dtype("cuda")
    assert c.dtype == "float16" and "7.5" in c.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert dtype_choice.choose_dtype("cuda:0").dtype == "bfloat16"


def test_pair_records_its_dtype_choice(tiny_pair_dir):
    from specstop.pair import load_named_pair

    pair = load_named_pair(str(tiny_pair_dir), dtype="float32", device="cpu")
    rec = pair.to_dict()["dtype"]
    assert rec["dtype"] == "float32" and rec["requested"] == "float32"


@pytest.fixture
def fresh_single_row_choice(monkeypatch, tmp_cache):
    """No per-process or on-disk single-row kernel choice left from another test."""
    from specstop.pair import fast_paths

    monkeypatch.setattr(fast_paths, "_CHOICES", {})
    monkeypatch.delenv(fast_paths.SINGLE_ROW_ENV, raising=False)
    return fast_paths


def test_single_row_matvec_only_for_bf16_cpu_and_same_function(fresh_single_row_choice, monkeypatch):
    from specstop.pair.fast_paths import single_row_matvec

    monkeypatch.setenv(fresh_single_row_choice.SINGLE_ROW_ENV, "mv")  # whichever kernel this CPU prefers
    f32 = tiny_causal_lm(64, seed=5)
    assert single_row_matvec(f32) == 0  # float32 keeps F.linear
    model = tiny_causal_lm(64, seed=5).to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    step = torch.tensor([[7]])
    from transformers import DynamicCache

    from specstop.pair.compat import cache_kwarg

    def run():
        c = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_kwarg(model, c), use_cache=True)
        one = model(input_ids=step, **cache_kwarg(model, c), use_cache=True).logits
        return one, model(input_ids=torch.cat([ids, step], 1)).logits
    ref_one, ref_block = run()
    n = single_row_matvec(model)
    assert n == len([m for m in model.modules() if isinstance(m, torch.nn.Linear)]) and single_row_matvec(model) == 0
    one, block = run()
    torch.testing.assert_close(block, ref_block)  # blocks of 2+ rows keep the GEMM: bit-identical
    torch.testing.assert_close(one.float(), ref_one.float(), atol=0.1, rtol=0.05)  # one row: another kernel


def test_single_row_route_only_where_measured_faster(fresh_single_row_choice, monkeypatch):
    # On an AMD EPYC (Zen 4, avx512_bf16) torch.mv ran at 0.45x the speed of F.linear: keep F.linear.
    fp = fresh_single_row_choice
    monkeypatch.setattr(fp, "measure_single_row", lambda dtype: {"linear_ms": 1.0, "mv_ms": 2.2, "mv_gain": 0.45})
    model = tiny_causal_lm(64, seed=5).to(torch.bfloat16)
    assert fp.single_row_matvec(model) == 0
    assert "F.linear" in fp.single_row_record()["torch.bfloat16"] and "0.45x" in fp.single_row_record()["torch.bfloat16"]
    # Cached on disk per CPU / dtype / torch / threads: a new process does not measure again.
    monkeypatch.setattr(fp, "_CHOICES", {})
    monkeypatch.setattr(fp, "measure_single_row", lambda dtype: (_ for _ in ()).throw(AssertionError))
    assert fp.single_row_mv_gain(torch.bfloat16)["use_mv"] is False
    # Where torch.mv is clearly faster (the AMX Xeon: 0.086 -> 0.062 s per draft step), it is taken.
    monkeypatch.setattr(fp, "_CHOICES", {"torch.bfloat16": {"use_mv": True, "reason": "measured"}})
    assert fp.single_row_matvec(tiny_causal_lm(64, seed=6).to(torch.bfloat16)) > 0


def test_measure_single_row_reports_both_kernels():
    from specstop.pair.fast_paths import measure_single_row

    m = measure_single_row(torch.bfloat16, reps=2)
    assert m["linear_ms"] > 0 and m["mv_ms"] > 0 and m["mv_gain"] == pytest.approx(m["linear_ms"] / m["mv_ms"])


class _OnDevice:
    """A stand-in model whose embedding weight sits on ``device`` (no CUDA needed)."""

    def __init__(self, device: str) -> None:
        self.weight = type("W", (), {"device": torch.device(device)})()

    def get_input_embeddings(self):
        return self


@pytest.mark.parametrize("device, env, turned_off", [("cuda", None, True), ("cpu", None, False), ("cuda", "1", False)])
def test_cudnn_attention_is_turned_off_for_cuda_models(device, env, turned_off, monkeypatch):
    """cuDNN attention builds a plan per new sequence length: off for CUDA pairs, unless kept explicitly."""
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    if env is None:
        monkeypatch.delenv("SPECSTOP_CUDNN_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("SPECSTOP_CUDNN_ATTENTION", env)
    assert fast_paths.avoid_cudnn_attention(_OnDevice(device)) is turned_off
    assert calls == ([False] if turned_off else [])
