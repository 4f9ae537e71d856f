"""The FP8 references on the CPU: rows as e4m3 with a scale each (``kernels.fp8``) and the
FP8 grouped MoE's function (``kernels.moe.fp8_moe_ref``), which the CUDA kernels are
held to (tests/kernels/test_fp8_cuda.py) and the engine runs off Hopper GPUs."""

from __future__ import annotations

import torch
from kernel_cases import rel_error

from kernels.fp8 import FP8, FP8_MAX, dequantize_rows, quantize_rows_ref
from kernels.moe import fp8_moe_ref, fused_moe_ref


def test_fp8_rows_map_each_rows_largest_value_to_448_and_keep_three_mantissa_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=g) * torch.logspace(-4, 4, 6)[:, None]
    x[3] = 0
    q, scale = quantize_rows_ref(x)
    assert q.dtype == FP8 and scale.shape == (6,)
    peaks = q.float().abs().amax(-1)
    assert peaks[[0, 1, 2, 4, 5]].eq(FP8_MAX).all()
    assert not q[3].float().any() and scale[3] > 0  # zeros stay zeros, the scale finite
    back = dequantize_rows(q, scale)
    normal = x.abs() >= scale[:, None] * 2**-6  # e4m3's normal range after scaling
    assert ((back - x).abs() <= x.abs() * 2**-4)[normal].all()  # half a step of 3 bits
    assert ((back - x).abs() <= scale[:, None] * 2**-10)[~normal].all()


def test_the_fp8_moe_function_is_the_layer_within_fp8s_error():
    """With the weights as their FP8 values, what is left is the rounding of the tokens and
    of SiLU-and-mul's output to FP8 rows: a few percent, never zero."""
    g = torch.Generator().manual_seed(1)
    experts, top_k, hidden, inter, tokens = 8, 2, 64, 32, 40
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    w13q, w13s = quantize_rows_ref(w13)
    w2q, w2s = quantize_rows_ref(w2)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    out = fp8_moe_ref(x, ids, weights, w13q, w13s, w2q, w2s)
    exact = fused_moe_ref(x, ids, weights, dequantize_rows(w13q, w13s),
                          dequantize_rows(w2q, w2s))  # fmt: skip
    assert 1e-3 < rel_error(out, exact) < 0.06
    assert rel_error(out, fused_moe_ref(x, ids, weights, w13, w2)) < 0.1
    # one token alone computes what it computes among others: rows are quantized alone
    alone = fp8_moe_ref(x[5:6], ids[5:6], weights[5:6], w13q, w13s, w2q, w2s)
    torch.testing.assert_close(alone[0], out[5], rtol=1e-5, atol=1e-6)
