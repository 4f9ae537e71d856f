"""Attention backend contract and the per-step forward context.

A model's attention layer computes q, k, v (and applies RoPE), then calls
``ctx.attention(layer, q, k, v)``. The backend writes the new tokens' k and v into the
paged cache at ``slot_mapping`` and attends each sequence's queries over its whole
context (cached prefix + new tokens), causally. Backends are chosen by device through
the registry in ``engine.attention``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvstore.layout import KVCache


@dataclass
class AttentionMetadata:
    """Where the step's tokens sit. B sequences, T new tokens in all.

    Sequence i owns new tokens ``query_start_loc[i]:query_start_loc[i+1]``; its context
    after this step is ``seq_lens[i]`` tokens, the last of which are the new ones.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Paged attention over a ``KVCache`` with components ``k`` and ``v``."""

    def __init__(
        self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ):
        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] → output [T, Hq, D]; stores k, v in the cache."""


@dataclass
class ForwardContext:
    """Everything a model forward needs besides its inputs; built per step, never global."""

    meta: AttentionMetadata
    backend: AttentionBackend

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)
