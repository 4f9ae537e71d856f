"""FP8 rows: a tensor's rows as e4m3 with one float32 scale each, ``x[r] ~ q[r] * scale[r]``.

The format of ``kernels.moe.fp8_grouped_moe``'s activations (its weights are the same,
per output channel): each row's scale is its largest magnitude over ``FP8_MAX`` (448,
e4m3's largest finite value), so the row's largest element maps to ±448 and the others
keep e4m3's 3 mantissa bits of relative precision. A row of zeros gets the scale
``TINY / FP8_MAX`` and stays zeros.

``quantize_rows(x)`` is the kernel (one CTA per row: the row is read once into
registers, its largest magnitude reduced across the CTA, then written scaled);
``quantize_rows_ref`` the same in torch ops on any device. ``row_quantize`` is the
TileLang macro both this kernel and ``kernels.activation``'s quantizing SiLU-and-mul
end with.
"""

from dataclasses import dataclass

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, TileLangBuild, check_tensor, tl_dtype

FP8 = torch.float8_e4m3fn
FP8_NAME = "float8_e4m3fn"
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # the smallest largest-magnitude a scale is made from (a row of zeros)
THREADS = 128

_KERNELS = KernelCache()


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` as FP8 rows in torch ops: ``(q [..., K] e4m3, scale [...] float32)``,
    the values divided by their row's scale in float32."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_(min=TINY) / FP8_MAX
    return (x.float() / scale).to(FP8), scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q * scale`` per row, in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def row_quantize():
    """The TileLang macro ``(values, row, Q, Scale, width)``: ``values`` (a [1, width]
    float32 fragment holding row ``row``) written to ``Q[row]`` as e4m3 over its scale,
    the scale to ``Scale[row]``."""
    import tilelang.language as T

    @T.macro
    def write(values, row, Q, Scale, width):
        amax = T.alloc_fragment([1], "float32")
        T.reduce_absmax(values, amax, dim=1)
        scale = T.max(amax[0], TINY) / FP8_MAX
        for i, j in T.Parallel(1, width):
            Q[row, j] = T.cast(values[i, j] / scale, FP8_NAME)
        Scale[row] = scale

    return write


def _quantize_rows_program(width, dtype):
    import tilelang.language as T

    rows = T.dynamic("rows")

    @T.prim_func
    def main(
        X: T.Tensor([rows, width], dtype),
        Q: T.Tensor([rows, width], FP8_NAME),
        Scale: T.Tensor([rows], "float32"),
    ):
        with T.Kernel(rows, threads=THREADS) as r:
            values = T.alloc_fragment([1, width], "float32")
            for i, j in T.Parallel(1, width):
                values[i, j] = T.cast(X[r, j], "float32")
            row_quantize()(values, r, Q, Scale, width)

    return main


@dataclass(frozen=True)
class QuantizeRowsConfig:
    width: int
    dtype: str


def quantize_rows_build(cfg: QuantizeRowsConfig) -> TileLangBuild:
    return TileLangBuild(_quantize_rows_program, (cfg.width, cfg.dtype))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_ref`` on the GPU for ``x [R, K]`` (bf16/fp16, contiguous)."""
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        cfg = QuantizeRowsConfig(x.shape[1], tl_dtype(x.dtype))
        _KERNELS.get(cfg, quantize_rows_build)(x, q, scale)
    return q, scale
