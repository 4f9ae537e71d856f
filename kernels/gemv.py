"""Skinny linear layer for decode: ``y = x @ w.T`` with a handful of rows in ``x``.

At decode a step's cost is reading the weights once, and a batch of 1-4 tokens turns
every projection into a matrix-vector product. The library GEMM pads such an ``x`` to a
tensor-core tile and parallelises over output tiles; on the 8B shape that reads the qkv
and o projections at 3.3 TB/s against a 4.24 TB/s copy (``kernels/NOTES.md``). This kernel
streams ``w`` once with every load in flight that an SM can hold:

- a CTA of 128 threads owns ``ROWS`` output features; each thread reads 16 bytes of each
  of those rows per 1,024 columns, so a CTA's loads are 2 KiB contiguous per row;
- the ``x`` chunk is loaded once per thread and used for all ``ROWS`` rows;
- products accumulate in float32; the partial sums meet through warp shuffles and one
  shared-memory exchange between the 4 warps; one rounding at the end.

Shapes: ``x [M, K]`` with ``M <= MAX_ROWS``, ``w [N, K]``, ``K % 8 == 0``, ``N % ROWS
== 0``; all bf16/fp16 and contiguous. ``gemv_supported`` says when a call qualifies;
``engine.models.llama.Linear`` uses it at decode and the library GEMM otherwise.
"""

from dataclasses import dataclass

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, TileLangBuild, check_tensor, tl_dtype

_KERNELS = KernelCache()
THREADS = 128
VEC = 8  # 16 bytes of bf16/fp16 per load
WARPS = THREADS // 32
ROWS = 4  # output features per CTA
MAX_ROWS = 4  # rows of x this kernel takes; above it the GEMM reads weights as fast


@dataclass(frozen=True)
class GemvConfig:
    m: int
    n: int
    k: int
    dtype: str


def _gemv_program(m, n, k, dtype):
    import tilelang.language as T

    accum = "float32"
    chunk = THREADS * VEC
    steps = (k + chunk - 1) // chunk

    @T.prim_func
    def main(
        X: T.Tensor([m, k], dtype),
        W: T.Tensor([n, k], dtype),
        Y: T.Tensor([m, n], dtype),
    ):
        with T.Kernel(n // ROWS, threads=THREADS) as bn:
            tx = T.get_thread_binding(0)
            lane = tx % 32
            warp = tx // 32
            x_local = T.alloc_local([VEC], dtype)
            w_local = T.alloc_local([ROWS, VEC], dtype)
            acc = T.alloc_local([m, ROWS], accum)
            partial = T.alloc_shared([WARPS, m * ROWS], accum)
            T.clear(acc)
            for s in T.unroll(steps):
                col = s * chunk + tx * VEC
                if col < k:
                    for r in T.unroll(ROWS):
                        for v in T.vectorized(VEC):
                            w_local[r, v] = W[bn * ROWS + r, col + v]
                    for i in T.unroll(m):
                        for v in T.vectorized(VEC):
                            x_local[v] = X[i, col + v]
                        for r in T.unroll(ROWS):
                            for v in T.unroll(VEC):
                                acc[i, r] += T.cast(x_local[v], accum) * T.cast(
                                    w_local[r, v], accum
                                )
            for i in T.unroll(m):
                for r in T.unroll(ROWS):
                    acc[i, r] = T.warp_reduce_sum(acc[i, r])
            if lane == 0:
                for i in T.unroll(m):
                    for r in T.unroll(ROWS):
                        partial[warp, i * ROWS + r] = acc[i, r]
            T.sync_threads()
            if tx < m * ROWS:
                total = T.alloc_local([1], accum)
                total[0] = partial[0, tx]
                for w in T.unroll(1, WARPS):
                    total[0] += partial[w, tx]
                Y[tx // ROWS, bn * ROWS + tx % ROWS] = T.cast(total[0], dtype)

    return main


def gemv_build(cfg: GemvConfig) -> TileLangBuild:
    return TileLangBuild(_gemv_program, (cfg.m, cfg.n, cfg.k, cfg.dtype))


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``gemv(x, weight)`` takes these operands (shapes and dtypes only)."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % VEC == 0
        and weight.shape[0] % ROWS == 0
        and x.dtype == weight.dtype
        and x.dtype in ATTENTION_DTYPES
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M<=4, K]``, ``weight [N, K]`` (bf16/fp16) → ``[M, N]``."""
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2, device=x.device)
    if not gemv_supported(x, weight):
        raise ValueError(
            f"gemv takes x [1..{MAX_ROWS}, K] and weight [N, K] with K % {VEC} == 0 and "
            f"N % {ROWS} == 0; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = GemvConfig(m, n, k, tl_dtype(x.dtype))
    _KERNELS.get(cfg, gemv_build)(x, weight, out)
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product in float32 torch ops."""
    return x.float() @ weight.float().T
