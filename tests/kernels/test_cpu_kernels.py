"""The CPU kernels (``kernels.cpu``, C) against their torch references, on the CPU.

Quantized products are checked against ``qgemm_ref`` (the same rounding of ``x``, float64
sums) to 1e-5 of the output's largest value and against the float32 product of the
dequantized weights to 1e-4 (what rounding ``x`` to 16 bits costs); everything else to
1e-5 of its reference.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_problem, rel_error

from engine.cpu_kernels import cpu_kernels
from engine.loader import default_model_path
from engine.loader.gguf import GGUFFile, gguf_blocks
from kernels import cpu_quant
from kernels.cpu_quant import Q4, Q8
from kernels.norm_rope_cache import rms_norm_ref, rotary_embedding_ref, write_kv_cache_ref
from kernels.paged_decode_attention import paged_decode_attention_ref

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cpu():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    return kernels


def _weight(kind: int, n: int, k: int, seed: int) -> cpu_quant.QuantWeight:
    g = torch.Generator().manual_seed(seed)
    return cpu_quant.quantize(torch.randn(n, k, generator=g) * 0.05, kind)


@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("gated", [False, True])
def test_qgemm_matches_reference_and_float_product(cpu, kind, rows, gated):
    weight = _weight(kind, 96, 160, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 2 * weight.k if gated else weight.k, generator=g) * 3
    bias = torch.randn(weight.n, generator=g)
    out = cpu.qgemm(x, weight, bias, gated=gated)
    assert rel_error(out, cpu_quant.qgemm_ref(x, weight, bias, gated=gated)) < 1e-5
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    dense = x @ cpu_quant.dequantize_ref(weight).T + bias
    assert rel_error(out, dense) < 1e-4


@pytest.mark.parametrize("kind", [Q4, Q8])
def test_dequantize_is_exactly_the_reference(cpu, kind):
    weight = _weight(kind, 33, 96, seed=kind)
    assert torch.equal(cpu.dequantize(weight), cpu_quant.dequantize_ref(weight))


@pytest.mark.parametrize("kind", [Q4, Q8])
def test_quantize_error_is_within_half_a_step(kind):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    q = cpu_quant.quantize(w, kind)
    d, _, _ = cpu_quant.unpack(q)
    error = (cpu_quant.dequantize_ref(q) - w).abs().reshape(64, -1, cpu_quant.BLOCK)
    assert (error <= d[..., None] * 0.5 + 1e-6).all()


def test_gguf_blocks_hold_exactly_the_dequantized_values():
    gguf = GGUFFile(default_model_path())
    kinds = {}
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"):
        blocks = gguf_blocks(gguf, name)
        assert blocks is not None
        kinds[name] = blocks.kind
        assert torch.equal(cpu_quant.dequantize_ref(blocks), gguf.dequantize_torch(name))
    assert kinds["token_embd.weight"] == Q8 and kinds["blk.0.attn_q.weight"] == Q4
    assert gguf_blocks(gguf, "blk.0.attn_norm.weight") is None  # F32 stays a tensor


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(cpu, with_residual):
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(7, 576, generator=g), torch.rand(576, generator=g) + 0.5
    residual = torch.randn(7, 576, generator=g) if with_residual else None
    ref, summed = rms_norm_ref(x, weight, 1e-5, residual)
    out = cpu.rms_norm(x, weight, 1e-5, residual)
    assert rel_error(out, ref) < 1e-5
    if residual is not None:
        assert rel_error(residual, summed) < 1e-6  # the sum is written back in place


def test_rope_rotates_strided_heads_in_place(cpu):
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, 16 * 64, generator=g)
    q, k = qkv[:, : 9 * 64].view(5, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    positions = torch.tensor([0, 3, 17, 100, 4095])
    cos_sin = torch.randn(4096, 64, generator=g)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cos_sin)
    untouched = qkv[:, 12 * 64 :].clone()
    cpu.rope(q, positions, cos_sin)
    cpu.rope(k, positions, cos_sin)
    assert rel_error(q, ref_q) < 1e-6 and rel_error(k, ref_k) < 1e-6
    assert torch.equal(qkv[:, 12 * 64 :], untouched)


def test_store_kv_writes_slots_and_skips_negative_ones(cpu):
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(6, 3, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    slots = torch.tensor([5, 0, 33, -1, 17, 2])
    ours, ref = torch.zeros(3, 16, 384), torch.zeros(3, 16, 384)
    cpu.store_kv(torch.cat((k.flatten(1), v.flatten(1)), 1), ours.view(-1, 384), slots)
    write_kv_cache_ref(k, v, ref, slots)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8)])
def test_decode_attention_matches_reference(cpu, heads, kv_heads, dim, block_size):
    lens = [1, 17, block_size, 3 * block_size + 5, 0, 200]
    p = make_problem(
        lens, [1] * len(lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        block_size=block_size, dtype=torch.float32, seed=2,
    )  # fmt: skip
    ref = paged_decode_attention_ref(
        p.q, p.kv_cache, p.block_tables, p.seq_lens, num_kv_heads=kv_heads, scale=p.scale
    )
    out = cpu.decode_attention(p.q, p.kv_cache, p.block_tables, p.seq_lens, kv_heads, p.scale)
    assert rel_error(out, ref) < 1e-5
