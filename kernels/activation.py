"""SiLU-and-multiply, the gate of a SwiGLU MLP: ``out = silu(x[:, :I]) * x[:, I:]``.

``x`` is the fused gate/up projection ``[T, 2I]`` (gate half first, as
``engine.models.llama`` lays it out). One pass: each element of ``x`` is read once and
each output written once, with the SiLU in float32 and one rounding at the end (torch's
``F.silu(gate) * up`` rounds after the SiLU too). At decode this replaces two launches
per layer with one.
"""

from dataclasses import dataclass

import torch

from kernels._tl import ATTENTION_DTYPES, KernelCache, check_tensor, tl_dtype

_KERNELS = KernelCache()
BLOCK = 1024  # output columns per CTA


@dataclass(frozen=True)
class SiluMulConfig:
    inter: int
    dtype: str


def _silu_mul_program(inter, dtype):
    import tilelang.language as T

    accum = "float32"
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def main(
        X: T.Tensor([num_tokens, 2 * inter], dtype),
        Out: T.Tensor([num_tokens, inter], dtype),
    ):
        with T.Kernel(T.ceildiv(inter, BLOCK), num_tokens, threads=128) as (bx, t):
            for j in T.Parallel(BLOCK):
                col = bx * BLOCK + j
                if col < inter:
                    gate = T.cast(X[t, col], accum)
                    up = T.cast(X[t, inter + col], accum)
                    Out[t, col] = T.cast(gate / (1.0 + T.exp(-gate)) * up, dtype)

    return main


def build_silu_mul_kernel(cfg: SiluMulConfig):
    import tilelang

    return tilelang.jit(out_idx=None)(_silu_mul_program)(cfg.inter, cfg.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` (bf16/fp16, contiguous) → ``[T, I]``."""
    check_tensor("x", x, dtype=ATTENTION_DTYPES, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns, expected gate and up halves")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        cfg = SiluMulConfig(inter, tl_dtype(x.dtype))
        _KERNELS.get(cfg, lambda: build_silu_mul_kernel(cfg))(x, out)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The same in float32 torch ops."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
