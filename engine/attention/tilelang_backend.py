"""Attention on CUDA through the TileLang kernels in ``kernels/``.

Same contract as every backend (``engine.attention.base``): store the step's k and v at
``slot_mapping``, then attend each sequence's queries over its whole context, causally.
A pure-decode step (one query per sequence) goes to the split-K paged decode kernel;
anything else (prefill, chunked prefill, mixed batches) to the varlen prefill kernel,
which treats decode rows as chunks of length one. No host-device synchronisation: the
kernels' grids are sized from the metadata's host-side fields.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels.norm_rope_cache import write_kv_cache
from kernels.paged_decode_attention import paged_decode_attention
from kernels.prefill_attention import prefill_attention
from kvstore.layout import KVCache

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class TileLangBackend(AttentionBackend):
    """Paged attention with TileLang kernels; needs a CUDA cache of bf16 or fp16."""

    def __init__(
        self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ):
        super().__init__(cache, num_heads, num_kv_heads, head_dim, scale)
        names = tuple(c.name for c in cache.layout.components)
        if names != ("k", "v"):
            raise ValueError(f"TileLangBackend needs components ('k', 'v'), got {names}")
        if cache.layout.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"TileLangBackend needs bf16 or fp16, not {cache.layout.dtype}")

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cache = self.cache.layers[layer]
        slots = meta.slot_mapping.contiguous()
        write_kv_cache(k.to(cache.dtype), v.to(cache.dtype), cache, slots)
        query = q.to(cache.dtype)
        tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        if meta.is_pure_decode:  # takes q as a strided slice of the qkv projection
            out = paged_decode_attention(
                query,
                cache,
                tables,
                seq_lens,
                num_kv_heads=self.num_kv_heads,
                scale=self.scale,
                max_seq_len=meta.max_seq_len,
            )
        else:
            out = prefill_attention(
                query.contiguous(),
                cache,
                tables,
                seq_lens,
                meta.query_start_loc.contiguous(),
                max_query_len=meta.max_query_len,
                num_kv_heads=self.num_kv_heads,
                scale=self.scale,
            )
        return out.to(q.dtype)
