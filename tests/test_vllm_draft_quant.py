"""The int4 draft layers of specstop's vLLM runner (:mod:`specstop.decode.vllm_draft_quant`), without vLLM:
the layer function vLLM calls, and the crossover timed between the packed and the float GEMM."""

import torch

from specstop.decode.vllm_draft_quant import crossover, packed_linear
from specstop.pair.quantize import weight_only


def _float_linear(calls: list):
    def linear(x, weight, bias):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
    return linear


def test_packed_linear_runs_small_blocks_packed_and_large_ones_on_the_float_gemm():
    torch.manual_seed(0)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.float32)  # vLLM's small-GEMM path keeps its bias in float32
    packed = weight_only(weight, "int4")
    calls: list[int] = []
    record = {"prefill_rows": 4}
    linear = packed_linear(packed, _float_linear(calls), record)
    small, large = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    y = linear(small, weight, bias)
    assert calls == [] and y.dtype == torch.bfloat16 and y.shape == (3, 48)
    torch.testing.assert_close(y, (packed(small) + bias.to(torch.bfloat16)))
    # close to the float product: int4 with groups of 64 inputs
    ref = torch.nn.functional.linear(small.float(), weight.float(), bias)
    assert (y.float() - ref).abs().max() < 0.15 * ref.abs().max()
    linear(large, weight, bias)
    assert calls == [4]
    record["prefill_rows"] = 8  # the crossover, once timed, is read per call
    linear(large, weight, bias)
    assert calls == [4]


def test_weight_only_leaves_a_layer_no_int4_group_divides():
    assert weight_only(torch.randn(16, 48), "int4") is None
    assert weight_only(torch.randn(16, 48), "int8") is not None


def test_crossover_finds_the_first_block_size_where_the_float_gemm_wins():
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    packed = weight_only(weight, "int4")
    # a float GEMM that is slow for few rows and free from 4 rows: the crossover is 4
    def float_linear(x, w, bias):
        if x.shape[0] < 4:
            torch.randn(256, 256) @ torch.randn(256, 256)
        return x
    rows, timed = crossover([(packed, float_linear, weight)], grid=(1, 2, 4, 8), sweeps=3)
    assert rows == 4 and set(timed) == {1, 2, 4}
    assert all(p < f for p, f in (timed[1], timed[2]))
    # a float GEMM that never wins: twice the largest block size tried
    def slow(x, w, bias):
        for _ in range(4):
            torch.randn(256, 256) @ torch.randn(256, 256)
        return x
    rows, timed = crossover([(packed, slow, weight)], grid=(1, 2), sweeps=1)
    assert rows == 4 and set(timed) == {1, 2}
