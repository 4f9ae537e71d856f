"""Attention on CUDA through the TileLang kernels in ``kernels/``.

Same contract as every backend (``engine.attention.base``): store the step's k and v at
``slot_mapping``, then attend each sequence's queries over its whole context, causally.
A pure-decode step (one query per sequence) goes to the split-K paged decode kernel;
prefill and chunked prefill to the varlen prefill kernel. A mixed step splits: its decode
rows go to the decode kernel and its longer chunks to the prefill kernel
(``AttentionMetadata.token_rows`` / ``sequences``) — in the prefill kernel a decode row
fills one row of a 64-row query tile and its heads read their KV head each on their own,
which took a step of 32 decode rows (1k contexts) beside a 32-token prompt chunk 10.5 ms
on an H200 at the 8B shape against 5.7 ms for the chunk alone. No host-device
synchronisation: the kernels' grids are sized from the metadata's host-side fields.
Each kernel's checks, split count and workspaces are done once a step, kept with its
metadata (``AttentionMetadata.derived``), so that a layer costs a kernel call: an eager
step's attention is issued from the host layer by layer, also between the piecewise
graphs of a step with prefill.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels.norm_rope_cache import write_kv_cache
from kernels.paged_decode_attention import PagedDecodeStep
from kernels.prefill_attention import PrefillAttentionStep
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
        if meta.is_pure_decode:
            return self._decode(cache, query, meta).to(q.dtype)
        split = meta.token_rows(1)
        if split.meta is None:  # no decode row beside the chunks
            return self._prefill(cache, query, meta).to(q.dtype)
        rows, chunks = meta.sequences(split.others)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        n = split.leading
        if n:  # the decode rows come first (the scheduler's order): each part into its rows
            self._decode(cache, query[:n], split.meta, out[:n])
            self._prefill(cache, query[n:], chunks, out[n:])
            return out.to(q.dtype)
        out[split.rows] = self._decode(cache, query[split.rows], split.meta)
        out[rows] = self._prefill(cache, query[rows], chunks)
        return out.to(q.dtype)

    def _decode(self, cache: torch.Tensor, query: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """One query per sequence (``query`` may be a strided slice of the qkv
        projection); the kernel's checks and workspaces once a step (``PagedDecodeStep``)."""
        step = meta.derived((self, "decode"), lambda: PagedDecodeStep(
            query, cache, meta.block_tables.contiguous(), meta.seq_lens.contiguous(),
            num_kv_heads=self.num_kv_heads, scale=self.scale, max_seq_len=meta.max_seq_len,
        ))  # fmt: skip
        return step(query, cache, out)

    def _prefill(self, cache: torch.Tensor, query: torch.Tensor, meta: AttentionMetadata,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        query = query.contiguous()
        step = meta.derived((self, "prefill"), lambda: PrefillAttentionStep(
            query, cache, meta.block_tables.contiguous(), meta.seq_lens.contiguous(),
            meta.query_start_loc.contiguous(), max_query_len=meta.max_query_len,
            num_kv_heads=self.num_kv_heads, scale=self.scale,
        ))  # fmt: skip
        return step(query, cache, out)
