"""The MLA decode and MoE kernels against their torch references on CUDA, sweeping sizes.

Skipped without CUDA or without TileLang. Every case draws fresh random inputs and
poisons the outputs' memory first (NaN in the caching allocator's blocks); the bound is
bf16's: relative error ≤ 1e-2 against the float32 reference. Both kernels are also
captured in a CUDA graph and replayed on new inputs, which is how decode steps run them.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import make_mla_problem, rel_error

from kernels import tilelang_available

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and tilelang_available()), reason="needs CUDA and TileLang"
)

TOL = 1e-2
MLA_SHAPES = [  # (num_heads, kv_lora_rank, rope_dim, block_size)
    (128, 512, 64, 128),  # DeepSeek-V3, one GPU
    (16, 512, 64, 64),  # V3 at TP 8: one head group, 48 padding rows
    (100, 256, 64, 128),  # a partial second head group, another rank
]
DECODE_LENS = [1, 63, 64, 65, 127, 128, 129, 1000, 4097, 0]
MOE_SHAPES = [  # (experts, top_k, hidden, inter)
    (256, 8, 7168, 2048),  # DeepSeek-V3
    (128, 8, 2048, 768),  # Qwen3-30B-A3B
    (16, 4, 64, 32),  # the tiny test model
]


def _poison() -> None:
    """Fill the allocator's free memory with NaN so an unwritten output cannot pass."""
    free = torch.cuda.mem_get_info()[0]
    size = min(free // 4, 2 << 30)
    torch.empty(size // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))


@pytest.mark.parametrize("heads,rank,rope,block_size", MLA_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_mla_decode_matches_reference(heads, rank, rope, block_size, num_splits):
    from kernels.mla_decode import mla_decode, mla_decode_ref

    p = make_mla_problem(
        DECODE_LENS, num_heads=heads, kv_lora_rank=rank, rope_dim=rope,
        block_size=block_size, device="cuda",
    )  # fmt: skip
    args = (p.q, p.kv_cache, p.block_tables, p.seq_lens)
    kw = dict(kv_lora_rank=rank, scale=p.scale)
    _poison()
    out = mla_decode(*args, **kw, max_seq_len=max(DECODE_LENS), num_splits=num_splits)
    ref = mla_decode_ref(*args, **kw)
    assert out.dtype == p.q.dtype and out.shape == (len(DECODE_LENS), heads, rank)
    assert torch.all(out[-1] == 0), "an empty context must give zeros"
    assert rel_error(out, ref) <= TOL
    for b in range(len(DECODE_LENS) - 1):
        assert rel_error(out[b], ref[b]) <= TOL, DECODE_LENS[b]


def _graph(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("batch", [1, 64])
def test_mla_decode_replays_from_a_cuda_graph(batch):
    from kernels.mla_decode import mla_decode, mla_decode_ref

    lens = [300 + 37 * b for b in range(batch)]
    p = make_mla_problem(
        lens, num_heads=128, kv_lora_rank=512, rope_dim=64, block_size=128, device="cuda"
    )
    kw = dict(kv_lora_rank=512, scale=p.scale)
    graph, out = _graph(
        lambda: mla_decode(p.q, p.kv_cache, p.block_tables, p.seq_lens, **kw, max_seq_len=4096)
    )
    p.q.copy_(torch.randn_like(p.q))
    p.kv_cache.copy_(torch.randn_like(p.kv_cache))
    p.seq_lens.sub_(torch.arange(batch, device="cuda", dtype=torch.int32) % 5)
    graph.replay()
    ref = mla_decode_ref(p.q, p.kv_cache, p.block_tables, p.seq_lens, **kw)
    assert rel_error(out, ref) <= TOL


def test_mla_backend_decode_matches_the_torch_backend():
    from engine.attention.base import AttentionMetadata
    from engine.attention.tilelang_mla import TileLangMLABackend
    from engine.attention.torch_mla import TorchMLABackend
    from engine.config import MLAConfig
    from kvstore.layout import KVCache, KVCacheLayout

    mla = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, q_lora_rank=1536)  # fmt: skip
    heads, block, lens = 128, 128, [37, 600, 129, 1]
    layout = KVCacheLayout.for_mla(2, 512, 64, block, torch.bfloat16)
    num_blocks = 1 + sum(math.ceil(n / block) for n in lens)
    caches = [KVCache(layout, num_blocks, "cuda") for _ in range(2)]
    noise = torch.randn_like(caches[0].storage)
    for c in caches:
        c.storage.copy_(noise)
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    slots, next_block = [], 1
    for b, n in enumerate(lens):
        nb = math.ceil(n / block)
        tables[b, :nb] = torch.arange(next_block, next_block + nb)
        next_block += nb
        slots.append(int(tables[b, (n - 1) // block]) * block + (n - 1) % block)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), slot_mapping=torch.tensor(slots, device="cuda"),
        max_query_len=1, max_seq_len=max(lens), query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )  # fmt: skip
    q = torch.randn(len(lens), heads, mla.qk_head_dim, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(len(lens), 576, device="cuda", dtype=torch.bfloat16)
    kv_b = torch.randn(heads * 256, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    scale = 192**-0.5
    out = TileLangMLABackend(caches[0], heads, mla, scale).forward(1, q, latent, kv_b, meta)
    ref = TorchMLABackend(caches[1], heads, mla, scale).forward(1, q, latent, kv_b, meta)
    assert torch.equal(caches[0].layers[1], caches[1].layers[1])
    assert rel_error(out, ref.float()) <= TOL


def test_mla_prefill_matches_the_float32_cpu_path():
    """Prefill through SDPA's fused kernels on CUDA (the causal mask aligned to the last
    key, bf16, values padded to the keys' width) against the same backend on the CPU in
    float32: a fresh prompt and a chunk after a cached prefix, in one step."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_mla import TorchMLABackend
    from engine.config import MLAConfig
    from kvstore.layout import KVCache, KVCacheLayout

    mla = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, q_lora_rank=1536)  # fmt: skip
    heads, block, scale = 16, 128, 192**-0.5
    seq_lens, q_lens = [300, 700], [300, 200]  # the second: 500 cached tokens, then 200
    g = torch.Generator().manual_seed(3)
    tables = torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]], dtype=torch.int32)
    slots = [int(tables[b, t // block]) * block + t % block
             for b in range(2) for t in range(seq_lens[b] - q_lens[b], seq_lens[b])]  # fmt: skip
    q = torch.randn(sum(q_lens), heads, mla.qk_head_dim, generator=g)
    latent = torch.randn(sum(q_lens), 576, generator=g)
    kv_b = torch.randn(heads * 256, 512, generator=g) / 512**0.5
    prefix = torch.randn(10 * block, 576, generator=g)  # what the cache already holds
    outs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        layout = KVCacheLayout.for_mla(1, 512, 64, block, dtype)
        cache = KVCache(layout, 10, device)
        cache.layers[0].copy_(prefix.view(10, block, 576))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32,
                                         device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device), slot_mapping=torch.tensor(slots, device=device),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )  # fmt: skip
        backend = TorchMLABackend(cache, heads, mla, scale)
        # float32 queries beside a bf16 cache, as the model's rotary step can hand them over
        args = [q.to(device), latent.to(device, dtype), kv_b.to(device, dtype)]
        outs.append(backend.forward(0, *args, meta).float().cpu())
    assert outs[1].shape == (sum(q_lens), heads, mla.v_head_dim)
    assert rel_error(outs[1], outs[0]) <= TOL


@pytest.fixture(scope="module", params=MOE_SHAPES, ids=lambda s: "E{}k{}H{}I{}".format(*s))
def moe_weights(request):
    experts, top_k, hidden, inter = request.param
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    yield top_k, w13.div_(hidden**0.5), w2.div_(inter**0.5)
    del w13, w2
    torch.cuda.empty_cache()


def _routing(tokens: int, experts: int, top_k: int, skew: bool = False):
    scores = torch.rand(tokens, experts, device="cuda")
    if skew:  # most tokens on a few experts: long runs, many row blocks per expert
        scores[:, :top_k] += 1
    ids = scores.topk(top_k, dim=-1).indices
    return ids, torch.rand(tokens, top_k, device="cuda")


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("block_m", [None, 16, 64, 128])
def test_fused_moe_matches_reference(moe_weights, tokens, block_m):
    from kernels.moe import fused_moe, fused_moe_ref

    top_k, w13, w2 = moe_weights
    x = torch.randn(tokens, w13.shape[2], device="cuda", dtype=torch.bfloat16)
    ids, weights = _routing(tokens, w13.shape[0], top_k, skew=tokens == 300)
    _poison()
    out = fused_moe(x, ids, weights, w13, w2, block_m=block_m)
    ref = fused_moe_ref(x, ids, weights, w13, w2)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, ref) <= TOL


@pytest.mark.parametrize("tokens", [1, 4, 5, 64, 300])
def test_the_engines_choice_of_grouped_gemm_matches_reference(moe_weights, tokens):
    from kernels.moe import fused_moe_ref, moe_experts_cuda

    top_k, w13, w2 = moe_weights
    x = torch.randn(tokens, w13.shape[2], device="cuda", dtype=torch.bfloat16)
    ids, weights = _routing(tokens, w13.shape[0], top_k)
    _poison()
    out = moe_experts_cuda(x, ids, weights, w13, w2)
    assert rel_error(out, fused_moe_ref(x, ids, weights, w13, w2)) <= TOL


def test_fused_moe_replays_from_a_cuda_graph(moe_weights):
    from kernels.moe import fused_moe, fused_moe_ref

    top_k, w13, w2 = moe_weights
    tokens = 48
    x = torch.randn(tokens, w13.shape[2], device="cuda", dtype=torch.bfloat16)
    ids, weights = _routing(tokens, w13.shape[0], top_k)
    graph, out = _graph(lambda: fused_moe(x, ids, weights, w13, w2))
    new_ids, new_weights = _routing(tokens, w13.shape[0], top_k, skew=True)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_error(out, fused_moe_ref(x, ids, weights, w13, w2)) <= TOL
