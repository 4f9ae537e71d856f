"""FP8 block-quantized checkpoints (DeepSeek-V3's own format), dequantized at load.

Such a checkpoint's ``config.json`` says ``"quantization_config": {"quant_method": "fp8",
"fmt": "e4m3", "weight_block_size": [128, 128], ...}``. Each quantized linear weight
``X.weight`` [rows, cols] is stored as ``float8_e4m3fn`` beside ``X.weight_scale_inv``
[ceil(rows / 128), ceil(cols / 128)] float32, and the real weight is their product per
block: ``W[i, j] = X.weight[i, j] * X.weight_scale_inv[i // 128, j // 128]`` (DeepSeek's
``weight_dequant``; the last blocks of a dimension may be partial). Everything else
(embeddings, norms, the routers, the output head) is stored unquantized.

``dequantize_fp8`` turns the checkpoint's tensor stream into plain float32 weights under
the names the model expects; the model's ``load_weights`` casts them to the serving
dtype. A weight and its scale may come in either order, from different files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def fp8_block_size(quantization: dict[str, Any]) -> tuple[int, int]:
    """The (rows, cols) block of a ``quantization_config``; ``NotImplementedError`` for
    any scheme but block-scaled FP8 e4m3."""
    method = quantization.get("quant_method")
    block = quantization.get("weight_block_size")
    if method != "fp8" or quantization.get("fmt", "e4m3") != "e4m3" or not block:
        raise NotImplementedError(f"quantization {quantization!r}: only block-scaled FP8 e4m3")
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``weight`` [rows, cols] (FP8) times its per-block ``scale_inv``, in float32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale {tuple(scale_inv.shape)} for weight {(rows, cols)}: {expected}")
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * scale[:rows, :cols]


def dequantize_fp8(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every FP8 tensor replaced by its dequantized float32 value and
    the scales consumed; ``ValueError`` at the end if a weight or a scale lacks its
    partner."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in waiting_weights:
                yield base, dequantize_block_fp8(waiting_weights.pop(base), tensor, block)
            else:
                waiting_scales[base] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in waiting_scales:
                yield name, dequantize_block_fp8(tensor, waiting_scales.pop(name), block)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights or waiting_scales:
        unpaired = sorted(waiting_weights) + [n + SCALE_SUFFIX for n in sorted(waiting_scales)]
        raise ValueError(f"FP8 weights and scales without their partner: {unpaired[:8]}")
