"""Varlen causal flash attention over the paged KV cache (chunked prefill, cached prefixes).

Queries ``q [T, Hq, D]`` hold the new tokens of B sequences back to back: sequence b owns
rows ``query_start_loc[b] : query_start_loc[b+1]``. Its context is ``seq_lens[b]`` tokens
read from the paged cache (``kvstore.layout``: per layer ``[num_blocks,
block_size, 2 * Hkv * D]``, k then v), the new tokens being its last ``q_len`` tokens, so
their k and v must already be in the cache. Query row r of sequence b sits at position
``seq_lens[b] - q_len + r`` and attends to positions ``0 ..`` that one (causal, aligned
on the right). Decode rows are the case ``q_len == 1``.

One CTA per (query tile of ``block_m`` rows, query head, sequence); it walks the key tiles
of ``block_n`` tokens up to its last row's position with an online softmax. Query tiles
are launched longest-first so the causal imbalance does not leave a tail.
"""

import math
from dataclasses import dataclass

import torch

from kernels._tl import (
    ATTENTION_DTYPES,
    KernelCache,
    TileLangBuild,
    check_layer_cache,
    check_paged_cache,
    check_tensor,
    output_for,
    tl_dtype,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Everything a compiled prefill kernel is specialised on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    scale: float
    block_m: int = 128
    block_n: int = 128
    num_stages: int = 2
    threads: int = 256

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads}")
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
) -> PrefillConfig:
    block_n = 128 if block_size >= 128 or 128 % block_size == 0 else block_size
    return PrefillConfig(
        num_heads, num_kv_heads, head_dim, block_size, tl_dtype(dtype), scale, block_n=block_n
    )


def prefill_build(cfg: PrefillConfig) -> TileLangBuild:
    """The kernel for ``cfg``."""
    return TileLangBuild(_prefill_program, (
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.block_size,
        cfg.dtype,
        cfg.scale,
        cfg.block_m,
        cfg.block_n,
        cfg.num_stages,
        cfg.threads,
    ), fast_math=True)  # fmt: skip


def _prefill_program(
    heads, kv_heads, dim, block_size, dtype, scale, block_m, block_n, num_stages, threads
):
    import tilelang.language as T

    accum = "float32"
    groups = heads // kv_heads
    width = 2 * kv_heads * dim
    log2_scale = scale * LOG2E
    pages_per_tile = max(block_n // block_size, 1)
    num_tokens = T.dynamic("num_tokens")
    batch = T.dynamic("batch")
    num_blocks = T.dynamic("num_blocks")
    max_blocks = T.dynamic("max_blocks")

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

    @T.prim_func
    def main(
        Q: T.Tensor([num_tokens, heads, dim], dtype),
        KV: T.Tensor([num_blocks, block_size, width], dtype),
        block_table: T.Tensor([batch, max_blocks], "int32"),
        seq_lens: T.Tensor([batch], "int32"),
        query_start_loc: T.Tensor([batch + 1], "int32"),
        max_query_len: T.int32,
        Out: T.Tensor([num_tokens, heads, dim], dtype),
    ):
        with T.Kernel(T.ceildiv(max_query_len, block_m), heads, batch, threads=threads) as (
            bx_raw,
            h,
            b,
        ):
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim], dtype)
            o_s = T.alloc_shared([block_m, dim], dtype)
            acc_s = T.alloc_fragment([block_m, block_n], accum)
            acc_s_cast = T.alloc_fragment([block_m, block_n], dtype)
            acc_o = T.alloc_fragment([block_m, dim], accum)
            m = T.alloc_fragment([block_m], accum)
            m_prev = T.alloc_fragment([block_m], accum)
            rescale = T.alloc_fragment([block_m], accum)
            row_sum = T.alloc_fragment([block_m], accum)
            denom = T.alloc_fragment([block_m], accum)

            bx = T.ceildiv(max_query_len, block_m) - 1 - bx_raw
            q0 = query_start_loc[b]
            q_len = query_start_loc[b + 1] - q0
            seq_len = seq_lens[b]
            row0 = bx * block_m
            pos0 = seq_len - q_len + row0
            hk = h // groups
            n = T.if_then_else(
                row0 < q_len,
                T.min(T.ceildiv(pos0 + block_m, block_n), T.ceildiv(seq_len, block_n)),
                0,
            )

            T.copy(Q[q0 + row0 : q0 + row0 + block_m, h, :], q_s)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m, -T.infinity(accum))

            for k in T.Pipelined(n, num_stages=num_stages):
                load_tile(KV, block_table, b, k * block_n, hk * dim, k_s)
                if (k + 1) * block_n > pos0 + 1:  # the tile crosses the diagonal: mask it
                    for i, j in T.Parallel(block_m, block_n):
                        acc_s[i, j] = T.if_then_else(
                            (k * block_n + j <= pos0 + i) & (k * block_n + j < seq_len),
                            0,
                            -T.infinity(accum),
                        )
                else:
                    T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(block_m):
                    rescale[i] = T.exp2(m_prev[i] * log2_scale - m[i] * log2_scale)
                for i, j in T.Parallel(block_m, block_n):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * log2_scale - m[i] * log2_scale)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_m):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, acc_s_cast)
                for i, d in T.Parallel(block_m, dim):
                    acc_o[i, d] *= rescale[i]
                load_tile(KV, block_table, b, k * block_n, (kv_heads + hk) * dim, v_s)
                T.gemm(acc_s_cast, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for i, d in T.Parallel(block_m, dim):
                o_s[i, d] = acc_o[i, d] / denom[i]
            for i, d in T.Parallel(block_m, dim):
                if row0 + i < q_len:
                    Out[q0 + row0 + i, h, d] = o_s[i, d]

    return main


_KERNELS = KernelCache()


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    num_kv_heads: int,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.

    ``max_query_len`` is a host int (the grid's size); it must bound every q_len.
    """
    step = PrefillAttentionStep(q, kv_cache, block_tables, seq_lens, query_start_loc,
                                max_query_len=max_query_len, num_kv_heads=num_kv_heads,
                                scale=scale, config=config)  # fmt: skip
    return step(q, kv_cache)


class PrefillAttentionStep:
    """``prefill_attention`` of one step, for every layer: its checks and kernel done once
    from the first layer's ``q`` and cache, so that each layer costs a kernel call. A
    layer's ``q`` and cache must have the first one's shape and dtype; the output is a new
    tensor, or ``out``."""

    def __init__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        max_query_len: int,
        num_kv_heads: int,
        scale: float,
        config: PrefillConfig | None = None,
    ) -> None:
        _, heads, dim = q.shape
        check_tensor("q", q, dtype=ATTENTION_DTYPES, ndim=3)
        check_paged_cache(q, kv_cache, block_tables, seq_lens, num_kv_heads)
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1,
                     device=q.device)  # fmt: skip
        batch = seq_lens.shape[0]
        if block_tables.shape[0] != batch or query_start_loc.shape[0] != batch + 1:
            raise ValueError("block_tables, seq_lens and query_start_loc disagree on the batch")
        cfg = config or default_config(heads, num_kv_heads, dim, kv_cache.shape[1], q.dtype,
                                       scale)  # fmt: skip
        self.kernel = _KERNELS.kept(cfg, prefill_build)
        self.q_layout = (q.shape, q.dtype, q.device)
        self.cache_shape = kv_cache.shape
        self.args = (block_tables, seq_lens, query_start_loc, max_query_len)
        self.runs = q.shape[0] > 0 and max_query_len > 0

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if (q.shape, q.dtype, q.device) != self.q_layout or not q.is_contiguous():
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} differs from the step's "
                             f"{self.q_layout} or is not contiguous")  # fmt: skip
        check_layer_cache(kv_cache, self.cache_shape, q.dtype)
        out = output_for(q, out)
        if self.runs:
            self.kernel(q, kv_cache, *self.args, out)
        return out


def prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """The same function in plain torch, float32 math; returns float32 ``[T, Hq, D]``."""
    num_tokens, heads, dim = q.shape
    groups = heads // num_kv_heads
    block_size = kv_cache.shape[1]
    width = num_kv_heads * dim
    out = torch.zeros(num_tokens, heads, dim, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        blocks = block_tables[b, : math.ceil(length / block_size)].long()
        kv = kv_cache[blocks].flatten(0, 1)[:length].float()
        k = kv[:, :width].view(length, num_kv_heads, dim).repeat_interleave(groups, dim=1)
        v = kv[:, width:].view(length, num_kv_heads, dim).repeat_interleave(groups, dim=1)
        qb = q[starts[b] : starts[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        rows = torch.arange(length - q_len, length, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > rows, -math.inf)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
