"""The FP8 kernels against their torch references on CUDA: the row quantization, the
quantizing SiLU-and-mul, and the FP8 grouped MoE (``kernels.fp8``, ``kernels.activation``,
``kernels.moe.fp8_grouped_moe``), sweeping sizes; the MoE captured in a CUDA graph too.

Skipped without CUDA, TileLang or a Hopper GPU. A quantized element may land one e4m3
step away from the reference's where float32 rounding differs by an ulp at a rounding
midpoint, so those kernels are held to: scales equal to float32 precision, at most one
element in a thousand off, none by more than one step. The MoE is held to its FP8
function in float32 (``fp8_moe_ref``): relative error ≤ 2e-2 (its bf16 gate/up output and
the steps above), where FP8 itself is 0.065 from the unquantized layer.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import rel_error

from kernels import tilelang_available

pytestmark = pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and tilelang_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    ),
    reason="needs a Hopper GPU and TileLang",
)

MOE_TOL = 2e-2
MOE_SHAPES = [  # (experts, top_k, hidden, inter)
    (256, 8, 7168, 2048),  # DeepSeek-V3
    (128, 8, 2048, 768),  # Qwen3-30B-A3B
    (16, 4, 64, 32),  # the tiny test model
]


def assert_same_rows(got, ref):
    """``got`` and ``ref`` (q, scale) pairs agree as the module docstring says."""
    (q, scale), (q_ref, scale_ref) = got, ref
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    values, expected = q.float(), q_ref.float()
    off = values != expected
    assert off.float().mean().item() <= 1e-3
    # one e4m3 step: 1/8 of the value's power of two (subnormals: 2^-9)
    step = torch.exp2(torch.floor(torch.log2(expected.abs().clamp_min(2**-6)))) / 8
    assert bool(((values - expected).abs() <= step * 1.001)[off].all())


@pytest.mark.parametrize("width", [64, 2048, 7168])
@pytest.mark.parametrize("rows", [1, 300])
def test_rows_quantized_on_the_gpu_match_the_reference(width, rows):
    from kernels.fp8 import quantize_rows, quantize_rows_ref

    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    x[0] *= 1e-3  # a row of small values keeps its relative precision
    if rows > 1:
        x[1] = 0  # and one of zeros stays zeros
    got = quantize_rows(x)
    assert_same_rows(got, quantize_rows_ref(x))
    if rows > 1:
        assert not got[0][1].float().any()


@pytest.mark.parametrize("inter", [32, 768, 2048])
@pytest.mark.parametrize("rows", [1, 513])
def test_silu_and_mul_into_fp8_rows_matches_the_reference(inter, rows):
    from kernels.activation import silu_and_mul_fp8, silu_and_mul_fp8_ref

    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    scale = torch.rand(rows, device="cuda")
    assert_same_rows(silu_and_mul_fp8(x, scale), silu_and_mul_fp8_ref(x, scale))


@pytest.fixture(scope="module", params=MOE_SHAPES, ids=lambda s: "E{}k{}H{}I{}".format(*s))
def fp8_weights(request):
    from kernels.fp8 import quantize_rows_ref

    experts, top_k, hidden, inter = request.param
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda") / inter**0.5
    yield (top_k, *quantize_rows_ref(w13), *quantize_rows_ref(w2))
    torch.cuda.empty_cache()


def _routing(tokens: int, experts: int, top_k: int, skew: bool = False):
    scores = torch.rand(tokens, experts, device="cuda")
    if skew:  # most tokens on a few experts
        scores[:, :top_k] += 1
    ids = scores.topk(top_k, dim=-1).indices
    return ids, torch.rand(tokens, top_k, device="cuda")


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
def test_fp8_grouped_moe_matches_its_float32_function(fp8_weights, tokens):
    from kernels.moe import fp8_grouped_moe, fp8_grouped_moe_supported, fp8_moe_ref

    top_k, *weights = fp8_weights
    x = torch.randn(tokens, weights[0].shape[2], device="cuda", dtype=torch.bfloat16)
    assert fp8_grouped_moe_supported(x, weights[0], weights[2])
    ids, routing = _routing(tokens, weights[0].shape[0], top_k, skew=tokens == 300)
    out = fp8_grouped_moe(x, ids, routing, *weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, fp8_moe_ref(x, ids, routing, *weights)) <= MOE_TOL


def test_fp8_grouped_moe_replays_from_a_cuda_graph(fp8_weights):
    from kernels.moe import fp8_grouped_moe, fp8_moe_ref

    top_k, *weights = fp8_weights
    tokens, experts = 48, weights[0].shape[0]
    x = torch.randn(tokens, weights[0].shape[2], device="cuda", dtype=torch.bfloat16)
    ids, routing = _routing(tokens, experts, top_k)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8_grouped_moe(x, ids, routing, *weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_grouped_moe(x, ids, routing, *weights)
    new_ids, new_routing = _routing(tokens, experts, top_k, skew=True)
    ids.copy_(new_ids)
    routing.copy_(new_routing)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_error(out, fp8_moe_ref(x, ids, routing, *weights)) <= MOE_TOL
