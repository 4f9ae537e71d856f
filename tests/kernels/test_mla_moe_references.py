"""The MLA decode and MoE kernels' torch references and host-side pieces, on the CPU.

``mla_decode_ref`` must equal dense attention over the unpaged latents and the engine's
torch MLA backend (the path the kernel replaces); ``fused_moe_ref`` must equal the
engine's ``moe_experts``; ``moe_align``, which the CUDA kernels index by, must place every
(token, expert) pair exactly once inside its expert's blocks.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import dense_mla_attention, make_mla_problem, rel_error

from engine.attention.base import AttentionMetadata
from engine.attention.torch_mla import TorchMLABackend
from engine.config import MLAConfig
from engine.models.moe import moe_experts
from kernels.mla_decode import choose_num_splits, mla_decode_ref, mla_decode_supported
from kernels.moe import block_m_for, fused_moe_ref, fused_moe_supported, max_rows, moe_align
from kvstore.layout import KVCache, KVCacheLayout

MLA_SHAPES = [  # (num_heads, kv_lora_rank, rope_dim, block_size)
    (4, 32, 8, 4),
    (16, 64, 16, 64),
    (3, 128, 64, 128),
]


@pytest.mark.parametrize("heads,rank,rope,block_size", MLA_SHAPES)
def test_mla_decode_reference_matches_dense_attention(heads, rank, rope, block_size):
    lens = [1, 5, block_size, 2 * block_size + 3, 0]
    p = make_mla_problem(
        lens, num_heads=heads, kv_lora_rank=rank, rope_dim=rope, block_size=block_size,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    out = mla_decode_ref(
        p.q, p.kv_cache, p.block_tables, p.seq_lens, kv_lora_rank=rank, scale=p.scale
    )
    assert out.dtype == torch.float32 and out.shape == (len(lens), heads, rank)
    assert rel_error(out, dense_mla_attention(p)) < 1e-5


@pytest.mark.parametrize("heads,rank,rope,block_size", MLA_SHAPES)
def test_mla_decode_reference_matches_the_torch_mla_backend(heads, rank, rope, block_size):
    lens = [7, 3 * block_size + 1, 2]
    p = make_mla_problem(
        lens, num_heads=heads, kv_lora_rank=rank, rope_dim=rope, block_size=block_size,
        dtype=torch.float32, seed=4,
    )  # fmt: skip
    mla = MLAConfig(kv_lora_rank=rank, qk_nope_head_dim=16, qk_rope_head_dim=rope, v_head_dim=16)
    layout = KVCacheLayout.for_mla(1, rank, rope, block_size, torch.float32)
    cache = KVCache(layout, p.kv_cache.shape[0], "cpu")
    cache.layers[0].copy_(p.kv_cache)
    backend = TorchMLABackend(cache, heads, mla, p.scale)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=p.seq_lens,
        block_tables=p.block_tables, slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        max_query_len=1, max_seq_len=max(lens), query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )  # fmt: skip
    engine = backend.attend_latents(cache.layers[0], p.q, meta)
    ref = mla_decode_ref(
        p.q, p.kv_cache, p.block_tables, p.seq_lens, kv_lora_rank=rank, scale=p.scale
    )
    assert rel_error(engine, ref) < 1e-5


def test_mla_decode_splits_fill_one_wave_of_the_gpu():
    assert choose_num_splits(64, 128, 32768) == 1  # 128 CTAs: one wave already
    assert choose_num_splits(128, 128, 1024) == 1  # two full waves
    assert choose_num_splits(16, 128, 8192) == 4  # 32 CTAs → 128, not a second wave
    assert choose_num_splits(1, 128, 8192) == 64
    assert choose_num_splits(1, 128, 1024) == 16  # one split per 64-token tile at most
    assert choose_num_splits(32, 16, 1 << 20) == 4  # 16 heads: one head group per sequence


def test_mla_decode_supported_needs_cuda_and_kernel_shapes():
    cache = torch.zeros(4, 128, 576, dtype=torch.bfloat16)
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    assert not mla_decode_supported(q, cache, 512)  # CPU tensors
    if torch.cuda.is_available():
        assert mla_decode_supported(q.cuda(), cache.cuda(), 512)
        assert not mla_decode_supported(q.cuda(), cache.cuda()[:, :16], 512)  # 16-token blocks
        small = torch.zeros(4, 128, 40, dtype=torch.bfloat16, device="cuda")
        assert not mla_decode_supported(small[:2], small, 32)  # the tiny test models' latent


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    return ids, weights


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [
    (1, 256, 8, 16), (64, 256, 8, 16), (300, 16, 4, 64), (5, 8, 2, 128), (0, 8, 2, 16),
])  # fmt: skip
def test_moe_align_puts_every_pair_once_in_its_experts_blocks(tokens, experts, top_k, block_m):
    ids, _ = _routing(tokens, experts, top_k, seed=tokens)
    align = moe_align(ids, experts, block_m)
    pairs = tokens * top_k
    assert align.rows == max_rows(pairs, experts, block_m) and align.rows % block_m == 0
    assert align.block_expert.shape == (align.rows // block_m,)
    sorted_ids = align.sorted_ids.long()
    real = sorted_ids < pairs
    assert sorted(sorted_ids[real].tolist()) == list(range(pairs))  # each pair exactly once
    assert (sorted_ids[~real] == pairs).all()
    row_expert = align.block_expert.long().repeat_interleave(block_m)
    assert (row_expert[real] == ids.flatten()[sorted_ids[real]]).all()  # in its expert's block
    used = align.block_expert[align.block_expert < experts].tolist()
    assert used == sorted(used)  # blocks in expert order, the spare ones (E) last
    assert len(used) == sum(-(-int(c) // block_m) for c in torch.bincount(
        ids.flatten(), minlength=experts))  # fmt: skip
    assert (align.block_expert[len(used) :] == experts).all()
    # the pairs come back from the rows through row_of_pair, sorted_ids' inverse
    assert (sorted_ids[align.row_of_pair] == torch.arange(pairs)).all()


def test_block_m_grows_with_the_tokens_per_expert():
    assert block_m_for(64 * 8, 256) == 16  # decode
    assert block_m_for(4096 * 8, 256) == 128  # prefill
    assert block_m_for(1024 * 8, 128) == 64


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 32, 16), (37, 16, 4, 64, 32), (200, 8, 8, 16, 48),
])  # fmt: skip
def test_fused_moe_reference_matches_the_engines_moe_experts(tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens)
    ids, weights = _routing(tokens, experts, top_k, seed=tokens + 1)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    ref = fused_moe_ref(x, ids, weights, w13, w2)
    assert rel_error(ref, moe_experts(x, ids, weights, w13, w2)) < 1e-5


def test_fused_moe_is_not_taken_on_the_cpu():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w13 = torch.zeros(8, 64, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    assert not fused_moe_supported(x, w13, w2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_path_matches_the_reference():
    from kernels.moe import grouped_mm_moe

    g = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden, inter = 37, 16, 4, 64, 32
    ids, weights = _routing(tokens, experts, top_k, seed=6)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
    out = grouped_mm_moe(x, ids, weights, w13, w2)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, fused_moe_ref(x, ids, weights, w13, w2)) < 1e-2
