"""SiLU-and-multiply, the gate of a SwiGLU MLP: ``out = silu(x[:, :I]) * x[:, I:]``.

``x`` is the fused gate/up projection ``[T, 2I]`` (gate half first, as
``engine.models.llama`` lays it out). One pass: each element of ``x`` is read once and
each output written once, with the SiLU in float32 and one rounding at the end (torch's
``F.silu(gate) * up`` rounds after the SiLU too). At decode this replaces two launches
per layer with one. With ``row_scale`` each output row is also multiplied by its float32
factor before the rounding: a MoE's routing weight per (token, expert) pair
(``kernels.moe.grouped_mm_moe``), in the same pass.

``silu_and_mul_fp8`` writes the output as FP8 rows instead (``kernels.fp8``: e4m3 and a
float32 scale per row, from the row's float32 values, never rounded to bf16 first), the
input of an FP8 down product (``kernels.moe.fp8_grouped_moe``): one CTA per row, which
holds the row in registers while its largest magnitude is reduced.
"""

from dataclasses import dataclass

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, TileLangBuild, check_tensor, tl_dtype
from kernels.fp8 import FP8, FP8_NAME, THREADS, quantize_rows_ref, row_quantize

_KERNELS = KernelCache()
BLOCK = 1024  # output columns per CTA


@dataclass(frozen=True)
class SiluMulConfig:
    inter: int
    dtype: str
    scaled: bool = False  # a float32 factor per row (``row_scale``)
    fp8: bool = False  # FP8 rows out (``silu_and_mul_fp8``)


def _silu_mul_program(inter, dtype, scaled, fp8=False):
    import tilelang.language as T

    accum = "float32"
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def rows(X, Out, scale):
        # tokens on the grid's x axis: y and z stop at 65535 (a 16k-token MoE prefill has
        # 131k rows of (token, expert) pairs)
        with T.Kernel(num_tokens, T.ceildiv(inter, BLOCK), threads=128) as (t, bx):
            for j in T.Parallel(BLOCK):
                col = bx * BLOCK + j
                if col < inter:
                    gate = T.cast(X[t, col], accum)
                    up = T.cast(X[t, inter + col], accum) * scale(t)
                    Out[t, col] = T.cast(gate / (1.0 + T.exp(-gate)) * up, dtype)

    @T.prim_func
    def plain(
        X: T.Tensor([num_tokens, 2 * inter], dtype),
        Out: T.Tensor([num_tokens, inter], dtype),
    ):
        rows(X, Out, lambda t: 1.0)

    @T.prim_func
    def row_scaled(
        X: T.Tensor([num_tokens, 2 * inter], dtype),
        Scale: T.Tensor([num_tokens], accum),
        Out: T.Tensor([num_tokens, inter], dtype),
    ):
        rows(X, Out, lambda t: Scale[t])

    @T.prim_func
    def quantized(
        X: T.Tensor([num_tokens, 2 * inter], dtype),
        Scale: T.Tensor([num_tokens], accum),
        Q: T.Tensor([num_tokens, inter], FP8_NAME),
        QScale: T.Tensor([num_tokens], accum),
    ):
        with T.Kernel(num_tokens, threads=THREADS) as t:
            h = T.alloc_fragment([1, inter], accum)
            for i, j in T.Parallel(1, inter):
                gate = T.cast(X[t, j], accum)
                h[i, j] = gate / (1.0 + T.exp(-gate)) * T.cast(X[t, inter + j], accum) * Scale[t]
            row_quantize()(h, t, Q, QScale, inter)

    if fp8:
        return quantized
    return row_scaled if scaled else plain


def silu_mul_build(cfg: SiluMulConfig) -> TileLangBuild:
    return TileLangBuild(_silu_mul_program, (cfg.inter, cfg.dtype, cfg.scaled, cfg.fp8))


def _check(x: torch.Tensor, row_scale: torch.Tensor | None) -> int:
    """Raise ValueError unless the kernel takes these operands; returns I."""
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns, expected gate and up halves")
    if row_scale is not None:
        check_tensor("row_scale", row_scale, dtype=(torch.float32,), ndim=1, device=x.device)
        if row_scale.shape[0] != x.shape[0]:
            raise ValueError(f"row_scale has {row_scale.shape[0]} rows, x {x.shape[0]}")
    return x.shape[1] // 2


def silu_and_mul(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` (bf16/fp16, contiguous) → ``[T, I]``,
    each row times ``row_scale [T]`` (float32) when given."""
    inter = _check(x, row_scale)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        cfg = SiluMulConfig(inter, tl_dtype(x.dtype), row_scale is not None)
        kernel = _KERNELS.get(cfg, silu_mul_build)
        scale = () if row_scale is None else (row_scale.contiguous(),)
        kernel(x, *scale, out)
    return out


def silu_and_mul_fp8(
    x: torch.Tensor, row_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul(x, row_scale)`` as FP8 rows: ``(q [T, I] e4m3, scale [T] float32)``."""
    inter = _check(x, row_scale)
    q = torch.empty(x.shape[0], inter, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        cfg = SiluMulConfig(inter, tl_dtype(x.dtype), scaled=True, fp8=True)
        _KERNELS.get(cfg, silu_mul_build)(x, row_scale.contiguous(), q, scale)
    return q, scale


def silu_and_mul_fp8_ref(
    x: torch.Tensor, row_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in float32 torch ops."""
    return quantize_rows_ref(silu_and_mul_ref(x, row_scale))


def silu_and_mul_ref(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same in float32 torch ops."""
    gate, up = x.float().chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    return out if row_scale is None else out * row_scale[:, None].float()
