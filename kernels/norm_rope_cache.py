"""The small memory-bound kernels around attention: RMSNorm, RoPE, KV-cache write.

- ``fused_add_rms_norm(x, residual, weight, eps)``, in place: ``residual <- x + residual``
  (rounded to the input dtype, as Hugging Face's bf16 add does), then ``x <-
  rmsnorm(residual) * weight`` with the mean square in float32. ``rms_norm`` is the same
  without the residual, into a new tensor.
- ``rotary_embedding(positions, q, k, cos_sin)``, in place, rotate-half (NeoX / Hugging
  Face Llama) form: with ``cos, sin = cos_sin[pos].chunk(2)`` over ``head_dim``,
  ``x1, x2 = x.chunk(2)`` becomes ``(x1*cos - x2*sin, x2*cos + x1*sin)``. The table is
  ``[max_positions, head_dim]`` float32, cos half then sin half (``engine.models.llama``).
- ``write_kv_cache(k, v, kv_cache, slot_mapping)``, in place: token t's k and v land in
  row ``slot_mapping[t]`` of the cache seen as ``[num_blocks * block_size, token_width]``
  (k then v, ``kvstore.layout``); a negative slot is skipped.

q, k and v may be views whose first dim strides (slices of a fused qkv projection): the
kernels take each one's row stride; the other dims must be packed.
"""

from dataclasses import dataclass

import torch

from kernels._tl import (
    ATTENTION_DTYPES,
    KernelCache,
    TileLangBuild,
    check_rows_contiguous,
    check_tensor,
    tl_dtype,
)

_KERNELS = KernelCache()


def _threads_for(work: int, cap: int = 256) -> int:
    """The most threads (a power of two from 32 to ``cap``) that divide ``work`` evenly."""
    threads = cap
    while threads > 32 and work % threads:
        threads //= 2
    return threads


# --- RMSNorm ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormConfig:
    hidden: int
    dtype: str
    eps: float
    residual: bool


def _norm_program(hidden, dtype, eps, residual):
    import tilelang.language as T

    accum = "float32"
    num_tokens = T.dynamic("num_tokens")
    threads = _threads_for(hidden)

    @T.macro
    def normalize(z, weight, dst, r):
        sq = T.alloc_fragment([1, hidden], accum)
        ssum = T.alloc_fragment([1], accum)
        for i, j in T.Parallel(1, hidden):
            sq[i, j] = z[i, j] * z[i, j]
        T.reduce_sum(sq, ssum, dim=1)
        for i in T.Parallel(1):
            ssum[i] = T.rsqrt(ssum[i] / hidden + eps)
        for i, j in T.Parallel(1, hidden):
            dst[r, j] = T.cast(z[i, j] * ssum[i] * T.cast(weight[j], accum), dtype)

    @T.prim_func
    def fused(
        X: T.Tensor([num_tokens, hidden], dtype),
        R: T.Tensor([num_tokens, hidden], dtype),
        W: T.Tensor([hidden], dtype),
    ):
        with T.Kernel(num_tokens, threads=threads) as r:
            zb = T.alloc_fragment([1, hidden], dtype)
            z = T.alloc_fragment([1, hidden], accum)
            for i, j in T.Parallel(1, hidden):
                zb[i, j] = X[r, j] + R[r, j]
            for i, j in T.Parallel(1, hidden):
                R[r, j] = zb[i, j]
                z[i, j] = T.cast(zb[i, j], accum)
            normalize(z, W, X, r)

    @T.prim_func
    def plain(
        X: T.Tensor([num_tokens, hidden], dtype),
        W: T.Tensor([hidden], dtype),
        Out: T.Tensor([num_tokens, hidden], dtype),
    ):
        with T.Kernel(num_tokens, threads=threads) as r:
            z = T.alloc_fragment([1, hidden], accum)
            for i, j in T.Parallel(1, hidden):
                z[i, j] = T.cast(X[r, j], accum)
            normalize(z, W, Out, r)

    return fused if residual else plain


def norm_build(cfg: NormConfig) -> TileLangBuild:
    return TileLangBuild(_norm_program, (cfg.hidden, cfg.dtype, cfg.eps, cfg.residual))


def norm_supported(hidden: int) -> bool:
    """True when the RMSNorm kernels take rows of ``hidden`` values: a multiple of 32, so
    that every thread of the row's block holds as many (TileLang finds no layout for 48)."""
    return hidden > 0 and hidden % 32 == 0


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype, ndim=1, device=x.device)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if not norm_supported(x.shape[1]):
        raise ValueError(f"RMSNorm kernel rows must be a multiple of 32 wide, not {x.shape[1]}")


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``; ``x = rmsnorm(residual) * weight``. Returns both."""
    _check_norm(x, weight)
    check_tensor("residual", residual, dtype=x.dtype, ndim=2, device=x.device)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    cfg = NormConfig(x.shape[1], tl_dtype(x.dtype), eps, residual=True)
    if x.shape[0]:
        _KERNELS.get(cfg, norm_build)(x, residual, weight)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight`` into a new tensor."""
    _check_norm(x, weight)
    cfg = NormConfig(x.shape[1], tl_dtype(x.dtype), eps, residual=False)
    out = torch.empty_like(x)
    if x.shape[0]:
        _KERNELS.get(cfg, norm_build)(x, weight, out)
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(rmsnorm(x + residual) * weight, x + residual)``; no input is changed."""
    z = x.float() if residual is None else x.float() + residual.float()
    out = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out, z


# --- Rotary embedding ---------------------------------------------------------------------


@dataclass(frozen=True)
class RopeConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str


def _rope_program(heads, kv_heads, dim, dtype):
    import tilelang.language as T

    accum = "float32"
    half = dim // 2
    num_tokens = T.dynamic("num_tokens")
    max_pos = T.dynamic("max_pos")
    q_stride = T.dynamic("q_stride")
    k_stride = T.dynamic("k_stride")

    @T.macro
    def rotate(x, t, pos, cos_sin, num):
        for h, i in T.Parallel(num, half):
            x1 = T.cast(x[t, h, i], accum)
            x2 = T.cast(x[t, h, half + i], accum)
            x[t, h, i] = T.cast(x1 * cos_sin[pos, i] - x2 * cos_sin[pos, half + i], dtype)
            x[t, h, half + i] = T.cast(x2 * cos_sin[pos, i] + x1 * cos_sin[pos, half + i], dtype)

    @T.prim_func
    def main(
        positions: T.Tensor([num_tokens], "int64"),
        Q: T.StridedTensor([num_tokens, heads, dim], [q_stride, dim, 1], dtype),
        K: T.StridedTensor([num_tokens, kv_heads, dim], [k_stride, dim, 1], dtype),
        cos_sin: T.Tensor([max_pos, dim], accum),
    ):
        with T.Kernel(num_tokens, threads=_threads_for(kv_heads * half, 128)) as t:
            rotate(Q, t, positions[t], cos_sin, heads)
            rotate(K, t, positions[t], cos_sin, kv_heads)

    return main


def rope_build(cfg: RopeConfig) -> TileLangBuild:
    return TileLangBuild(_rope_program, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype))


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``cos_sin[positions]``."""
    check_tensor("positions", positions, dtype=torch.int64, ndim=1, device=q.device)
    check_tensor("cos_sin", cos_sin, dtype=torch.float32, ndim=2, device=q.device)
    check_rows_contiguous("q", q, 3)
    check_rows_contiguous("k", k, 3)
    if q.dtype not in ATTENTION_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q/k dtypes {q.dtype}/{k.dtype}: expected one of {ATTENTION_DTYPES}")
    if cos_sin.shape[1] != q.shape[2] or k.shape[2] != q.shape[2]:
        raise ValueError("cos_sin, q and k must share head_dim (partial rotary is not supported)")
    cfg = RopeConfig(q.shape[1], k.shape[1], q.shape[2], tl_dtype(q.dtype))
    if q.shape[0]:
        _KERNELS.get(cfg, rope_build)(positions, q, k, cos_sin)
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rotated copies of q and k."""
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


# --- KV-cache write -----------------------------------------------------------------------


@dataclass(frozen=True)
class CacheWriteConfig:
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


def _cache_write_program(kv_heads, dim, block_size, dtype):
    import tilelang.language as T

    width = kv_heads * dim
    num_tokens = T.dynamic("num_tokens")
    num_blocks = T.dynamic("num_blocks")
    k_stride = T.dynamic("k_stride")
    v_stride = T.dynamic("v_stride")

    @T.prim_func
    def main(
        K: T.StridedTensor([num_tokens, kv_heads, dim], [k_stride, dim, 1], dtype),
        V: T.StridedTensor([num_tokens, kv_heads, dim], [v_stride, dim, 1], dtype),
        KV: T.Tensor([num_blocks, block_size, 2 * width], dtype),
        slot_mapping: T.Tensor([num_tokens], "int64"),
    ):
        with T.Kernel(num_tokens, threads=_threads_for(width // 8, 128)) as t:
            slot = slot_mapping[t]
            if slot >= 0:
                for h, d in T.Parallel(kv_heads, dim):
                    KV[slot // block_size, slot % block_size, h * dim + d] = K[t, h, d]
                for h, d in T.Parallel(kv_heads, dim):
                    KV[slot // block_size, slot % block_size, width + h * dim + d] = V[t, h, d]

    return main


def cache_write_build(cfg: CacheWriteConfig) -> TileLangBuild:
    return TileLangBuild(
        _cache_write_program, (cfg.num_kv_heads, cfg.head_dim, cfg.block_size, cfg.dtype)
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k, v [T, Hkv, D]`` into ``kv_cache [num_blocks, block_size, 2*Hkv*D]``."""
    check_rows_contiguous("k", k, 3)
    check_rows_contiguous("v", v, 3)
    check_tensor("kv_cache", kv_cache, dtype=ATTENTION_DTYPES, ndim=3, device=k.device)
    check_tensor("slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=k.device)
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype or k.shape != v.shape:
        raise ValueError("k and v must match each other and the cache's dtype")
    if kv_cache.shape[2] != 2 * k.shape[1] * k.shape[2]:
        raise ValueError(f"kv_cache width {kv_cache.shape[2]} != 2 * Hkv * D of {k.shape}")
    cfg = CacheWriteConfig(k.shape[1], k.shape[2], kv_cache.shape[1], tl_dtype(k.dtype))
    if k.shape[0]:
        _KERNELS.get(cfg, cache_write_build)(k, v, kv_cache, slot_mapping)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The same store with torch indexing (in place on ``kv_cache``)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows = torch.cat((k.flatten(1), v.flatten(1)), dim=1).to(flat.dtype)
    flat[slot_mapping[keep]] = rows[keep]
