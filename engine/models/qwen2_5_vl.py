"""Qwen2.5-VL: a ViT with window attention and 2x2 patch merging in front of Qwen2 with
M-RoPE.

**The vision tower** (``VisionTransformer``, transformers'
``Qwen2_5_VisionTransformerPretrainedModel``). The image processor (transformers' own,
``engine.vision``) cuts an image into ``patch_size`` patches, each flattened over
(channel, time, row, column), ordered block-major over ``spatial_merge_size`` squares.
The tower embeds each patch (the checkpoint's Conv3d is one product per patch here), then
reorders the patches window by window (windows of ``window_size`` pixels, so that a
window's patches are contiguous), and runs ``depth`` pre-norm blocks: attention with a 2D
rotary embedding (height and width, a quarter of the head each, rotate-half) inside each
window, or inside each whole image on ``fullatt_block_indexes``, and a SwiGLU MLP with
biases. The merger (RMSNorm, then an MLP over each 2x2 square of patches) makes one
language-model token per square; the window order is undone at the end. Attention runs
over equal-length segments stacked into one batch (torch SDPA), one call per distinct
length.

**The language model** is the Llama family's Qwen2 (biased q/k/v), with
``MRotaryEmbedding`` and ``rope_table``: text tokens sit on the diagonal of three
position streams (time, height, width), an image's tokens on its grid
(``t``, ``offset + row``, ``offset + column``), and the text after an image goes on from
the largest position so far + 1 — transformers' ``get_rope_index``. An image's
placeholder tokens get the tower's outputs as their embeddings (``Spliced``).

Weights load under the checkpoint's names (``model.layers.*``, ``visual.*``,
``lm_head.weight``; also transformers 5's ``model.language_model.*`` / ``model.visual.*``).
A model built without its tower (``build_model(..., vision=False)``: a worker whose
images are encoded elsewhere) skips the tower's weights; ``VisionTransformer`` alone is
what an encode worker runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, VisionConfig
from engine.models.base import CausalLM, RopeTable
from engine.models.decoder import DecoderModel, lm_head
from engine.models.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm, rotate
from engine.models.rotary import MRotaryEmbedding

if TYPE_CHECKING:
    from engine.messages import MediaItem

VISUAL_PREFIX = "visual."
_RENAMES = (("model.language_model.", "model."), ("model.visual.", VISUAL_PREFIX))


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in the original Qwen2.5-VL layout."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


# ---- positions -------------------------------------------------------------------------------


def rope_table(num_tokens: int, media: Sequence[MediaItem], merge: int) -> RopeTable:
    """The M-RoPE positions [3, num_tokens] of a prompt with images ``media`` (by offset),
    as transformers' ``get_rope_index`` lays them out for still images."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor = position = 0
    for item in sorted(media, key=lambda m: m.offset):
        text = item.offset - cursor
        out[:, cursor : item.offset] = np.arange(position, position + text)
        position += text
        t, h, w = item.grid[0], item.grid[1] // merge, item.grid[2] // merge
        if t * h * w != item.length:
            raise ValueError(f"an image of grid {item.grid} has {t * h * w} tokens, "
                             f"not {item.length}")  # fmt: skip
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, item.offset : item.end] = np.stack([tt, hh, ww]).reshape(3, -1) + position
        position += max(h, w)
        cursor = item.end
    out[:, cursor:] = np.arange(position, position + num_tokens - cursor)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return RopeTable(out, delta, cursor)


# ---- the vision tower ----------------------------------------------------------------------


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # rotated in float32, as transformers does
        q = rotate(q.float(), cos, sin).to(v.dtype)
        k = rotate(k.float(), cos, sin).to(v.dtype)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size**2
        self.width = width
        self.ln_q = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = nn.ModuleList(
            [Linear(width, width, bias=True), nn.GELU(), Linear(width, config.out_hidden_size)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class Segments:
    """Runs of consecutive rows that attend only among themselves (windows, or whole
    images), grouped by length: each group is one batched SDPA call."""

    def __init__(self, bounds: Sequence[int], device: torch.device) -> None:
        starts, lengths = np.asarray(bounds[:-1]), np.diff(bounds)
        self.groups = []
        for length in np.unique(lengths[lengths > 0]):
            first = starts[lengths == length]
            rows = (first[:, None] + np.arange(length)).reshape(-1)
            index = torch.from_numpy(rows).to(device)
            self.groups.append((len(first), int(length), index))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of ``q`` [N, H, D] over ``k``/``v`` within each segment."""
        out = torch.empty_like(q)
        for count, length, index in self.groups:
            parts = [t.index_select(0, index).view(count, length, *t.shape[1:]).transpose(1, 2)
                     for t in (q, k, v)]  # fmt: skip
            done = F.scaled_dot_product_attention(*parts)  # [count, H, length, D]
            out.index_copy_(0, index, done.transpose(1, 2).reshape(-1, *q.shape[1:]))
        return out


class VisionTransformer(nn.Module):
    """The tower and its merger: patches [N, patch_width] of images with ``grids``
    (t, h, w in patches, block-major as the processor emits them) → one embedding per
    merged square [N / merge**2, out_hidden_size], images in order."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = Linear(config.patch_width, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        quarter = config.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponents, persistent=False)

    def reset_cache(self) -> None:
        """Recompute the rotary frequencies on the buffer's device (after allocation)."""
        quarter = self.config.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        inv = 1.0 / self.config.rope_theta**exponents
        self.inv_freq = inv.to(self.inv_freq.device)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        cfg = self.config
        unit = cfg.spatial_merge_size**2
        order, windows, images = _layout(grids, cfg)
        device = self.device
        order_t = torch.from_numpy(order).to(device)
        x = self.patch_embed(pixels.to(device, self.dtype))
        x = x.view(-1, unit, x.shape[-1])[order_t].reshape(-1, x.shape[-1])
        hw = torch.from_numpy(_patch_positions(grids, cfg.spatial_merge_size)).to(device)
        hw = hw.view(-1, unit, 2)[order_t].reshape(-1, 2)
        angles = (hw[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        by_window, by_image = Segments(windows, device), Segments(images, device)
        for i, block in enumerate(self.blocks):
            segments = by_image if i in cfg.fullatt_block_indexes else by_window
            x = block(x, cos, sin, segments)
        merged = self.merger(x)
        return merged[torch.from_numpy(np.argsort(order)).to(device)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the tower's tensors in (names without ``visual.``; the patch Conv3d's
        weight is read as the matrix it is). Raises ``KeyError`` for a name the tower does
        not have, ``ValueError`` for a wrong shape or a weight left unset."""
        params = dict(self.named_parameters())
        filled = set()
        for name, tensor in weights:
            if name == "patch_embed.proj.weight":  # Conv3d [out, C, T, P, P] over one patch
                name, tensor = "patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
            if name not in params:
                raise KeyError(f"unexpected vision weight {name!r}")
            dest = params[name]
            if dest.shape != tensor.shape:
                raise ValueError(f"visual.{name}: shape {tuple(tensor.shape)} != "
                                 f"{tuple(dest.shape)}")  # fmt: skip
            dest.copy_(tensor)
            filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"vision weights not loaded: {missing[:8]}")

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Norms 1, biases 0, the rest N(0, std), in place on the tower's device."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)


def _patch_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> np.ndarray:
    """(row, column) of every patch [N, 2], block-major over merge x merge squares."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def _layout(
    grids: Sequence[tuple[int, int, int]], cfg: VisionConfig
) -> tuple[np.ndarray, list[int], list[int]]:
    """The merged squares in window order (``order``: square indices), the window bounds
    and the image (frame) bounds in patch rows, as transformers'
    ``get_vision_window_index`` and ``get_vision_cu_seqlens`` compute them."""
    merge, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
    side = cfg.window_size // merge // cfg.patch_size  # merged squares per window side
    order, windows, images = [], [0], [0]
    base = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        tiles = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4)
        tiles = tiles.reshape(t, nh * nw, side * side)
        for frame in tiles:
            for tile in frame:
                kept = tile[tile >= 0]
                if len(kept):
                    order.append(kept + base)
                    windows.append(windows[-1] + len(kept) * unit)
        for _ in range(t):
            images.append(images[-1] + h * w)
        base += t * gh * gw
    return np.concatenate(order), windows, images


# ---- the model -------------------------------------------------------------------------------


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL: ``LlamaForCausalLM``'s decoder (Qwen2) with M-RoPE, and ``visual``, the
    tower (None when built without it)."""

    def __init__(self, config: ModelConfig) -> None:
        CausalLM.__init__(self)  # the rotary is this model's, not Llama's
        if config.vision is None or not config.mrope_section:
            raise ValueError("Qwen2.5-VL needs a vision config and M-RoPE sections")
        self.config = config
        rotary = MRotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, config.mrope_section,
        )  # fmt: skip
        self.model = DecoderModel(config, rotary, lambda i: LlamaDecoderLayer(config, i, rotary))
        self.lm_head = lm_head(config)
        self.visual: VisionTransformer | None = VisionTransformer(config.vision)

    def rope_table(self, num_prompt_tokens: int, media: Sequence[MediaItem]) -> RopeTable | None:
        if not media:
            return None
        assert self.config.vision is not None
        return rope_table(num_prompt_tokens, media, self.config.vision.spatial_merge_size)

    def weight_targets(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith(VISUAL_PREFIX)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors as ``LlamaForCausalLM`` loads them, the tower's
        into ``visual`` (skipped when the model has none)."""
        tower: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = canonical_name(name)
                if not name.startswith(VISUAL_PREFIX):
                    yield name, tensor
                elif self.visual is not None:
                    tower.append((name[len(VISUAL_PREFIX) :], tensor))

        super().load_weights(text())
        if self.visual is not None:
            self.visual.load_weights(tower)
