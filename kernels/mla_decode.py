"""MLA decode attention over the paged latent cache, absorbed form, split-K with a combine.

Multi-head latent attention at decode (``engine.attention.base.MLABackend``): the cache
holds one latent per token and layer, ``[c, k_pe]`` (``kv_lora_rank`` R values, then the
rotary key's ``rope`` P values; 512 + 64 for DeepSeek-V3), laid out ``[num_blocks,
block_size, R + P]`` (``KVCacheLayout.for_mla``). The query has ``W_UK`` already folded in:
``q [B, H, R + P]`` is ``[q_nope W_UK, q_pe]`` per head. Every head attends over the same
latents, keys ``[c, k_pe]`` and values ``c``, so the output ``[B, H, R]`` stays in the latent
space; the model applies ``W_UV`` after. ``block_tables[b, j]`` is the cache block holding
tokens ``j*block_size : (j+1)*block_size`` of sequence b; it attends over its first
``seq_lens[b]`` tokens.

The kernel follows FlashMLA's shape: one CTA per (group of ``block_h`` = 64 heads, split,
sequence) stacks its heads as the rows of one tile, so each latent byte is read once for
64 heads, and walks its split's tiles of ``block_n`` tokens with an online softmax: three
products for the scores (``q_c c^T`` over the two halves of R, ``q_pe k_pe^T`` over P) and
one for the output (``p c``), the accumulator ``[64, R]`` split by columns between two
warpgroups. At 128 heads the kernel does ~240 FLOP per latent byte, past the H200's ridge:
it is bound by the matrix units, so it is warp-specialised to keep them busy. A producer
warpgroup copies each tile of latents (``cp.async``) into one of two buffers; the first
consumer warpgroup computes the whole score tile, the softmax and the left half of the
output; the second the right half, from the probabilities and rescale factors the first
leaves in shared memory. The second's product of tile j runs while the first computes
tile j+1's scores, so the matrix units are not idle through the softmax (1.33-1.37x the
two warpgroups in lockstep at batch 64, kernels/NOTES.md run 7). Head groups of one
sequence are launched next to each other, so the second reads the latents from L2.
A split writes a float32 partial output and its log-sum-exp (base 2); the combine kernel
merges them. Splits that own no tokens weigh nothing; a sequence of
length 0 gets zeros. With one split (batches that fill the GPU) the split kernel writes the
output itself. Partial buffers come from torch's allocator per call and the grid is sized
from host-side ints: no host-device synchronisation, so a CUDA graph can capture it.
"""

import math
from dataclasses import dataclass, replace

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, TileLangBuild, check_tensor, tl_dtype

LOG2E = 1.4426950408889634
NUM_SMS_H200 = 132
BLOCK_H = 64  # heads per CTA: the smallest M of a Hopper warpgroup MMA


@dataclass(frozen=True)
class MLADecodeConfig:
    """Everything a compiled MLA decode kernel is specialised on."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    dtype: str
    scale: float
    block_n: int = 64
    combine: bool = True  # False: one split, the split kernel writes the output itself

    def __post_init__(self) -> None:
        if self.block_size % self.block_n:
            raise ValueError(f"block_size {self.block_size} is not a multiple of {self.block_n}")
        if self.kv_lora_rank % 64 or self.rope_dim % 16:
            raise ValueError(f"latent {self.kv_lora_rank} + {self.rope_dim}: need R % 64, P % 16")

    @property
    def head_groups(self) -> int:
        return -(-self.num_heads // BLOCK_H)


def default_config(
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype,
    scale: float,
) -> MLADecodeConfig:
    return MLADecodeConfig(num_heads, kv_lora_rank, rope_dim, block_size, tl_dtype(dtype), scale)


def mla_decode_build(cfg: MLADecodeConfig) -> TileLangBuild:
    """The split (and, when ``cfg.combine``, combine) kernels."""
    args = (cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dim, cfg.block_size, cfg.dtype,
            cfg.scale, cfg.block_n, cfg.combine)  # fmt: skip
    return TileLangBuild(_mla_decode_program, args, fast_math=True)


def _combine_macro(heads, rank, batch, num_split):
    """The combine kernel: merges the splits' partial outputs by their log-sum-exps."""
    import tilelang.language as T

    accum = "float32"

    @T.macro
    def combine_splits(lse_part, out_part, Out):
        with T.Kernel(heads, batch, threads=128) as (h, b):
            o = T.alloc_fragment([rank], accum)
            lse_max = T.alloc_var(accum)
            total = T.alloc_var(accum)
            weight = T.alloc_var(accum)

            lse_max = -T.infinity(accum)
            for s in T.serial(num_split):
                lse_max = T.max(lse_max, lse_part[b, h, s])
            total = 0
            T.clear(o)
            for s in T.serial(num_split):
                if lse_part[b, h, s] != -T.infinity(accum):  # an empty split wrote no output
                    weight = T.exp2(lse_part[b, h, s] - lse_max)
                    total += weight
                    for d in T.Parallel(rank):
                        o[d] += weight * out_part[b, h, s, d]
            for d in T.Parallel(rank):
                Out[b, h, d] = T.if_then_else(total > 0, o[d] / total, 0)

    return combine_splits


def _mla_decode_program(heads, rank, rope, block_size, dtype, scale, block_n, combine):
    """The TileLang program: the warp-specialised split kernel (module docstring), then
    (when ``combine``) the combine kernel."""
    import tilelang.language as T

    accum = "float32"
    width = rank + rope
    half = rank // 2
    groups = -(-heads // BLOCK_H)
    log2_scale = scale * LOG2E
    batch = T.dynamic("batch")
    num_blocks = T.dynamic("num_blocks")
    max_blocks = T.dynamic("max_blocks")
    num_split = T.dynamic("num_split")
    merge = _combine_macro(heads, rank, batch, num_split) if combine else None

    @T.macro
    def scores(j, kv_l, kv_r, pe, ready, q_l, q_r, q_pe, acc_s, acc_l, m, m_prev, alpha,
               row_sum, denom, alpha_s, p_s, p_free, p_ready, t0, seq_len):  # fmt: skip
        """First consumer: tile j's scores, softmax and its half of the output."""
        T.barrier_wait(ready[0], (j >> 1) & 1)
        T.clear(acc_s)
        T.wgmma_gemm(q_l, kv_l, acc_s, transpose_B=True)
        T.wgmma_gemm(q_r, kv_r, acc_s, transpose_B=True)
        T.wgmma_gemm(q_pe, pe, acc_s, transpose_B=True)
        T.wait_wgmma(0)
        tok0 = (t0 + j) * block_n
        if tok0 + block_n > seq_len:
            for i, c in T.Parallel(BLOCK_H, block_n):
                acc_s[i, c] = T.if_then_else(tok0 + c < seq_len, acc_s[i, c], -T.infinity(accum))
        if j > 0:  # the second consumer is done with tile j-1's probabilities
            T.barrier_arrive(p_free)
            T.barrier_wait(p_free, (j - 1) & 1)
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for i in T.Parallel(BLOCK_H):
            m[i] = T.max(m[i], m_prev[i])
        for i in T.Parallel(BLOCK_H):
            alpha[i] = T.exp2((m_prev[i] - m[i]) * log2_scale)
        for i, c in T.Parallel(BLOCK_H, block_n):
            acc_s[i, c] = T.exp2(acc_s[i, c] * log2_scale - m[i] * log2_scale)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(BLOCK_H):
            denom[i] = denom[i] * alpha[i] + row_sum[i]
        for i, d in T.Parallel(BLOCK_H, half):
            acc_l[i, d] *= alpha[i]
        T.copy(alpha, alpha_s)
        T.copy(acc_s, p_s)
        T.gemm(p_s, kv_l, acc_l)
        T.barrier_arrive(p_ready)

    @T.macro
    def values(j, kv_r, free, acc_r, alpha_s, p_s, p_ready, p_free, n):
        """Second consumer: its half of tile j's output."""
        T.barrier_arrive(p_ready)
        T.barrier_wait(p_ready, j & 1)
        for i, d in T.Parallel(BLOCK_H, half):
            acc_r[i, d] *= alpha_s[i]
        T.gemm(p_s, kv_r, acc_r)
        T.barrier_arrive(free[0])
        if j + 1 < n:
            T.barrier_arrive(p_free)

    @T.macro
    def load(j, kv_l, kv_r, pe, ready, free, KV, block_table, b, t0):
        """Producer: tile j of the split's latents into one buffer."""
        T.barrier_wait(free[0], ((j >> 1) & 1) ^ 1)
        tok0 = (t0 + j) * block_n
        blk = block_table[b, tok0 // block_size]
        off = tok0 % block_size
        T.async_copy(KV[blk, off : off + block_n, 0:half], kv_l)
        T.async_copy(KV[blk, off : off + block_n, half:rank], kv_r)
        T.async_copy(KV[blk, off : off + block_n, rank:width], pe)
        T.cp_async_barrier_noinc(ready[0])

    @T.prim_func
    def main(
        Q: T.Tensor([batch, heads, width], dtype),
        KV: T.Tensor([num_blocks, block_size, width], dtype),
        block_table: T.Tensor([batch, max_blocks], "int32"),
        seq_lens: T.Tensor([batch], "int32"),
        lse_part: T.Tensor([batch, heads, num_split], accum),
        out_part: T.Tensor([batch, heads, num_split, rank], accum),
        Out: T.Tensor([batch, heads, rank], dtype),
    ):
        with T.Kernel(groups, num_split, batch, threads=384) as (hg, sid, b):
            q_l = T.alloc_shared([BLOCK_H, half], dtype)
            q_r = T.alloc_shared([BLOCK_H, half], dtype)
            q_pe = T.alloc_shared([BLOCK_H, rope], dtype)
            kv0_l = T.alloc_shared([block_n, half], dtype)
            kv0_r = T.alloc_shared([block_n, half], dtype)
            kv1_l = T.alloc_shared([block_n, half], dtype)
            kv1_r = T.alloc_shared([block_n, half], dtype)
            pe0 = T.alloc_shared([block_n, rope], dtype)
            pe1 = T.alloc_shared([block_n, rope], dtype)
            p_s = T.alloc_shared([BLOCK_H, block_n], dtype)
            alpha_s = T.alloc_shared([BLOCK_H], accum)
            denom_s = T.alloc_shared([BLOCK_H], accum)

            acc_s = T.alloc_fragment([BLOCK_H, block_n], accum)
            acc_l = T.alloc_fragment([BLOCK_H, half], accum)
            acc_r = T.alloc_fragment([BLOCK_H, half], accum)
            m = T.alloc_fragment([BLOCK_H], accum)
            m_prev = T.alloc_fragment([BLOCK_H], accum)
            alpha = T.alloc_fragment([BLOCK_H], accum)
            row_sum = T.alloc_fragment([BLOCK_H], accum)
            denom = T.alloc_fragment([BLOCK_H], accum)
            scale_r = T.alloc_fragment([BLOCK_H], accum)

            bar_q = T.alloc_barrier(arrive_count=384)
            ready0 = T.alloc_barrier(arrive_count=128)
            ready1 = T.alloc_barrier(arrive_count=128)
            free0 = T.alloc_barrier(arrive_count=256)
            free1 = T.alloc_barrier(arrive_count=256)
            p_ready = T.alloc_barrier(arrive_count=256)
            p_free = T.alloc_barrier(arrive_count=256)
            done = T.alloc_barrier(arrive_count=256)

            tx = T.get_thread_binding()
            seq_len = seq_lens[b]
            num_tiles = T.ceildiv(seq_len, block_n)
            per_split = T.ceildiv(num_tiles, num_split)
            t0 = sid * per_split
            n = T.max(T.min(t0 + per_split, num_tiles) - t0, 0)
            h0 = hg * BLOCK_H
            wg0 = (q_l, q_r, q_pe, acc_s, acc_l, m, m_prev, alpha, row_sum, denom, alpha_s, p_s,
                   p_free, p_ready, t0, seq_len)  # fmt: skip
            wg1 = (acc_r, alpha_s, p_s, p_ready, p_free, n)
            src = (KV, block_table, b, t0)

            for i, d in T.Parallel(BLOCK_H, half):
                q_l[i, d] = T.if_then_else(h0 + i < heads, Q[b, h0 + i, d], 0)
                q_r[i, d] = T.if_then_else(h0 + i < heads, Q[b, h0 + i, half + d], 0)
            for i, d in T.Parallel(BLOCK_H, rope):
                q_pe[i, d] = T.if_then_else(h0 + i < heads, Q[b, h0 + i, rank + d], 0)
            T.barrier_arrive(bar_q)

            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(acc_l, 0)
                T.fill(denom, 0)
                T.fill(m, -(2**30))  # finite: a first tile's rescale is exp2(-huge), not NaN
                T.barrier_wait(bar_q, 0)
                for jj in T.serial(T.ceildiv(n, 2)):
                    scores(2 * jj, kv0_l, kv0_r, pe0, ready0, *wg0)
                    T.barrier_arrive(free0[0])
                    if 2 * jj + 1 < n:
                        scores(2 * jj + 1, kv1_l, kv1_r, pe1, ready1, *wg0)
                        T.barrier_arrive(free1[0])
                for i in T.Parallel(BLOCK_H):
                    denom_s[i] = denom[i]
                T.barrier_arrive(done)
                if combine:
                    if n > 0:
                        for i, d in T.Parallel(BLOCK_H, half):
                            if h0 + i < heads:
                                out_part[b, h0 + i, sid, d] = acc_l[i, d] / denom[i]
                        for i in T.Parallel(BLOCK_H):
                            if h0 + i < heads:
                                lse_part[b, h0 + i, sid] = T.log2(denom[i]) + m[i] * log2_scale
                    else:  # owns no tokens: weighs nothing, and its partial output is not read
                        for i in T.Parallel(BLOCK_H):
                            if h0 + i < heads:
                                lse_part[b, h0 + i, sid] = -T.infinity(accum)
                else:
                    for i, d in T.Parallel(BLOCK_H, half):
                        if h0 + i < heads:
                            Out[b, h0 + i, d] = T.if_then_else(n > 0, acc_l[i, d] / denom[i], 0)
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for jj in T.serial(T.ceildiv(n, 2)):
                    values(2 * jj, kv0_r, free0, *wg1)
                    if 2 * jj + 1 < n:
                        values(2 * jj + 1, kv1_r, free1, *wg1)
                T.barrier_arrive(done)
                T.barrier_wait(done, 0)
                for i in T.Parallel(BLOCK_H):
                    scale_r[i] = T.if_then_else(n > 0, 1 / denom_s[i], 0)
                if combine:
                    if n > 0:
                        for i, d in T.Parallel(BLOCK_H, half):
                            if h0 + i < heads:
                                out_part[b, h0 + i, sid, half + d] = acc_r[i, d] * scale_r[i]
                else:
                    for i, d in T.Parallel(BLOCK_H, half):
                        if h0 + i < heads:
                            Out[b, h0 + i, half + d] = acc_r[i, d] * scale_r[i]
            else:
                T.set_max_nreg(80, 0)
                for jj in T.serial(T.ceildiv(n, 2)):
                    load(2 * jj, kv0_l, kv0_r, pe0, ready0, free0, *src)
                    if 2 * jj + 1 < n:
                        load(2 * jj + 1, kv1_l, kv1_r, pe1, ready1, free1, *src)

        if combine:
            merge(lse_part, out_part, Out)

    return main


_KERNELS = KernelCache()


def choose_num_splits(batch: int, num_heads: int, max_seq_len: int, block_n: int = 64) -> int:
    """As many splits as keep the grid within one wave (one CTA fits an SM): a second,
    partial wave doubled the time (B=16 8k: 5 splits 227 µs, 4 splits 142 µs), while more
    CTAs in the one wave win at small batch despite the float32 partials (B=1 8k: 64
    splits 45 µs, 8 splits 82 µs; bench/results/mla_moe_h200.json). At most one split per
    tile of ``block_n`` tokens, and 64."""
    ctas = batch * -(-num_heads // BLOCK_H)
    tiles = max(1, math.ceil(max_seq_len / block_n))
    return int(max(1, min(NUM_SMS_H200 // max(ctas, 1), tiles, 64)))


def mla_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """True when ``mla_decode`` takes these operands (shapes, dtypes, device only)."""
    width = kv_cache.shape[-1] if kv_cache.dim() == 3 else -1
    rope = width - kv_lora_rank
    return (
        q.is_cuda
        and q.dim() == 3
        and kv_cache.dim() == 3
        and q.shape[-1] == width
        and q.dtype == kv_cache.dtype
        and q.dtype in ATTENTION_DTYPES
        and kv_lora_rank % 64 == 0
        and 0 < kv_lora_rank <= 512
        and rope > 0
        and rope % 16 == 0
        and kv_cache.shape[1] % 64 == 0
    )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache (module docstring).

    ``q [B, H, R + P]`` (contiguous), ``kv_cache [num_blocks, block_size, R + P]``,
    ``block_tables [B, max_blocks]`` and ``seq_lens [B]`` int32 → ``[B, H, R]`` in q's dtype.
    ``max_seq_len`` (a host int: no device sync) bounds the sequence lengths and only sizes
    the split count; without it the block table's width bounds them.
    """
    check_tensor("q", q, dtype=ATTENTION_DTYPES, ndim=3)
    check_tensor("kv_cache", kv_cache, dtype=q.dtype, ndim=3, device=q.device)
    check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=q.device)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=q.device)
    if not mla_decode_supported(q, kv_cache, kv_lora_rank):
        raise ValueError(
            f"mla_decode takes q [B, H, R + P] and a cache [N, bs % 64 == 0, R + P] with "
            f"R % 64 == 0 (<= 512), P % 16 == 0; got q {tuple(q.shape)}, cache "
            f"{tuple(kv_cache.shape)}, R {kv_lora_rank}"
        )
    batch, heads, width = q.shape
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError("block_tables and seq_lens must have one row per query")
    block_size = kv_cache.shape[1]
    cfg = config or default_config(
        heads, kv_lora_rank, width - kv_lora_rank, block_size, q.dtype, scale
    )
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    splits = num_splits or choose_num_splits(batch, heads, max_seq_len, cfg.block_n)
    cfg = replace(cfg, combine=splits > 1)
    kernel = _KERNELS.get(cfg, mla_decode_build)
    lse_part = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    out_part = torch.empty(batch, heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch:
        kernel(q, kv_cache, block_tables, seq_lens, lse_part, out_part, out)
    return out


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """The same function in plain torch, float32 math; returns float32 ``[B, H, R]``."""
    batch, heads, _ = q.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(batch, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[b, : -(-length // block_size)].long()
        latent = kv_cache[blocks].flatten(0, 1)[:length].float()  # [L, R + P]
        scores = (q[b].float() @ latent.T) * scale  # [H, L]
        out[b] = scores.softmax(dim=-1) @ latent[:, :kv_lora_rank]
    return out
