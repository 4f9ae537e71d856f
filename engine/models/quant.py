"""Quantized weights on the CPU: linear layers and embeddings in 4- or 8-bit blocks.

``--cpu-weights`` picks the format of a model's matrices (``CPU_WEIGHTS``):

- ``fp32``: dense float32 (the parity tests' path, and every matrix that the kernels do
  not take);
- ``int8``: every linear layer and the embedding in Q8 blocks (``kernels.cpu_quant``);
- ``int4``: linear layers in Q4 blocks, the embedding (also the tied output head) in Q8.

A GGUF's own Q4_0 / Q4_1 / Q8_0 blocks are taken as they are (``QuantWeight``: exact);
float weights, or blocks of another kind, are (re)quantized at load. A product with at
most ``KERNEL_MAX_ROWS`` rows (decode) runs on the integer kernel, which rounds the
activations to 16-bit integers per block of 32; a longer one (prefill) dequantizes the
weight for the call and runs torch's float32 GEMM, so it computes exactly what the fp32
path does and costs no more than it, give or take the dequantization. Without a C compiler every
product takes that second path.

Decode rows. The two paths round differently, so a token's logits would depend on what
shares its step: a verify step of 8 requests with 2 drafts each has 24 rows and took the
GEMM, where the same tokens decoded one step at a time took the kernel, and a near tie
(2.7e-5 apart in log-probability) came out otherwise with speculation than without. The
runner says which rows of a step are decode rows (a chunk of one token plus its drafts:
``decode_rows``); those always take the integer kernel, whatever their number and
whatever else the step runs, and the other rows choose by their own count.

``quantize_modules`` swaps a built model's ``nn.Linear`` / ``nn.Embedding`` modules for
these before the weights are loaded, so the float32 matrices are never allocated; any
model whose ``load_weights`` routes through ``load_into`` can use it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_kernels import cpu_kernels
from kernels import cpu_quant
from kernels.cpu import CpuKernels
from kernels.cpu_quant import BLOCK, BLOCK_BYTES, Q4, Q8, QuantWeight

log = logging.getLogger("ferry.models")

CPU_WEIGHTS = ("fp32", "int8", "int4")
KERNEL_MAX_ROWS = 16  # more rows: dequantize + float32 GEMM (measured: bench/README.md)

# the step's decode rows (module docstring): True, every row; a bool mask over the step's
# tokens; None, not said (the row count decides)
_DECODE_ROWS: ContextVar[torch.Tensor | bool | None] = ContextVar("decode_rows", default=None)


@contextmanager
def decode_rows(rows: torch.Tensor | bool | None) -> Iterator[None]:
    """Within the block, the products over the step's tokens take the integer kernel for
    ``rows`` (True: all of them; a bool mask, one entry per token) and choose by count for
    the rest (module docstring)."""
    token = _DECODE_ROWS.set(rows)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


def _as_kind(tensor: torch.Tensor | QuantWeight, kind: int) -> QuantWeight:
    if isinstance(tensor, QuantWeight):
        if tensor.kind == kind:
            return tensor
        tensor = cpu_quant.dequantize_ref(tensor)
    return cpu_quant.quantize(tensor, kind)


def as_float(tensor: torch.Tensor | QuantWeight) -> torch.Tensor:
    """A weight as a float32 tensor (dequantized when it is blocks)."""
    return cpu_quant.dequantize_ref(tensor) if isinstance(tensor, QuantWeight) else tensor


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with W in ``kind`` blocks (buffer ``qweight``). Float32 in and
    out; other dtypes are converted."""

    def __init__(self, in_features: int, out_features: int, kind: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        row_bytes = in_features // BLOCK * BLOCK_BYTES[kind]
        self.register_buffer("qweight", torch.empty(out_features, row_bytes, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._blocks: QuantWeight | None = None

    @property
    def weight_blocks(self) -> QuantWeight:
        """``qweight`` as a ``QuantWeight`` (kept between calls while it is the same)."""
        if self._blocks is None or self._blocks.data is not self.qweight:
            self._blocks = QuantWeight(self.kind, self.qweight, self.in_features)
        return self._blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, gated=False)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward(silu(gate) * up)`` for the fused gate/up output ``[T, 2 * in]``; the
        kernel folds the activation into its quantization pass."""
        return self._product(gate_up, gated=True)

    def _product(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).float().contiguous()
        kern = cpu_kernels()
        rows = _DECODE_ROWS.get()
        if kern is None or rows is None or rows is True or rows.shape[0] != x.shape[0]:
            y = self._rows(x, gated, kern, rows is True)
        else:  # decode rows on the kernel, the others by their count
            y = x.new_empty(x.shape[0], self.out_features)
            decode = rows.nonzero().squeeze(1)
            other = (~rows).nonzero().squeeze(1)
            if decode.numel():
                y[decode] = self._rows(x[decode].contiguous(), gated, kern, True)
            if other.numel():
                y[other] = self._rows(x[other].contiguous(), gated, kern, False)
        return y.reshape(*lead, self.out_features)

    def _rows(self, x: torch.Tensor, gated: bool, kern: CpuKernels | None,
              decode: bool) -> torch.Tensor:  # fmt: skip
        """The product of ``x``'s rows: on the integer kernel when they are decode rows or
        few enough, else the float32 GEMM."""
        if kern is not None and (decode or x.shape[0] <= KERNEL_MAX_ROWS):
            return kern.qgemm(x, self.weight_blocks, self.bias, gated=gated)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return F.linear(x, self._dense(kern), self.bias)

    def _dense(self, kern: CpuKernels | None) -> torch.Tensor:
        blocks = self.weight_blocks
        return cpu_quant.dequantize_ref(blocks) if kern is None else kern.dequantize(blocks)

    @torch.no_grad()
    def load(self, tensor: torch.Tensor | QuantWeight, rows: slice | None) -> int:
        """Fill ``rows`` of the weight (all when None) from float values or blocks; returns
        how many weight elements were set. Raises ``ValueError`` on a shape mismatch."""
        dest = self.qweight if rows is None else self.qweight[rows]
        shape = (tensor.n, tensor.k) if isinstance(tensor, QuantWeight) else tuple(tensor.shape)
        if shape != (dest.shape[0], self.in_features):
            raise ValueError(f"shape {shape} != {(dest.shape[0], self.in_features)}")
        dest.copy_(_as_kind(tensor, self.kind).data)
        return shape[0] * shape[1]

    def extra_repr(self) -> str:
        bits = {Q4: 4, Q8: 8}[self.kind]
        return f"in={self.in_features}, out={self.out_features}, int{bits}"


class QuantEmbedding(nn.Module):
    """Token embeddings in ``kind`` blocks; ``project`` uses them as the output head (tied
    embeddings)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.kind = num_embeddings, embedding_dim, kind
        row_bytes = embedding_dim // BLOCK * BLOCK_BYTES[kind]
        self.register_buffer("qweight", torch.empty(num_embeddings, row_bytes, dtype=torch.uint8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = QuantWeight(self.kind, self.qweight[ids.reshape(-1)], self.embedding_dim)
        kern = cpu_kernels()
        out = cpu_quant.dequantize_ref(rows) if kern is None else kern.dequantize(rows)
        return out.reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ E.T`` in float32: the logits of a tied head, at any row count on the
        kernel (a dequantized vocabulary matrix would be the largest tensor of the model)."""
        blocks = QuantWeight(self.kind, self.qweight, self.embedding_dim)
        kern = cpu_kernels()
        if kern is None:
            return F.linear(hidden.float(), cpu_quant.dequantize_ref(blocks))
        return kern.qgemm(hidden.float().contiguous(), blocks)

    load = QuantLinear.load

    @property
    def in_features(self) -> int:  # what ``load`` checks the width against
        return self.embedding_dim


QUANT_MODULES = (QuantLinear, QuantEmbedding)


def quantize_modules(model: nn.Module, weights: str) -> nn.Module:
    """Replace, in place, ``model``'s linear layers and embeddings by quantized ones for
    ``weights`` (``CPU_WEIGHTS``; ``fp32`` changes nothing). Call it under
    ``torch.device("meta")``, before the weights are allocated; a module whose width is
    not a multiple of ``BLOCK`` stays dense. Returns ``model``."""
    if weights not in CPU_WEIGHTS:
        raise ValueError(f"cpu weights {weights!r}: expected one of {CPU_WEIGHTS}")
    if weights == "fp32":
        return model
    linear_kind = Q4 if weights == "int4" else Q8
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if isinstance(child, nn.Linear) and child.in_features % BLOCK == 0:
                new = QuantLinear(
                    child.in_features, child.out_features, linear_kind, child.bias is not None
                )
            elif isinstance(child, nn.Embedding) and child.embedding_dim % BLOCK == 0:
                new = QuantEmbedding(child.num_embeddings, child.embedding_dim, Q8)
            if new is not None:
                setattr(parent, name, new)
    return model


def quant_slots(model: nn.Module) -> dict[str, QuantLinear | QuantEmbedding]:
    """Weight name (``<module>.weight``) → the quantized module that takes it."""
    return {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QUANT_MODULES)}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (quantized blocks counted as stored)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
