"""What one token's KV looks like, independent of how a model produces it.

The cache is described by a layout object, not hard-coded as (layers, 2, heads, dim):
a GQA model stores components ``k`` and ``v`` of shape (kv_heads, head_dim); an MLA
model stores one ``latent`` (kv_lora_rank + rope_dim). Storage is one tensor per layer,
``[num_blocks, block_size, token_width]``; components are views into it, so a block is
one contiguous run of bytes per layer whatever it holds, which is what transports move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVComponent:
    name: str
    shape: tuple[int, ...]  # per token, per layer

    @property
    def width(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    block_size: int
    components: tuple[KVComponent, ...]
    dtype: torch.dtype

    @classmethod
    def for_attention(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> KVCacheLayout:
        shape = (num_kv_heads, head_dim)
        return cls(
            num_layers, block_size, (KVComponent("k", shape), KVComponent("v", shape)), dtype
        )

    @classmethod
    def for_mla(
        cls, num_layers: int, latent_dim: int, rope_dim: int, block_size: int, dtype: torch.dtype
    ) -> KVCacheLayout:
        return cls(
            num_layers, block_size, (KVComponent("latent", (latent_dim + rope_dim,)),), dtype
        )

    @property
    def token_width(self) -> int:
        return sum(c.width for c in self.components)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.block_size * self.token_width * itemsize

    def offset(self, name: str) -> tuple[int, KVComponent]:
        start = 0
        for comp in self.components:
            if comp.name == name:
                return start, comp
            start += comp.width
        raise KeyError(name)


class KVCache:
    """The allocated cache: per-layer tensors laid out as ``layout`` says.

    Block 0 is the null block: never handed out, it absorbs writes of padded slots.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_blocks: int,
        device: torch.device | str,
        storage: torch.Tensor | None = None,
    ) -> None:
        """``storage``: a zeroed ``[num_layers, num_blocks, block_size, token_width]`` tensor
        to live in (e.g. shared memory a KV transport writes into); allocated if absent."""
        self.layout = layout
        self.num_blocks = num_blocks
        if storage is None:
            storage = torch.zeros(self.shape, dtype=layout.dtype, device=device)
        if tuple(storage.shape) != self.shape or storage.dtype != layout.dtype:
            raise ValueError(f"KV storage {tuple(storage.shape)} does not match {self.shape}")
        self.storage = storage
        self.layers = list(storage.unbind(0))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        lay = self.layout
        return (lay.num_layers, self.num_blocks, lay.block_size, lay.token_width)

    def component(self, layer: int, name: str) -> torch.Tensor:
        """View ``[num_blocks, block_size, *shape]`` of one component of one layer."""
        start, comp = self.layout.offset(name)
        raw = self.layers[layer][..., start : start + comp.width]
        return raw.unflatten(-1, comp.shape)
