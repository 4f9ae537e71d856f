"""SiLU-and-multiply, the gate of a SwiGLU MLP: ``out = silu(x[:, :I]) * x[:, I:]``.

``x`` is the fused gate/up projection ``[T, 2I]`` (gate half first, as
``engine.models.llama`` lays it out). One pass: each element of ``x`` is read once and
each output written once, with the SiLU in float32 and one rounding at the end (torch's
``F.silu(gate) * up`` rounds after the SiLU too). At decode this replaces two launches
per layer with one. With ``row_scale`` each output row is also multiplied by its float32
factor before the rounding: a MoE's routing weight per (token, expert) pair
(``kernels.moe.grouped_mm_moe``), in the same pass.
"""

from dataclasses import dataclass

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, TileLangBuild, check_tensor, tl_dtype

_KERNELS = KernelCache()
BLOCK = 1024  # output columns per CTA


@dataclass(frozen=True)
class SiluMulConfig:
    inter: int
    dtype: str
    scaled: bool = False  # a float32 factor per row (``row_scale``)


def _silu_mul_program(inter, dtype, scaled):
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

    return row_scaled if scaled else plain


def silu_mul_build(cfg: SiluMulConfig) -> TileLangBuild:
    return TileLangBuild(_silu_mul_program, (cfg.inter, cfg.dtype, cfg.scaled))


def silu_and_mul(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` (bf16/fp16, contiguous) → ``[T, I]``,
    each row times ``row_scale [T]`` (float32) when given."""
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns, expected gate and up halves")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if row_scale is not None:
        check_tensor("row_scale", row_scale, dtype=(torch.float32,), ndim=1, device=x.device)
        if row_scale.shape[0] != x.shape[0]:
            raise ValueError(f"row_scale has {row_scale.shape[0]} rows, x {x.shape[0]}")
    if x.shape[0]:
        cfg = SiluMulConfig(inter, tl_dtype(x.dtype), row_scale is not None)
        kernel = _KERNELS.get(cfg, silu_mul_build)
        scale = () if row_scale is None else (row_scale.contiguous(),)
        kernel(x, *scale, out)
    return out


def silu_and_mul_ref(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same in float32 torch ops."""
    gate, up = x.float().chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    return out if row_scale is None else out * row_scale[:, None].float()
