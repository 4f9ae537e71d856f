"""TileLang kernels, each in its own module beside a torch reference.

Every module holds three things: a ``@tilelang.jit`` factory that builds the kernel for
one static configuration, a torch reference that runs on any device (CPU included), and
a wrapper that checks shapes, dtypes and strides at the boundary and caches the compiled
kernel per configuration (``parallel_builds``: the kernels a dry run asks for, compiled at
once on a process per core when they are not in TileLang's disk cache yet, as an engine's
start-up does). Importing this package never
imports TileLang; the wrappers import it on first use, so CPU-only machines can use the
references.

- ``paged_decode_attention``: one query token per sequence over the paged KV cache, GQA,
  split-K (flash-decoding) with a combine step.
- ``prefill_attention``: varlen causal flash attention over the paged KV cache (chunked
  prefill, cached prefixes).
- ``norm_rope_cache``: fused residual add + RMSNorm, rotary embedding in place, and the
  KV-cache write by slot mapping.
- ``activation``: SiLU-and-mul, the SwiGLU gate over the fused gate/up projection.
- ``gemv``: the skinny linear layer of decode at 1-4 rows.
- ``mla_decode``: multi-head latent attention at decode over the paged latent cache
  (absorbed form, 64 heads per CTA, split-K with a combine), DeepSeek-V3's decode path.
- ``moe``: the routed experts of an MoE layer as a grouped GEMM over the tokens each
  expert received (gate/up with the SiLU fused, down with the routing weight fused), and
  with FP8 expert weights (``fp8_grouped_moe``).
- ``fp8``: rows as FP8 e4m3 with a float32 scale each (the FP8 experts' activations;
  ``activation.silu_and_mul_fp8`` writes its output so).
"""

from kernels._tl import (
    ATTENTION_DTYPES,
    compile_seconds,
    kernels_usable,
    parallel_builds,
    tilelang_available,
)

__all__ = [
    "ATTENTION_DTYPES",
    "compile_seconds",
    "kernels_usable",
    "parallel_builds",
    "tilelang_available",
]
