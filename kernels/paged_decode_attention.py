"""Paged decode attention for GQA: one query token per sequence, split-K with a combine.

Cache layout (``kvstore.layout``): one tensor per layer ``[num_blocks, block_size,
token_width]`` with ``token_width = 2 * Hkv * D``; a token's k is ``[:Hkv*D]`` and its v
``[Hkv*D:]``, each (kv_heads, head_dim). ``block_tables[b, j]`` is the cache block that
holds tokens ``j*block_size : (j+1)*block_size`` of sequence b; unused entries are 0 (the
null block). Sequence b attends over its first ``seq_lens[b]`` tokens.

The kernel (flash-decoding) runs one CTA per (kv head, split, sequence). A CTA stacks the
``Hq / Hkv`` query heads that share its kv head as the rows of one tile (padded to
``block_h``), so each KV byte is read once for the whole group, and walks its split's
tiles of ``block_n`` tokens with an online softmax. It writes a float32 partial output
and its log-sum-exp (base 2); the combine kernel merges the splits. Splits that own no
tokens write ``-inf`` and weigh nothing; a sequence of length 0 gets zeros. With one
split (large batches) the split kernel writes the output itself and no combine runs.
The wrapper allocates its partial buffers per call, from torch's allocator, so it can be
captured in a CUDA graph; it never synchronises with the device.
"""

import math
from dataclasses import dataclass, replace

import torch

from kernels._tl import (
    ATTENTION_DTYPES,
    KernelCache,
    TileLangBuild,
    check_layer_cache,
    check_paged_cache,
    check_rows_contiguous,
    output_for,
    tl_dtype,
)

LOG2E = 1.4426950408889634
NUM_SMS_H200 = 132


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a compiled decode kernel is specialised on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    scale: float
    block_n: int = 64
    block_h: int = 64
    num_stages: int = 2
    threads: int = 128
    combine: bool = True  # False: one split, the split kernel writes the output itself

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads}")
        if self.num_heads // self.num_kv_heads > self.block_h:
            raise ValueError(f"GQA group {self.num_heads // self.num_kv_heads} > {self.block_h}")
        small, large = sorted((self.block_n, self.block_size))
        if large % small:
            raise ValueError(f"block_n {self.block_n} and block_size {self.block_size} must nest")


def default_config(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    scale: float,
    batch: int = 1,
) -> DecodeConfig:
    """64-token tiles when few CTAs run (more tiles to split), 128 once the batch fills SMs;
    one block per tile when blocks are smaller than 64 tokens: a tile gathered from several
    small blocks loads page by page without the copy pipeline, 3.2x slower at batch 64 with
    16-token blocks (bench/results/gpu_engine_h200.json, ``decode_block_sweep``)."""
    block_n = 128 if batch * num_kv_heads >= 64 else 64
    if block_size < 64:
        block_n = max(block_size, 16)
    return DecodeConfig(
        num_heads, num_kv_heads, head_dim, block_size, tl_dtype(dtype), scale, block_n=block_n
    )


def decode_build(cfg: DecodeConfig) -> TileLangBuild:
    """The split and combine kernels for ``cfg``."""
    return TileLangBuild(_decode_program, (
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.block_size,
        cfg.dtype,
        cfg.scale,
        cfg.block_n,
        cfg.block_h,
        cfg.num_stages,
        cfg.threads,
        cfg.combine,
    ), fast_math=True)  # fmt: skip


def _decode_program(
    heads,
    kv_heads,
    dim,
    block_size,
    dtype,
    scale,
    block_n,
    block_h,
    num_stages,
    threads,
    combine,
):
    """The TileLang program: split kernel, then (when ``combine``) the combine kernel."""
    import tilelang.language as T

    accum = "float32"
    groups = heads // kv_heads
    width = 2 * kv_heads * dim
    log2_scale = scale * LOG2E
    pages_per_tile = max(block_n // block_size, 1)
    batch = T.dynamic("batch")
    num_blocks = T.dynamic("num_blocks")
    max_blocks = T.dynamic("max_blocks")
    num_split = T.dynamic("num_split")
    q_stride = T.dynamic("q_stride")

    @T.macro
    def load_tile(kv, block_table, b, tok0, col0, dst):
        """Tokens ``tok0 : tok0+block_n`` of sequence b, columns ``col0 : col0+dim``."""
        if pages_per_tile == 1:
            T.copy(
                kv[
                    block_table[b, tok0 // block_size],
                    tok0 % block_size : tok0 % block_size + block_n,
                    col0 : col0 + dim,
                ],
                dst,
            )
        else:
            for p in T.unroll(pages_per_tile):
                T.copy(
                    kv[
                        T.if_then_else(
                            tok0 // block_size + p < max_blocks,
                            block_table[b, tok0 // block_size + p],
                            0,
                        ),
                        0:block_size,
                        col0 : col0 + dim,
                    ],
                    dst[p * block_size : (p + 1) * block_size, :],
                )

    @T.macro
    def combine_splits(lse_part, out_part, Out):
        with T.Kernel(heads, batch, threads=dim) as (h, b):
            o = T.alloc_fragment([dim], accum)
            lse_max = T.alloc_var(accum)
            total = T.alloc_var(accum)
            weight = T.alloc_var(accum)

            lse_max = -T.infinity(accum)
            for s in T.serial(num_split):
                lse_max = T.max(lse_max, lse_part[b, h, s])
            total = 0
            T.clear(o)
            for s in T.serial(num_split):
                weight = T.if_then_else(
                    lse_part[b, h, s] == -T.infinity(accum),
                    0,
                    T.exp2(lse_part[b, h, s] - lse_max),
                )
                total += weight
                for d in T.Parallel(dim):
                    o[d] += weight * out_part[b, h, s, d]
            for d in T.Parallel(dim):
                Out[b, h, d] = T.if_then_else(total > 0, o[d] / total, 0)

    @T.prim_func
    def main(
        Q: T.StridedTensor([batch, heads, dim], [q_stride, dim, 1], dtype),
        KV: T.Tensor([num_blocks, block_size, width], dtype),
        block_table: T.Tensor([batch, max_blocks], "int32"),
        seq_lens: T.Tensor([batch], "int32"),
        lse_part: T.Tensor([batch, heads, num_split], accum),
        out_part: T.Tensor([batch, heads, num_split, dim], accum),
        Out: T.Tensor([batch, heads, dim], dtype),
    ):
        with T.Kernel(kv_heads, num_split, batch, threads=threads) as (hk, sid, b):
            q_s = T.alloc_shared([block_h, dim], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim], dtype)
            acc_s = T.alloc_fragment([block_h, block_n], accum)
            acc_s_cast = T.alloc_fragment([block_h, block_n], dtype)
            acc_o = T.alloc_fragment([block_h, dim], accum)
            m = T.alloc_fragment([block_h], accum)
            m_prev = T.alloc_fragment([block_h], accum)
            rescale = T.alloc_fragment([block_h], accum)
            row_sum = T.alloc_fragment([block_h], accum)
            denom = T.alloc_fragment([block_h], accum)

            seq_len = seq_lens[b]
            num_tiles = T.ceildiv(seq_len, block_n)
            per_split = T.ceildiv(num_tiles, num_split)
            t0 = sid * per_split
            n = T.max(T.min(t0 + per_split, num_tiles) - t0, 0)

            for i, d in T.Parallel(block_h, dim):
                q_s[i, d] = T.if_then_else(i < groups, Q[b, hk * groups + i, d], 0)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m, -T.infinity(accum))

            for k in T.Pipelined(n, num_stages=num_stages):
                tok0 = (t0 + k) * block_n
                load_tile(KV, block_table, b, tok0, hk * dim, k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if tok0 + block_n > seq_len:
                    for i, j in T.Parallel(block_h, block_n):
                        acc_s[i, j] = T.if_then_else(
                            tok0 + j < seq_len, acc_s[i, j], -T.infinity(accum)
                        )
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(block_h):
                    rescale[i] = T.exp2(m_prev[i] * log2_scale - m[i] * log2_scale)
                for i, j in T.Parallel(block_h, block_n):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * log2_scale - m[i] * log2_scale)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_h):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, acc_s_cast)
                for i, d in T.Parallel(block_h, dim):
                    acc_o[i, d] *= rescale[i]
                load_tile(KV, block_table, b, tok0, (kv_heads + hk) * dim, v_s)
                T.gemm(acc_s_cast, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            if combine:
                for i, d in T.Parallel(block_h, dim):
                    if i < groups:
                        out_part[b, hk * groups + i, sid, d] = T.if_then_else(
                            n > 0, acc_o[i, d] / denom[i], 0
                        )
                for i in T.Parallel(block_h):
                    if i < groups:
                        lse_part[b, hk * groups + i, sid] = T.if_then_else(
                            n > 0, T.log2(denom[i]) + m[i] * log2_scale, -T.infinity(accum)
                        )
            else:
                for i, d in T.Parallel(block_h, dim):
                    if i < groups:
                        Out[b, hk * groups + i, d] = T.if_then_else(
                            n > 0, acc_o[i, d] / denom[i], 0
                        )

        if combine:
            combine_splits(lse_part, out_part, Out)

    return main


_KERNELS = KernelCache()


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Enough splits that the split kernel fills about two waves of the GPU's SMs."""
    ctas = batch * num_kv_heads
    max_tiles = max(1, math.ceil(max_seq_len / block_n))
    wanted = math.ceil(2 * NUM_SMS_H200 / max(ctas, 1))
    return int(max(1, min(wanted, max_tiles, 64)))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attend ``q [B, Hq, D]`` over the paged cache; returns ``[B, Hq, D]`` in q's dtype.

    ``q``'s first dim may stride (a slice of a fused qkv projection); the others are packed.

    ``max_seq_len`` (a host int, no device sync) bounds the sequence lengths and only
    sizes the split count; without it the block table's width bounds them.
    """
    step = PagedDecodeStep(q, kv_cache, block_tables, seq_lens, num_kv_heads=num_kv_heads,
                           scale=scale, max_seq_len=max_seq_len, num_splits=num_splits,
                           config=config)  # fmt: skip
    return step(q, kv_cache)


class PagedDecodeStep:
    """``paged_decode_attention`` of one step, for every layer: its checks, split count,
    kernel and split workspaces done once from the first layer's ``q`` and cache; each
    layer then costs a kernel call (on an H200 the whole function took 36 us of host time
    a call, the kernel's own call 6 us). A layer's ``q`` and cache must have the first
    one's shape, strides and dtype. The workspaces are reused layer after layer (stream
    order keeps them apart); the output is a new tensor, or ``out``."""

    def __init__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        num_kv_heads: int,
        scale: float,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
        config: DecodeConfig | None = None,
    ) -> None:
        batch, heads, dim = q.shape
        check_rows_contiguous("q", q, 3)
        if q.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"q: dtype {q.dtype}, expected one of {ATTENTION_DTYPES}")
        check_paged_cache(q, kv_cache, block_tables, seq_lens, num_kv_heads)
        block_size = kv_cache.shape[1]
        if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
            raise ValueError("block_tables and seq_lens must have one row per query")
        cfg = config or default_config(heads, num_kv_heads, dim, block_size, q.dtype, scale,
                                       batch)  # fmt: skip
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        splits = num_splits or choose_num_splits(batch, num_kv_heads, max_seq_len, cfg.block_n)
        self.kernel = _KERNELS.kept(replace(cfg, combine=splits > 1), decode_build)
        self.q_layout = (q.shape, q.stride(), q.dtype, q.device)
        self.cache_shape = kv_cache.shape
        self.block_tables, self.seq_lens = block_tables, seq_lens
        self.lse_part = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
        self.out_part = torch.empty(batch, heads, splits, dim, dtype=torch.float32,
                                    device=q.device)  # fmt: skip

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if (q.shape, q.stride(), q.dtype, q.device) != self.q_layout:
            raise ValueError(f"q {tuple(q.shape)} strides {q.stride()} differ from the step's "
                             f"{self.q_layout}")  # fmt: skip
        check_layer_cache(kv_cache, self.cache_shape, q.dtype)
        out = output_for(q, out)
        self.kernel(q, kv_cache, self.block_tables, self.seq_lens, self.lse_part,
                    self.out_part, out)  # fmt: skip
        return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """The same function in plain torch, float32 math; returns float32 ``[B, Hq, D]``."""
    batch, heads, dim = q.shape
    groups = heads // num_kv_heads
    block_size = kv_cache.shape[1]
    width = num_kv_heads * dim
    out = torch.zeros(batch, heads, dim, dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[b, : -(-length // block_size)].long()
        kv = kv_cache[blocks].flatten(0, 1)[:length].float()
        k = kv[:, :width].view(length, num_kv_heads, dim).repeat_interleave(groups, dim=1)
        v = kv[:, width:].view(length, num_kv_heads, dim).repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out
