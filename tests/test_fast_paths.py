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


def _figures(f32: float, bf16_linear: float, bf16_mv: float, batch_f32: float = 1.0, batch_bf16: float = 1.0,
             bf16_packed: float | None = None) -> dict:
    """Pair timings as :func:`dtype_timing.time_model` returns them (every forward kind of a variant alike;
    routes not given cost as much as the stock kernel)."""
    per = {"float32+linear": (f32, batch_f32), "float32+packed": (f32, batch_f32),
           "bfloat16+linear": (bf16_linear, batch_bf16), "bfloat16+mv": (bf16_mv, batch_bf16),
           "bfloat16+pad2": (bf16_linear, batch_bf16),
           "bfloat16+packed": (bf16_linear if bf16_packed is None else bf16_packed, batch_bf16)}

    def model(verify: bool) -> dict:
        return {v: {"step": s, "batch": b, **({"verify": 2 * s} if verify else {})} for v, (s, b) in per.items()}

    figures = {"draft": model(False), "target": model(True)}
    return {**figures, **dtype_timing.decide(figures), "seconds": 1.0}


def test_auto_picks_the_dtype_whose_pair_decodes_fastest(monkeypatch, tmp_cache):
    # Zen 5: a synthetic one-row matmul said bf16 was 0.71x float32, the pair itself decoded 2.5x faster in bf16.
    from specstop.pair import dtype_timing

    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: _figures(0.25, 0.10, 0.12))
    c = dtype_choice.choose_dtype("cpu", pair=("d", "t"))
    assert c.dtype == "bfloat16" and "2.50x faster decoding" in c.reason and "linear route" in c.reason
    # Cached per CPU / torch / threads / pair: a second call does not time again.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: (_ for _ in ()).throw(AssertionError))
    assert dtype_choice.choose_dtype("cpu", pair=("d", "t")).dtype == "bfloat16"
    # ... but another pair is timed.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes", lambda d, t: _figures(0.10, 0.25, 0.26))
    c = dtype_choice.choose_dtype("cpu", pair=("d2", "t"))
    assert c.dtype == "float32" and "faster decoding than bfloat16" in c.reason


def test_auto_per_workload_and_linear_route(monkeypatch, tmp_cache):
    from specstop.pair import dtype_timing, fast_paths

    monkeypatch.setattr(fast_paths, "_CHOICES", {})
    for env in (fast_paths.ROUTE_ENV, fast_paths.SINGLE_ROW_ENV, "SPECSTOP_CPU_DTYPE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"amx_bf16"})
    # One-row steps faster in bf16 via torch.mv; batched steps faster in float32.
    monkeypatch.setattr(dtype_timing, "measure_pair_dtypes",
                        lambda d, t: _figures(0.20, 0.15, 0.10, batch_f32=0.5, batch_bf16=0.8))
    assert dtype_choice.choose_dtype("cpu", pair=("d", "t")).dtype == "bfloat16"
    choice = fast_paths.route_choice(torch.bfloat16)
    assert choice["route"] == "mv" and "timed on this pair" in choice["reason"]
    gen = dtype_choice.choose_dtype("cpu", pair=("d", "t"), workload="generate")
    assert gen.dtype == "float32" and "batched generation" in gen.reason


def test_auto_takes_packed_weights_where_they_decode_fastest(monkeypatch, tmp_cache):
    """The Zen 5 figures: packed oneDNN weights halve every bf16 step; a tie with the stock kernel keeps it."""
    from specstop.pair import fast_paths

    monkeypatch.setattr(fast_paths, "_CHOICES", {})
    for env in (fast_paths.ROUTE_ENV, fast_paths.SINGLE_ROW_ENV, "SPECSTOP_CPU_DTYPE"):
        monkeypatch.delenv(env, raising=False)
    figures = _figures(0.30, 0.157, 0.16, bf16_packed=0.067)
    assert figures["routes"] == {"float32": "linear", "bfloat16": "packed"}
    assert figures["decode"]["bfloat16"] == pytest.approx(4 * 0.067)
    tie = _figures(0.30, 0.157, 0.16, bf16_packed=0.155)
    assert tie["routes"]["bfloat16"] == "linear"  # within 5%: the stock kernel stays


def test_auto_without_a_pair_says_it_did_not_measure(monkeypatch):
    monkeypatch.delenv("SPECSTOP_CPU_DTYPE", raising=False)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx512_bf16"})
    c = dtype_choice.choose_dtype("cpu")
    assert c.dtype == "bfloat16" and "not measured" in c.reason


def test_pair_timing_on_a_tiny_model_measures_every_variant(fresh_route_choice):
    from specstop.pair import dtype_timing, fast_paths

    model = tiny_causal_lm(64, seed=5)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    got = dtype_timing.time_model(model, verify=True, rounds=1, reps=1)
    assert set(got) == set(dtype_timing.variants()) and {"float32+linear", "bfloat16+linear"} <= set(got)
    assert all(set(kinds) == {"step", "batch", "verify"} and min(kinds.values()) > 0 for kinds in got.values())
    # Left as it came: float32, stock kernels, no packed copies (bf16 -> float32 rounds the weights, nothing else).
    assert next(model.parameters()).dtype == torch.float32
    assert fast_paths.route_of(model) == "linear"
    assert not _route_attrs(model)
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


def _route_attrs(model) -> list[str]:
    """What a linear route leaves on a model's modules (bound forwards, packed weights)."""
    return [k for m in model.modules() for k in m.__dict__
            if k in ("_specstop_linear_route", "_specstop_packed_weight") or (k == "forward" and isinstance(m, torch.nn.Linear))]


@pytest.fixture
def fresh_route_choice(monkeypatch, tmp_cache):
    """No per-process or on-disk linear route choice left from another test."""
    from specstop.pair import fast_paths

    monkeypatch.setattr(fast_paths, "_CHOICES", {})
    monkeypatch.delenv(fast_paths.ROUTE_ENV, raising=False)
    monkeypatch.delenv(fast_paths.SINGLE_ROW_ENV, raising=False)
    return fast_paths


def _step_and_block(model):
    """A one-token step after a prefill, and the same tokens as one block: logits of both."""
    from transformers import DynamicCache

    from specstop.pair.compat import cache_kwarg

    ids, step = torch.tensor([[5, 9, 17, 33, 2]]), torch.tensor([[7]])
    with torch.no_grad():
        c = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_kwarg(model, c), use_cache=True)
        one = model(input_ids=step, **cache_kwarg(model, c), use_cache=True).logits
        return one, model(input_ids=torch.cat([ids, step], 1)).logits


@pytest.mark.parametrize("route", ["mv", "pad2", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_each_route_computes_what_the_stock_kernel_does(route, dtype, fresh_route_choice):
    fp = fresh_route_choice
    model = tiny_causal_lm(64, seed=5).to(dtype)
    ref_one, ref_block = _step_and_block(model)
    n = fp.apply_route(model, route)
    linears = len([m for m in model.modules() if isinstance(m, torch.nn.Linear)])
    assert n == (linears if fp.route_applies(route, dtype) else 0)
    assert fp.apply_route(model, route) == n and fp.route_of(model) == (route if n else "linear")  # idempotent
    one, block = _step_and_block(model)
    tol = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(one.float(), ref_one.float(), **tol)
    torch.testing.assert_close(block.float(), ref_block.float(), **tol)
    if route != "packed":  # blocks of 2+ rows keep the stock GEMM: bit-identical
        torch.testing.assert_close(block, ref_block, atol=0, rtol=0)
    # Autograd takes the stock kernel (oneDNN's packed weights have no backward here).
    x = torch.randn(1, 2, 32, dtype=dtype, requires_grad=True)
    lin = next(m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features == 32)
    lin(x).sum().backward()
    assert x.grad is not None
    fp.apply_route(model, "linear")
    assert fp.route_of(model) == "linear" and not _route_attrs(model)


def test_the_route_is_the_measured_fastest_and_cached(fresh_route_choice, monkeypatch):
    fp = fresh_route_choice
    # Zen 5 (ms, one row / nine rows): packed weights win both.
    zen5 = {"linear": {"rows1_ms": 1.73, "rows9_ms": 1.48}, "mv": {"rows1_ms": 1.88, "rows9_ms": 1.45},
            "pad2": {"rows1_ms": 1.34, "rows9_ms": 1.48}, "packed": {"rows1_ms": 1.19, "rows9_ms": 1.13}}
    assert fp.pick_route(zen5) == "packed"
    # The AMX Xeon's torch.mv (0.086 -> 0.062 s per draft step) where packing is not faster.
    xeon = {"linear": {"rows1_ms": 1.0, "rows9_ms": 1.0}, "mv": {"rows1_ms": 0.7, "rows9_ms": 1.0},
            "pad2": {"rows1_ms": 1.0, "rows9_ms": 1.0}, "packed": {"rows1_ms": 1.2, "rows9_ms": 0.9}}
    assert fp.pick_route(xeon) == "mv"
    # A route that loses on many rows is not taken for its one-row gain; a tie keeps the stock kernel.
    assert fp.pick_route({"linear": {"rows1_ms": 1.0, "rows9_ms": 1.0},
                          "packed": {"rows1_ms": 0.5, "rows9_ms": 1.6}}) == "linear"
    assert fp.pick_route({"linear": {"rows1_ms": 1.0, "rows9_ms": 1.0},
                          "pad2": {"rows1_ms": 0.98, "rows9_ms": 1.0}}) == "linear"
    monkeypatch.setattr(fp, "measure_routes", lambda dtype: zen5)
    model = tiny_causal_lm(64, seed=5).to(torch.bfloat16)
    assert fp.install_linear_route(model) > 0 and fp.route_of(model) == "packed"
    assert "packed route" in fp.route_record()["torch.bfloat16"] and "1.190/1.130" in fp.route_record()["torch.bfloat16"]
    # Cached on disk per CPU / dtype / torch / threads: a new process does not measure again.
    monkeypatch.setattr(fp, "_CHOICES", {})
    monkeypatch.setattr(fp, "measure_routes", lambda dtype: (_ for _ in ()).throw(AssertionError))
    assert fp.route_choice(torch.bfloat16)["route"] == "packed"
    # The environment forces a route; an unknown one is refused in one line.
    monkeypatch.setattr(fp, "_CHOICES", {})
    monkeypatch.setenv(fp.ROUTE_ENV, "pad2")
    assert fp.route_choice(torch.bfloat16) == {"route": "pad2", "reason": f"{fp.ROUTE_ENV}=pad2 set"}
    monkeypatch.setattr(fp, "_CHOICES", {})
    monkeypatch.setenv(fp.ROUTE_ENV, "fast")
    from specstop.errors import UserError

    with pytest.raises(UserError, match="choose one of linear, mv, pad2, packed"):
        fp.route_choice(torch.bfloat16)


def test_packed_weights_that_do_not_fit_take_the_next_fastest_route(fresh_route_choice, monkeypatch, caplog, tmp_path):
    from specstop.memory import MemoryStatus
    from specstop.pair.preflight import check_pair_fits
    from specstop.testing import save_tiny_pair

    fp = fresh_route_choice
    timings = {"linear": {"rows1_ms": 1.7, "rows9_ms": 1.5}, "pad2": {"rows1_ms": 1.3, "rows9_ms": 1.5},
               "packed": {"rows1_ms": 1.2, "rows9_ms": 1.1}}
    monkeypatch.setattr(fp, "measure_routes", lambda dtype: timings)
    model = tiny_causal_lm(64, seed=5).to(torch.bfloat16)
    with caplog.at_level("WARNING"):
        fp.install_linear_route(model, pack=False)
    assert fp.route_of(model) == "pad2" and "left unpacked" in caplog.text
    # The pair loader's memory check says whether the copy fits: one read of the machine's memory.
    pair = save_tiny_pair(tmp_path / "pair")
    import specstop.memory as memory
    from specstop.pair.weights import estimated_load_bytes

    total = 64 << 30
    size = sum(estimated_load_bytes(str(pair / role), 4) for role in ("draft", "target"))
    for available, fits in ((total, True), (memory.reserve_bytes(total) + int(1.5 * size), False)):
        monkeypatch.setattr(memory, "memory_status", lambda a=available: MemoryStatus(a, total, 0))
        assert check_pair_fits(str(pair / "draft"), str(pair / "target"), torch.float32) is fits


def test_measure_routes_reports_every_route_that_applies():
    from specstop.pair.fast_paths import measure_routes, route_applies

    m = measure_routes(torch.bfloat16, reps=2)
    assert set(m) == {r for r in ("linear", "mv", "pad2", "packed") if route_applies(r, torch.bfloat16)}
    assert all(t["rows1_ms"] > 0 and t["rows9_ms"] > 0 for t in m.values())
    assert set(measure_routes(torch.float32, reps=1)) <= {"linear", "packed"}


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


def test_packed_weights_follow_in_place_edits_and_copies(fresh_route_choice):
    """A packed weight is never stale: a weight edited in place (load_state_dict, noise in a test) or a
    deep copy of the model packs again, so the packed route computes what the weights say."""
    import copy

    fp = fresh_route_choice
    model = tiny_causal_lm(64, seed=5)
    fp.apply_route(model, "packed")
    before = _step_and_block(model)[1]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(_step_and_block(model)[1], before, atol=0, rtol=0)  # the original is untouched
    edited = _step_and_block(twin)[1]
    fp.apply_route(twin, "linear")
    torch.testing.assert_close(edited, _step_and_block(twin)[1], atol=1e-4, rtol=1e-4)
    assert (edited - before).abs().max() > 1e-3
