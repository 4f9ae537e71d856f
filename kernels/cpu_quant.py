"""Block-quantized weight products on the CPU: ``y = x @ W.T`` with W in 4 or 8 bits.

At decode on a CPU a step's cost is reading the weights once; SmolLM2-135M in float32 is
540 MB a token, in these formats ~95 MB. The weight formats are llama.cpp's Q4_1 and
Q8_0 with float32 scales, stored row by row in blocks of ``BLOCK`` (32) input features:

- ``Q4`` (24 bytes a block): ``float d, m; uint8 qs[16]``, ``w[j] = d * q[j] + m`` with
  ``q[j]`` the low nibble of ``qs[j]`` for ``j < 16``, the high nibble of ``qs[j - 16]``
  above. GGUF's Q4_1 and Q4_0 (``m = -8 d``) blocks map onto it exactly.
- ``Q8`` (36 bytes a block): ``float d; int8 qs[32]``, ``w[j] = d * qs[j]``; GGUF's Q8_0
  exactly.

``qgemm`` rounds the rows of ``x`` per block of 32 to 16-bit integers (scale ``max|x| /
32767``: a relative error under 2e-5 of the block's largest value, against 4e-3 for the
8-bit activations llama.cpp uses) and takes exact integer dot products per block, scaled
in float32: the product is ``x`` so rounded against the exact weights (``qgemm_ref``
states it in torch). 8-bit activations moved the default model's logits by up to 0.3,
enough to flip a greedy choice whose margin was 0.08; 16-bit ones (``vpmaddwd`` on
weights unpacked to 16 bits instead of ``vpmaddubsw``) moved them by under 0.005, for
about 30% more time at one row. ``gated=True`` takes the fused gate/up output
``[M, 2K]`` and multiplies ``silu(gate) * up`` (SwiGLU) into the weights, so the MLP's
activation costs no extra pass. ``dequantize`` gives the weights back in float32
exactly (the prefill path, where a float32 GEMM is faster than the integer one).

This module holds the formats, the packing and the torch references; the kernels
themselves are in ``kernels/cpu.c`` (``kernels.cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32
Q4, Q8 = 4, 8
BLOCK_BYTES = {Q4: 24, Q8: 36}


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix ``[n, k]`` in ``kind`` (Q4 or Q8) blocks: ``data`` is uint8
    ``[n, k / BLOCK * BLOCK_BYTES[kind]]``, contiguous; row slices of it are weights too."""

    kind: int
    data: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES or self.k % BLOCK:
            raise ValueError(f"kind {self.kind}, k {self.k}: expected Q4/Q8 and k % {BLOCK} == 0")
        if self.data.dtype != torch.uint8 or self.data.shape[-1] != self.row_bytes:
            raise ValueError(f"data {tuple(self.data.shape)} is not [n, {self.row_bytes}] uint8")

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.k // BLOCK * BLOCK_BYTES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


# ---- packing: from float32 or from llama.cpp's blocks ------------------------------------


def _pack(kind: int, scales: list[torch.Tensor], qs: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, nb, bytes]`` from float32 scales ``[n, nb]`` each and payload bytes."""
    parts = [s.to(torch.float32).contiguous().unsqueeze(-1).view(torch.uint8) for s in scales]
    return torch.cat([*parts, qs.view(torch.uint8)], dim=-1).reshape(qs.shape[0], -1)


def pack_q4(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> QuantWeight:
    """Q4 weight from scales ``d``, offsets ``m`` ``[n, nb]`` and codes ``q`` (0..15,
    ``[n, nb, 32]``): ``w = d * q + m``."""
    n, nb, _ = q.shape
    q = q.to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return QuantWeight(Q4, _pack(Q4, [d, m], qs), nb * BLOCK)


def pack_q8(d: torch.Tensor, q: torch.Tensor) -> QuantWeight:
    """Q8 weight from scales ``d`` ``[n, nb]`` and codes ``q`` (-127..127, ``[n, nb, 32]``)."""
    n, nb, _ = q.shape
    return QuantWeight(Q8, _pack(Q8, [d], q.to(torch.int8).contiguous()), nb * BLOCK)


def quantize(weight: torch.Tensor, kind: int) -> QuantWeight:
    """Quantize a float matrix ``[n, k]``: Q4 by each block's min and max (``d = (max -
    min) / 15``, ``m = min``), Q8 by its largest magnitude (``d = max|w| / 127``)."""
    n, k = weight.shape
    w = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    if kind == Q4:
        lo, hi = w.amin(-1), w.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((w - lo[..., None]) * inv[..., None]).round().clamp(0, 15)
        return pack_q4(d, lo, q)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return pack_q8(d, (w * inv[..., None]).round().clamp(-127, 127))


def unpack(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d, m, q)``: scales and offsets ``[n, nb]`` (m zero for Q8) and codes ``[n, nb, 32]``
    as float32."""
    nb = weight.k // BLOCK
    blocks = weight.data.reshape(weight.n, nb, BLOCK_BYTES[weight.kind])
    d = blocks[..., 0:4].contiguous().view(torch.float32)[..., 0]
    if weight.kind == Q4:
        m = blocks[..., 4:8].contiguous().view(torch.float32)[..., 0]
        qs = blocks[..., 8:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    else:
        m = torch.zeros_like(d)
        q = blocks[..., 4:].contiguous().view(torch.int8).float()
    return d, m, q


# ---- references ---------------------------------------------------------------------------


def dequantize_ref(weight: QuantWeight) -> torch.Tensor:
    """The weights as float32 ``[n, k]``: ``d * q + m`` (bit-exact with GGUF's own
    dequantization of Q4_1/Q4_0/Q8_0 blocks, which rounds the same two operations)."""
    d, m, q = unpack(weight)
    w = d[..., None] * q if weight.kind == Q8 else d[..., None] * q + m[..., None]
    return w.reshape(weight.n, weight.k)


def quantize_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded the way ``qgemm`` rounds it: per row and block of 32, to 16-bit codes
    of scale ``max|x| / 32767`` (round half away from zero), returned as float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = xb * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d).reshape(m, k)


def qgemm_ref(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor:
    """What ``qgemm`` computes, in float64 then rounded: ``x`` (or ``silu(gate) * up`` when
    ``gated``) quantized per block, times the exact weights."""
    if gated:
        gate, up = x.float().chunk(2, dim=-1)
        x = F.silu(gate) * up
    xq = quantize_activations_ref(x).double()
    y = xq @ dequantize_ref(weight).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()
