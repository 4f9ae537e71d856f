"""Attention through torch's scaled_dot_product_attention (any device; CPU's path).

The paged-cache helpers here (store rows at slots, gather a context, the decode batch's
padded contexts, each sequence's context with its causal mask, a long chunk's attention
under that mask) serve every torch backend, GQA and MLA alike: a cache row is one
token's ``token_width`` values whatever they mean.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.attention.base import AttentionBackend, AttentionMetadata


def store_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` [T, token_width] into ``cache`` [blocks, block_size, width] at slots."""
    flat = cache.view(-1, cache.shape[-1])
    flat[slot_mapping] = rows.to(flat.dtype)


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of each table in ``block_table`` [..., blocks]:
    [..., length, token_width]."""
    return cache[block_table].flatten(-3, -2)[..., :length, :]


def padded_contexts(
    cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context padded to the longest: rows [B, L, width] and the mask of
    real rows [B, 1, 1, L] (one query per sequence)."""
    max_blocks = -(-meta.max_seq_len // cache.shape[1])
    rows = gather_rows(cache, meta.block_tables[:, :max_blocks], meta.max_seq_len)
    positions = torch.arange(meta.max_seq_len, device=cache.device)
    mask = (positions[None, :] < meta.seq_lens[:, None])[:, None, None, :]
    return rows, mask


def each_sequence(
    cache: torch.Tensor, meta: AttentionMetadata, masks: bool = True,
    seqs: Collection[int] | None = None,
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor | None]]:  # fmt: skip
    """Per sequence (of ``seqs``, the step's indices, or all): its new tokens' rows in the
    step, its context rows [L, width], and the causal mask [q_len, L] of its queries over
    them (None for a single query, or without ``masks``)."""
    block_size = cache.shape[1]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start += q_len
        if seqs is not None and i not in seqs:
            continue
        num_blocks = -(-seq_len // block_size)
        rows = gather_rows(cache, meta.block_tables[i, :num_blocks], seq_len)
        mask = None
        if q_len > 1 and masks:
            queries = torch.arange(seq_len - q_len, seq_len, device=cache.device)
            mask = queries[:, None] >= torch.arange(seq_len, device=cache.device)[None, :]
        yield slice(start - q_len, start), rows, mask


QUERY_BLOCK = 128  # a chunk of more queries attends by ``fused`` or ``causal``


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of ``q [Hq, Lq, D]`` over ``k``, ``v`` ``[Hkv, L, D]``, the queries the last
    ``Lq`` of ``L`` positions and causal, by SDPA's fused kernel: the key/value heads
    repeated to the query heads (with ``enable_gqa``, or an explicit mask, the CPU computes
    the whole score matrix in its math kernel) and the mask aligned to the last key. On
    the CPU it skips the blocks the mask drops: a 2000-token prompt of the default model
    on two cores ran at 107 tok/s through the math kernel, 195 so
    (``bench.cpu_engine --prefill-len 2000``; transformers' 196 and 193)."""
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    mask = causal_lower_right(q.shape[1], k.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                          scale=scale)[0]  # fmt: skip


def causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scale: float, **sdpa,
) -> torch.Tensor:  # fmt: skip
    """SDPA of ``q [..., Lq, D]`` over ``k``, ``v`` ``[..., L, D]`` under ``mask [Lq, L]``
    (``each_sequence``'s: the queries are the last ``Lq`` of ``L`` positions) in the math
    kernel, where ``fused`` does not serve (another dtype: the CPU's fused kernel rounds
    bf16 further from float32), in blocks of ``QUERY_BLOCK`` positions (counted from the
    sequence's start) each over the keys up to its last: the same sums, without most of
    the score matrix the mask would drop."""
    q_len, seq_len = q.shape[-2], k.shape[-2]
    if mask is None or q_len <= QUERY_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **sdpa)
    past = seq_len - q_len
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    start = 0
    while start < q_len:
        end = min(((past + start) // QUERY_BLOCK + 1) * QUERY_BLOCK, seq_len)  # keys seen
        rows = slice(start, end - past)
        out[..., rows, :] = F.scaled_dot_product_attention(
            q[..., rows, :], k[..., :end, :], v[..., :end, :], attn_mask=mask[rows, :end],
            scale=scale, **sdpa,
        )  # fmt: skip
        start = end - past
    return out


class TorchSDPABackend(AttentionBackend):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cache = self.cache.layers[layer]
        store_rows(cache, meta.slot_mapping, torch.cat((k.flatten(1), v.flatten(1)), dim=1))
        if meta.is_pure_decode:
            return self._decode(cache, q, meta)
        return self._varlen(cache, q, meta)

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., L, width] → k, v [..., Hkv, L, D]."""
        width = self.num_kv_heads * self.head_dim
        k = rows[..., :width].unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = rows[..., width:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def _decode(
        self, cache: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence: gather every context into one padded batch."""
        rows, mask = padded_contexts(cache, meta)
        k, v = self._split(rows)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(k.dtype), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2).to(q.dtype)

    def _varlen(
        self, cache: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Sequences of one new token (decode rows) by ``_decode``, at once; the others one
        by one."""
        out = torch.empty_like(q)
        single = meta.token_rows(1)
        if single.meta is not None:
            out[single.rows] = self._decode(cache, q[single.rows], single.meta)
        for tokens, rows, mask in each_sequence(cache, meta, seqs=single.others):
            k, v = self._split(rows)
            qi = q[tokens].transpose(0, 1).to(k.dtype)  # [Hq, Lq, D]
            if qi.shape[1] > QUERY_BLOCK and k.dtype == torch.float32:
                o = fused(qi, k, v, self.scale)
            else:
                o = causal(qi, k, v, mask, self.scale, enable_gqa=True)
            out[tokens] = o.transpose(0, 1).to(q.dtype)
        return out
