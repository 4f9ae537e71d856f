"""Attention backend contracts and the per-step forward context.

A GQA model's attention layer computes q, k, v (and applies RoPE), then calls
``ctx.attention(layer, q, k, v)``. The backend writes the new tokens' k and v into the
paged cache at ``slot_mapping`` and attends each sequence's queries over its whole
context (cached prefix + new tokens), causally.

An MLA model's layer calls ``ctx.mla_attention(layer, q, latent, kv_b)`` instead
(``MLABackend``): the cache holds one latent per token and the backend decides how to
attend over it. Backends are chosen by device and attention kind through the registry in
``engine.attention``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.config import MLAConfig
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

    @classmethod
    def empty(cls, device: torch.device | str) -> AttentionMetadata:
        """A step of no sequences and no tokens (an idle expert-parallel rank's forward)."""
        return cls(
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            max_query_len=0, max_seq_len=0, query_lens_cpu=[], seq_lens_cpu=[],
        )  # fmt: skip

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


class MLABackend(ABC):
    """Multi-head latent attention over a ``KVCache`` with the one component ``latent``.

    Per token and layer the cache holds ``latent = [c, k_pe]``: the normalised compressed
    KV ``c`` (``kv_lora_rank``) and the rotated key ``k_pe`` (``qk_rope_head_dim``) that
    every head shares. Head h's key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``,
    where ``kv_b`` (the model's ``kv_b_proj`` weight, [H * (nope + v), kv_lora_rank]) stacks
    ``W_UK[h]`` (nope rows) over ``W_UV[h]`` (v rows) for each head in turn. A backend may
    decompress keys and values (prefill) or fold ``W_UK`` into the query and apply ``W_UV``
    after attending over the latents themselves (decode); the result is the same.
    """

    def __init__(self, cache: KVCache, num_heads: int, mla: MLAConfig, scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.mla = mla
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, nope + rope] (rotary part rotated), latent: [T, kv_lora_rank + rope]
        → output [T, H, v_head_dim]; stores the latents in the cache."""


@dataclass
class ForwardContext:
    """Everything a model forward needs besides its inputs; built per step, never global.

    ``backend`` is the kind the model's attention asks for: an ``AttentionBackend`` for
    ``attention``, an ``MLABackend`` for ``mla_attention``."""

    meta: AttentionMetadata
    backend: AttentionBackend | MLABackend

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if not q.shape[0]:  # a forward over no tokens (an idle expert-parallel rank)
            return q.new_empty(q.shape)
        return self.backend.forward(layer, q, k, v, self.meta)

    def mla_attention(
        self, layer: int, q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor
    ) -> torch.Tensor:
        if not q.shape[0]:
            return q.new_empty(0, q.shape[1], self.backend.mla.v_head_dim)
        return self.backend.forward(layer, q, latent, kv_b, self.meta)
