"""Rotary embeddings beyond the Llama family's: YaRN scaling and interleaved pairs.

``RotaryEmbedding`` extends ``engine.models.llama.RotaryEmbedding`` (same cos/sin table,
same rotate-half rotation, the same fused kernel on CUDA) with

- ``scaling.kind == "yarn"``: inverse frequencies blended between extrapolation and
  interpolation by ``factor`` along a linear ramp between the dimensions where
  ``beta_fast`` and ``beta_slow`` rotations fit the original context, and the table scaled
  by the attention factor (``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
  unless given) — transformers' ``_compute_yarn_parameters``, in float32;
- ``interleaved``: the rotary dims pair up as (0, 1), (2, 3), ... as in DeepSeek's
  checkpoints. They are first gathered into halves (evens, then odds), then rotated as
  usual, which is what transformers' ``apply_rotary_pos_emb_interleave`` computes: the
  rotated vector comes out in the gathered order, for queries and keys alike, so their
  dot products are those of the interleaved form.

``softmax_mscale`` is the factor DeepSeek multiplies its softmax scale by, twice, under
YaRN (``mscale_all_dim``).
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling
from engine.models import llama


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times the original."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_mscale(scaling: RopeScaling) -> float:
    """The factor DeepSeek applies to its softmax scale twice (1 without YaRN)."""
    if scaling.kind != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim)


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The magnitude YaRN gives the cos/sin table."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        num = yarn_mscale(scaling.factor, scaling.mscale)
        return num / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN inverse frequencies [head_dim/2], float32."""

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(llama.RotaryEmbedding):
    """Llama's rotary table and rotation, with YaRN and interleaved pairs (module doc)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, max_positions, theta, scaling)
        self.interleaved = interleaved

    def reset_cache(self) -> None:
        if self.scaling.kind != "yarn":
            super().reset_cache()
            return
        device = self.cos_sin.device
        inv_freq = yarn_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.cos_sin = table * yarn_attention_factor(self.scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            q, k = _halves(q), _halves(k)
        return super().forward(positions, q, k)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3), ... gathered as (x0, x2, ..., x1, x3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MRotaryEmbedding(llama.RotaryEmbedding):
    """Qwen2-VL's multimodal RoPE (M-RoPE): three position streams (time, height, width).

    The rotary half of each head splits into ``sections`` (Qwen2.5-VL-7B: 16, 24, 24
    frequency pairs); section i turns with stream ``i % 3``. Positions ``[3, T]`` give
    each token its three streams (``engine.models.qwen2_5_vl.rope_table``: an image's
    tokens sit on its grid, text tokens on the diagonal); positions ``[T]`` mean all three
    equal, which is plain RoPE, so that path (and its CPU and CUDA kernels) is Llama's.
    Same table, same rotate-half rotation as transformers'
    ``Qwen2_5_VLRotaryEmbedding`` + ``apply_rotary_pos_emb``.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        sections: tuple[int, ...],
    ) -> None:
        super().__init__(head_dim, max_positions, theta, scaling)
        if sum(sections) * 2 != head_dim:
            raise ValueError(f"M-RoPE sections {sections} do not cover half of {head_dim}")
        self.sections = tuple(sections)
        self.register_buffer("stream_of_pair", torch.empty(head_dim // 2, dtype=torch.long),
                             persistent=False)  # fmt: skip

    def reset_cache(self) -> None:
        super().reset_cache()
        streams = [torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(self.sections)]
        self.stream_of_pair = torch.cat(streams).to(self.cos_sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        half = self.head_dim // 2
        table = self.cos_sin[positions]  # [3, T, D]: cos half, then sin half, per stream
        pick = self.stream_of_pair.view(1, 1, half).expand(1, table.shape[1], half)
        cos = table[..., :half].gather(0, pick)[0].unsqueeze(1).to(q.dtype)
        sin = table[..., half:].gather(0, pick)[0].unsqueeze(1).to(q.dtype)
        return llama.rotate(q, cos, sin), llama.rotate(k, cos, sin)
