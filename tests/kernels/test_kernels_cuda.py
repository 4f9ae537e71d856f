"""TileLang kernels against their torch references on CUDA, sweeping sizes.

Skipped without CUDA or without TileLang. Every case draws fresh random inputs; the
bound is bf16's: relative error ≤ 1e-2 against the float32 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import make_problem, rel_error

from kernels import tilelang_available

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and tilelang_available()), reason="needs CUDA and TileLang"
)

TOL = 1e-2
ATTENTION_SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (32, 8, 128, 128),  # Llama-3.1-8B at the production block size
    (32, 8, 128, 16),
    (12, 4, 64, 16),
    (9, 3, 64, 128),  # SmolLM2-135M
    (12, 4, 64, 128),
    (8, 8, 128, 16),  # MHA
    (16, 16, 64, 128),
]
DECODE_LENS = [1, 7, 16, 127, 128, 129, 1000, 4097, 0]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", ATTENTION_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_decode_attention(heads, kv_heads, dim, block_size, num_splits):
    from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    p = make_problem(
        DECODE_LENS,
        [1] * len(DECODE_LENS),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=block_size,
        device="cuda",
    )
    args = (p.q, p.kv_cache, p.block_tables, p.seq_lens)
    kw = dict(num_kv_heads=kv_heads, scale=p.scale)
    out = paged_decode_attention(*args, **kw, max_seq_len=max(DECODE_LENS), num_splits=num_splits)
    ref = paged_decode_attention_ref(*args, **kw)
    assert out.dtype == p.q.dtype and out.shape == p.q.shape
    assert torch.all(out[-1] == 0), "an empty context must give zeros"
    assert rel_error(out, ref) <= TOL


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(32, 8, 128, 128), (9, 3, 64, 16)])
def test_paged_decode_attention_reads_q_from_a_fused_qkv_slice(heads, kv_heads, dim, block_size):
    from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    lens = [1, 300, 1000, 77]
    p = make_problem(
        lens, [1] * len(lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        block_size=block_size, device="cuda",
    )  # fmt: skip
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, device="cuda", dtype=p.q.dtype)
    q = qkv[:, : heads * dim].view(len(lens), heads, dim)  # row stride (Hq + 2 Hkv) * D
    args = (p.kv_cache, p.block_tables, p.seq_lens)
    kw = dict(num_kv_heads=kv_heads, scale=p.scale)
    out = paged_decode_attention(q, *args, **kw, max_seq_len=max(lens))
    assert rel_error(out, paged_decode_attention_ref(q.contiguous(), *args, **kw)) <= TOL


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", ATTENTION_SHAPES)
def test_prefill_attention(heads, kv_heads, dim, block_size):
    from kernels.prefill_attention import prefill_attention, prefill_attention_ref

    # fresh prompts, chunks after cached prefixes, decode rows, an empty chunk
    lens = [300, 1000, 50, 3, 10, 777, 129]
    q_lens = [300, 257, 1, 3, 0, 700, 128]
    p = make_problem(
        lens,
        q_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=block_size,
        device="cuda",
    )
    args = (p.q, p.kv_cache, p.block_tables, p.seq_lens, p.query_start_loc)
    kw = dict(num_kv_heads=kv_heads, scale=p.scale)
    out = prefill_attention(*args, **kw, max_query_len=max(q_lens))
    ref = prefill_attention_ref(*args, **kw)
    assert rel_error(out, ref) <= TOL
    starts = p.query_start_loc.tolist()
    for a, b in zip(starts, starts[1:]):
        if b > a:
            assert rel_error(out[a:b], ref[a:b]) <= TOL, (a, b)


def test_prefill_attention_long_prompt():
    from kernels.prefill_attention import prefill_attention, prefill_attention_ref

    p = make_problem(
        [4096], [4096], num_heads=32, num_kv_heads=8, head_dim=128, block_size=128, device="cuda"
    )
    args = (p.q, p.kv_cache, p.block_tables, p.seq_lens, p.query_start_loc)
    out = prefill_attention(*args, max_query_len=4096, num_kv_heads=8, scale=p.scale)
    assert rel_error(out, prefill_attention_ref(*args, num_kv_heads=8, scale=p.scale)) <= TOL


def test_one_decode_step_serves_every_layer_and_writes_into_out():
    """``PagedDecodeStep``: sized on the first layer, then each layer's q and cache (their
    own values, the step's shapes) give what the function gives, into ``out`` when given;
    another shape is refused rather than read wrongly."""
    from kernels.paged_decode_attention import PagedDecodeStep, paged_decode_attention_ref

    lens = [1, 300, 1000, 77]
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=128, device="cuda")
    layers = [make_problem(lens, [1] * len(lens), **kw) for _ in range(3)]
    first = layers[0]
    step = PagedDecodeStep(first.q, first.kv_cache, first.block_tables, first.seq_lens,
                           num_kv_heads=8, scale=first.scale, max_seq_len=max(lens))  # fmt: skip
    out = torch.empty(len(lens) + 2, 32, 128, dtype=first.q.dtype, device="cuda")
    for i, layer in enumerate(layers):
        ref = paged_decode_attention_ref(layer.q, layer.kv_cache, first.block_tables,
                                         first.seq_lens, num_kv_heads=8, scale=first.scale)
        got = step(layer.q, layer.kv_cache) if i % 2 else step(layer.q, layer.kv_cache, out[2:])
        assert rel_error(got, ref) <= TOL, i
    assert rel_error(out[2:], paged_decode_attention_ref(
        layers[2].q, layers[2].kv_cache, first.block_tables, first.seq_lens, num_kv_heads=8,
        scale=first.scale)) <= TOL  # fmt: skip
    with pytest.raises(ValueError, match="differ"):
        step(first.q[:2], first.kv_cache)


def test_one_prefill_step_serves_every_layer_and_writes_into_out():
    from kernels.prefill_attention import PrefillAttentionStep, prefill_attention_ref

    lens, q_lens = [300, 50, 129], [257, 1, 128]
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=128, device="cuda")
    layers = [make_problem(lens, q_lens, **kw) for _ in range(2)]
    first = layers[0]
    tables = (first.block_tables, first.seq_lens, first.query_start_loc)
    step = PrefillAttentionStep(first.q, first.kv_cache, *tables, max_query_len=max(q_lens),
                                num_kv_heads=8, scale=first.scale)  # fmt: skip
    out = torch.empty_like(first.q)
    for layer in layers:
        ref = prefill_attention_ref(layer.q, layer.kv_cache, *tables, num_kv_heads=8,
                                    scale=first.scale)  # fmt: skip
        assert step(layer.q, layer.kv_cache, out) is out
        assert rel_error(out, ref) <= TOL
    with pytest.raises(ValueError, match="differs"):
        step(first.q, first.kv_cache[:-1])


@pytest.mark.parametrize("hidden", [96, 576, 4096])  # 96: three values a thread
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fused_add_rms_norm(hidden, num_tokens):
    from kernels.norm_rope_cache import fused_add_rms_norm, rms_norm, rms_norm_ref

    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    ref_out, ref_sum = rms_norm_ref(x, w, 1e-5, r)
    plain_ref, _ = rms_norm_ref(x, w, 1e-5)
    plain = rms_norm(x, w, 1e-5)
    x_out, r_out = fused_add_rms_norm(x, r, w, 1e-5)
    assert rel_error(plain, plain_ref) <= TOL
    assert rel_error(r_out, ref_sum) <= TOL
    assert rel_error(x_out, ref_out) <= TOL


def test_rms_norm_refuses_a_width_its_kernel_has_no_layout_for():
    from kernels.norm_rope_cache import norm_supported, rms_norm

    assert not norm_supported(48) and norm_supported(96)
    x = torch.randn(3, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm(x, torch.ones(48, device="cuda", dtype=torch.bfloat16), 1e-5)


@pytest.mark.parametrize("inter", [14336, 1536, 100])  # 100: a partial last CTA
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_silu_and_mul(inter, num_tokens):
    from kernels.activation import silu_and_mul, silu_and_mul_ref

    x = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and not out.isnan().any()
    assert rel_error(out, silu_and_mul_ref(x)) <= TOL
    scale = torch.rand(num_tokens, device="cuda") * 2  # a MoE pair's routing weight per row
    scaled = silu_and_mul(x, row_scale=scale)
    assert rel_error(scaled, silu_and_mul_ref(x, row_scale=scale)) <= TOL


# (N, K): the 8B shape's qkv, o, gate_up, down; SmolLM2's qkv; a K that is not a
# multiple of the 1,024 columns one CTA step covers.
GEMV_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576), (8, 200)]


@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv(m, n, k):
    from kernels.gemv import gemv, gemv_ref

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
    out = gemv(x, w)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert rel_error(out, gemv_ref(x, w)) <= TOL
    assert rel_error(out, torch.nn.functional.linear(x, w)) <= TOL


def _cos_sin(max_pos: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 500000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    angles = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_rotary_embedding(heads, kv_heads, dim, fused_qkv, num_tokens):
    from kernels.norm_rope_cache import rotary_embedding, rotary_embedding_ref

    cos_sin = _cos_sin(8192, dim)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    if fused_qkv:  # q and k as row-strided views of one projection, as models make them
        qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, device="cuda")
        q, k, _ = qkv.to(torch.bfloat16).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, k = q.view(num_tokens, heads, dim), k.view(num_tokens, kv_heads, dim)
    else:
        q = torch.randn(num_tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(num_tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cos_sin)
    rotary_embedding(positions, q, k, cos_sin)
    assert rel_error(q, q_ref) <= TOL
    assert rel_error(k, k_ref) <= TOL


@pytest.mark.parametrize("kv_heads,dim,block_size", [(8, 128, 128), (3, 64, 16)])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_write_kv_cache(kv_heads, dim, block_size, fused_qkv):
    from kernels.norm_rope_cache import write_kv_cache, write_kv_cache_ref

    num_tokens, num_blocks = 333, 40
    if fused_qkv:
        qkv = torch.randn(num_tokens, 3 * kv_heads * dim, device="cuda", dtype=torch.bfloat16)
        _, k, v = qkv.split(kv_heads * dim, dim=-1)
        k, v = k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
    else:
        k = torch.randn(num_tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::17] = -1
    cache = torch.randn(num_blocks, block_size, 2 * kv_heads * dim, device="cuda").bfloat16()
    expected = cache.clone()
    write_kv_cache_ref(k, v, expected, slots)
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(
    "lens, q_lens",
    [
        ([37, 600, 129, 1], [1, 1, 1, 1]),  # decode
        ([37, 600, 129, 40], [37, 88, 40, 1]),  # prefill chunks, one decode row
        ([37, 600, 129, 40], [1, 88, 1, 37]),  # decode rows between prefill chunks
        ([37, 600], [37, 88]),  # prefill chunks only
    ],
)
def test_backend_matches_torch_backend(lens, q_lens):
    from engine.attention.base import AttentionMetadata
    from engine.attention.tilelang_backend import TileLangBackend
    from engine.attention.torch_sdpa import TorchSDPABackend
    from kvstore.layout import KVCache, KVCacheLayout

    heads, kv_heads, dim, block_size = 32, 8, 128, 128
    layout = KVCacheLayout.for_attention(2, kv_heads, dim, block_size, torch.bfloat16)
    num_blocks = 1 + sum(math.ceil(n / block_size) for n in lens)
    caches = [KVCache(layout, num_blocks, "cuda") for _ in range(2)]
    for layer in range(2):
        noise = torch.randn_like(caches[0].layers[layer])
        for c in caches:
            c.layers[layer].copy_(noise)
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    slots, next_block = [], 1
    for b, (n, q_len) in enumerate(zip(lens, q_lens)):
        nb = math.ceil(n / block_size)
        tables[b, :nb] = torch.arange(next_block, next_block + nb)
        next_block += nb
        slots += [
            int(tables[b, pos // block_size]) * block_size + pos % block_size
            for pos in range(n - q_len, n)
        ]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        ),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        slot_mapping=torch.tensor(slots, device="cuda"),
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=lens,
    )
    q = torch.randn(sum(q_lens), heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(q_lens), kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fast = TileLangBackend(caches[0], heads, kv_heads, dim, dim**-0.5)
    slow = TorchSDPABackend(caches[1], heads, kv_heads, dim, dim**-0.5)
    out = fast.forward(1, q, k, v, meta)
    ref = slow.forward(1, q, k, v, meta)
    assert torch.equal(caches[0].layers[1], caches[1].layers[1])
    assert rel_error(out, ref.float()) <= TOL
