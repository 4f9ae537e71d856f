"""The kernels' torch references against straightforward math, on the CPU (CI runs these).

Each reference is what a CUDA kernel is checked against, so each must itself agree with
an independent statement of the function: dense attention over unpaged contexts, the
engine's own torch attention backend, a rotation written with complex numbers, a cache
write done token by token.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import dense_attention, make_problem, rel_error

from engine.attention.base import AttentionMetadata
from engine.attention.torch_sdpa import QUERY_BLOCK, TorchSDPABackend, causal, fused
from kernels.activation import silu_and_mul_ref
from kernels.gemv import MAX_ROWS, ROWS, gemv_ref, gemv_supported
from kernels.norm_rope_cache import (
    rms_norm_ref,
    rotary_embedding_ref,
    write_kv_cache_ref,
)
from kernels.paged_decode_attention import choose_num_splits, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kvstore.layout import KVCache, KVCacheLayout

SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 64, 16),
    (9, 3, 64, 16),
    (8, 2, 128, 128),
]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", SHAPES)
def test_decode_reference_matches_dense_attention(heads, kv_heads, dim, block_size):
    lens = [1, 17, block_size, 3 * block_size + 5, 0]
    p = make_problem(
        lens,
        [1] * len(lens),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=1,
    )
    out = paged_decode_attention_ref(
        p.q, p.kv_cache, p.block_tables, p.seq_lens, num_kv_heads=kv_heads, scale=p.scale
    )
    ref = dense_attention(p)
    ref[-1] = 0  # an empty context attends to nothing: the reference returns zeros
    assert out.dtype == torch.float32
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", SHAPES)
def test_prefill_reference_matches_dense_attention(heads, kv_heads, dim, block_size):
    # a fresh prompt, a chunk after a cached prefix, a decode row, an empty chunk
    lens, q_lens = [23, 2 * block_size + 9, 40, 7], [23, block_size + 2, 1, 0]
    p = make_problem(
        lens,
        q_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=2,
    )
    out = prefill_attention_ref(
        p.q,
        p.kv_cache,
        p.block_tables,
        p.seq_lens,
        p.query_start_loc,
        num_kv_heads=kv_heads,
        scale=p.scale,
    )
    assert rel_error(out, dense_attention(p)) < 1e-5


def _metadata(p) -> AttentionMetadata:
    q_lens, lens = p.query_lens, p.seq_lens.tolist()
    slots = []
    for b, (q_len, length) in enumerate(zip(q_lens, lens)):
        for pos in range(length - q_len, length):
            block = int(p.block_tables[b, pos // p.kv_cache.shape[1]])
            slots.append(block * p.kv_cache.shape[1] + pos % p.kv_cache.shape[1])
    return AttentionMetadata(
        query_start_loc=p.query_start_loc,
        seq_lens=p.seq_lens,
        block_tables=p.block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=lens,
    )


@pytest.mark.parametrize(("lens", "q_lens"), [
    ([5, 40, 33], [1, 1, 1]),  # decode
    ([5, 40, 33], [5, 9, 1]),
    # chunks of more than QUERY_BLOCK queries (in float32 through SDPA's fused kernel): a
    # fresh prompt, a chunk after a prefix that ends inside a block, a decode row
    ([300, 700, 40], [300, 451, 1]),
])  # fmt: skip
def test_references_agree_with_the_engine_backend(lens, q_lens):
    """Same cache, same metadata: the engine's CPU path and the references agree."""
    heads, kv_heads, dim, block_size = 6, 2, 64, 16
    decode = max(q_lens) == 1
    p = make_problem(
        lens,
        q_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=3,
    )
    layout = KVCacheLayout.for_attention(1, kv_heads, dim, block_size, torch.float32)
    cache = KVCache(layout, p.kv_cache.shape[0], "cpu")
    cache.layers[0].copy_(p.kv_cache)
    meta = _metadata(p)
    new_kv = p.kv_cache.view(-1, p.kv_cache.shape[-1])[meta.slot_mapping]
    k, v = new_kv.chunk(2, dim=-1)
    backend = TorchSDPABackend(cache, heads, kv_heads, dim, p.scale)
    engine_out = backend.forward(
        0, p.q, k.unflatten(-1, (kv_heads, dim)), v.unflatten(-1, (kv_heads, dim)), meta
    )
    if decode:
        ref = paged_decode_attention_ref(
            p.q, p.kv_cache, p.block_tables, p.seq_lens, num_kv_heads=kv_heads, scale=p.scale
        )
    else:
        ref = prefill_attention_ref(
            p.q,
            p.kv_cache,
            p.block_tables,
            p.seq_lens,
            p.query_start_loc,
            num_kv_heads=kv_heads,
            scale=p.scale,
        )
    assert rel_error(engine_out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_len", "seq_len"), [(300, 300), (451, 700), (QUERY_BLOCK, 900)])
def test_a_long_chunks_attention_in_blocks_or_fused_is_its_masked_attention(
    dtype, q_len, seq_len
):
    """``causal`` (blocks of queries, each over the keys up to its last) and ``fused``
    (key/value heads repeated, the mask aligned to the last key) attend as one SDPA call
    under ``each_sequence``'s mask does: the queries the last ``q_len`` of the positions."""
    torch.manual_seed(5)
    q = torch.randn(6, q_len, 64, dtype=dtype)
    k, v = torch.randn(2, 2, seq_len, 64, dtype=dtype)
    mask = torch.arange(seq_len - q_len, seq_len)[:, None] >= torch.arange(seq_len)[None, :]
    whole = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                           scale=0.125, enable_gqa=True)  # fmt: skip
    blocks = causal(q, k, v, mask, 0.125, enable_gqa=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert blocks.dtype == dtype and rel_error(blocks.float(), whole) < tolerance
    assert rel_error(fused(q, k, v, 0.125).float(), whole) < tolerance


def test_num_splits_fill_the_gpu_and_never_exceed_the_tiles():
    assert choose_num_splits(1, 8, 8192, 64) == 33
    assert choose_num_splits(1, 8, 100, 64) == 2
    assert choose_num_splits(256, 8, 8192, 64) == 1
    assert choose_num_splits(4, 8, 1 << 20, 64) == 9


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_reference(residual):
    torch.manual_seed(4)
    x, r, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    out, z = rms_norm_ref(x, w, 1e-6, r if residual else None)
    expect_z = x + r if residual else x
    rms = expect_z.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    assert torch.allclose(z, expect_z)
    assert torch.allclose(out, expect_z / rms * w, atol=1e-5)


def test_rotary_reference_is_a_complex_rotation():
    torch.manual_seed(5)
    num_tokens, heads, kv_heads, dim = 7, 4, 2, 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(50).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 50, (num_tokens,))
    q, k = torch.randn(num_tokens, heads, dim), torch.randn(num_tokens, kv_heads, dim)
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_sin)

    def by_complex(x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x[..., : dim // 2], x[..., dim // 2 :])
        z = z * torch.polar(torch.ones_like(angles[positions]), angles[positions])[:, None]
        return torch.cat((z.real, z.imag), dim=-1)

    assert torch.allclose(q_rot, by_complex(q), atol=1e-5)
    assert torch.allclose(k_rot, by_complex(k), atol=1e-5)


def test_kv_cache_write_reference_places_each_token():
    torch.manual_seed(6)
    kv_heads, dim, block_size, num_blocks = 2, 8, 4, 5
    cache = torch.zeros(num_blocks, block_size, 2 * kv_heads * dim)
    slots = torch.tensor([5, 0, 19, -1, 9])
    k, v = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    write_kv_cache_ref(k, v, cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        row = cache[slot // block_size, slot % block_size]
        assert torch.equal(row[: kv_heads * dim], k[t].flatten())
        assert torch.equal(row[kv_heads * dim :], v[t].flatten())
    assert int((cache.abs().sum(-1) != 0).sum()) == 4


def test_silu_and_mul_reference_is_the_swiglu_gate():
    x = torch.randn(5, 2 * 24, dtype=torch.float64)
    gate, up = x[:, :24], x[:, 24:]
    expected = gate * torch.sigmoid(gate) * up
    assert torch.allclose(silu_and_mul_ref(x), expected.float(), atol=1e-6)
    scale = torch.rand(5, dtype=torch.float64)
    scaled = silu_and_mul_ref(x, row_scale=scale)
    assert torch.allclose(scaled, (expected * scale[:, None]).float(), atol=1e-6)


def test_make_problem_never_uses_the_null_block():
    p = make_problem(
        [5, 33], [1, 1], num_heads=2, num_kv_heads=1, head_dim=8, block_size=16, seed=7
    )
    used = p.block_tables[p.block_tables != 0]
    assert used.numel() == math.ceil(5 / 16) + math.ceil(33 / 16)
    assert len(set(used.tolist())) == used.numel()


def test_gemv_reference_is_the_linear_layer():
    x = torch.randn(3, 40, dtype=torch.float64)
    w = torch.randn(12, 40, dtype=torch.float64)
    assert torch.allclose(gemv_ref(x, w), torch.nn.functional.linear(x, w).float(), atol=1e-5)


def test_gemv_takes_only_decode_shapes_it_can_read_whole():
    w = torch.empty(4 * ROWS, 64, dtype=torch.bfloat16)
    assert gemv_supported(torch.empty(1, 64, dtype=torch.bfloat16), w)
    assert gemv_supported(torch.empty(MAX_ROWS, 64, dtype=torch.bfloat16), w)
    assert not gemv_supported(torch.empty(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    assert not gemv_supported(torch.empty(0, 64, dtype=torch.bfloat16), w)
    assert not gemv_supported(torch.empty(1, 64, dtype=torch.float32), w.float())
    assert not gemv_supported(torch.empty(1, 60, dtype=torch.bfloat16), w[:, :60].clone())
    assert not gemv_supported(torch.empty(1, 64, dtype=torch.bfloat16), w[: ROWS + 1])
    assert not gemv_supported(torch.empty(64, 2, dtype=torch.bfloat16).T, w)
