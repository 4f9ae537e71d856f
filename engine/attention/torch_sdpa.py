"""Attention through torch's scaled_dot_product_attention (any device; CPU's path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchSDPABackend(AttentionBackend):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cache = self.cache.layers[layer]
        flat = cache.view(-1, cache.shape[-1])
        flat[meta.slot_mapping] = torch.cat((k.flatten(1), v.flatten(1)), dim=1).to(flat.dtype)
        if meta.is_pure_decode:
            return self._decode(cache, q, meta)
        return self._varlen(cache, q, meta)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, length: int):
        width = self.num_kv_heads * self.head_dim
        kv = cache[block_table].flatten(-3, -2)[..., :length, :]  # [..., L, token_width]
        k = kv[..., :width].unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = kv[..., width:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k.transpose(-3, -2), v.transpose(-3, -2)  # [..., Hkv, L, D]

    def _decode(
        self, cache: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence: gather every context into one padded batch."""
        max_blocks = -(-meta.max_seq_len // cache.shape[1])
        k, v = self._gather(cache, meta.block_tables[:, :max_blocks], meta.max_seq_len)
        positions = torch.arange(meta.max_seq_len, device=q.device)
        mask = (positions[None, :] < meta.seq_lens[:, None])[:, None, None, :]  # [B,1,1,L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(k.dtype), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2).to(q.dtype)

    def _varlen(
        self, cache: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = cache.shape[1]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            num_blocks = -(-seq_len // block_size)
            k, v = self._gather(cache, meta.block_tables[i, :num_blocks], seq_len)
            qi = q[start : start + q_len].transpose(0, 1).to(k.dtype)  # [Hq, Lq, D]
            mask = None
            if q_len > 1:
                rows = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = rows[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
            start += q_len
        return out
