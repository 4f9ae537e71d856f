"""Multi-head latent attention in torch ops over the paged latent cache (any device).

Same contract as every MLA backend (``engine.attention.base.MLABackend``): store the
step's latents at ``slot_mapping``, then attend each sequence's queries over its whole
context, causally.

- **Prefill** (any step with more than one query for some sequence: prefill, chunked
  prefill, mixed batches) decompresses each sequence's cached latents into per-head keys
  ``[W_UK c, k_pe]`` and values ``W_UV c`` and runs ordinary attention, as transformers
  does: the work is in the queries, and decompressing once per context is cheap beside it.
- **Decode** (one query per sequence) never decompresses: ``W_UK`` is folded into the
  query (``q_nope W_UK`` lives in the latent space), every head attends over the latents
  themselves as one shared key/value head (``[c, k_pe]`` as keys, ``c`` as values), and
  ``W_UV`` maps the result back per head. That reads ``kv_lora_rank + rope`` values per
  cached token instead of ``H * (nope + rope + v)``, which is the point of MLA at decode.
- **Mixed steps**: a sequence with at most ``absorbed_max_query(device)`` new tokens (a
  decode row, a verify chunk, a prompt's short chunk) beside a longer one is attended as
  decode is, each token a row of its own over its context up to itself
  (``AttentionMetadata.token_rows``); only the longer ones decompress. Decompressing costs
  ``H * (nope + v) * R * 2`` FLOPs per context token; the absorbed path costs
  ``H * 2 * (2R - nope - v)`` more than the decompressed one per query and context token,
  so it is cheaper below ``(nope + v) * R / (2R - nope - v)`` queries (DeepSeek-V3: 170).
  Measured (``bench/mla_paths.py``, 128 heads, 1k-16k contexts), absorbed is faster at
  every point up to 64 queries on the CPU (1.6x there) and up to 256 on the H200 (1.4-1.8x
  there: the decompressed path pays for decompressing the whole context however few the
  queries), so those are the caps.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.base import AttentionMetadata, MLABackend
from engine.attention.torch_sdpa import causal, each_sequence, fused, padded_contexts, store_rows

# SDPA's fused backends the CUDA prefill may take: not cuDNN's, which builds an execution
# graph for each new (queries, keys) shape, and nearly every prompt brings one: 0.75-1.2 s
# at 1k tokens, 40 ms at 2-4k, against 0.4-14 ms for flash's first call; flash then runs
# a square 4k at 2.8 ms per layer against cuDNN's 1.3, and a 1k chunk over a 3k context
# at 0.93 against 1.9 (H200, 128 heads; bench/results/sdpa_backends_h200.json)
FUSED_PREFILL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
# a mixed step's sequences with this many new tokens or fewer attend absorbed, by device
# type (bench/results/mla_paths_cpu.json, mla_paths_h200.json)
ABSORBED_MAX_QUERY = {"cpu": 64, "cuda": 256}


def absorbed_max_query(device: torch.device) -> int:
    """How many new tokens a sequence of a mixed step may have to attend absorbed."""
    return ABSORBED_MAX_QUERY.get(device.type, ABSORBED_MAX_QUERY["cpu"])


class TorchMLABackend(MLABackend):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache = self.cache.layers[layer]
        store_rows(cache, meta.slot_mapping, latent)
        if meta.is_pure_decode:
            return self.decode(cache, q, kv_b, meta)
        short = meta.token_rows(absorbed_max_query(q.device))
        out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        if short.meta is not None:
            out[short.rows] = self.decode(cache, q[short.rows], kv_b, short.meta)
        self._decompressed(cache, q, kv_b, meta, out, short.others)
        return out

    def _up_projections(self, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b`` as W_UK [H, nope, R] and W_UV [H, v, R] (views)."""
        mla = self.mla
        per_head = kv_b.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        return per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def decode(
        self, cache: torch.Tensor, q: torch.Tensor, kv_b: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Absorbed attention, one query per sequence (module docstring)."""
        w_uk, w_uv = self._up_projections(kv_b)
        q_nope, q_pe = q.split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk.to(q.dtype))
        query = torch.cat((q_latent, q_pe), dim=-1).to(cache.dtype)  # [B, H, R + rope]
        out = self.attend_latents(cache, query, meta)  # [B, H, R]
        return torch.einsum("bhr,hvr->bhv", out.to(q.dtype), w_uv.to(q.dtype))

    def attend_latents(
        self, cache: torch.Tensor, query: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every head of ``query [B, H, R + rope]`` over its sequence's cached latents as
        one shared key/value head (keys ``[c, k_pe]``, values ``c``) → ``[B, H, R]``. The
        heads go in as the queries of one head, so the latents are read as they are, not
        repeated per head."""
        rows, mask = padded_contexts(cache, meta)  # [B, L, R + rope], [B, 1, 1, L]
        keys = rows.unsqueeze(1)  # [B, 1, L, R + rope]: one head that every query head shares
        values = keys[..., : self.mla.kv_lora_rank]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(1), keys, values, attn_mask=mask, scale=self.scale
        )  # [B, 1, H, R]
        return out.squeeze(1)

    def prefill(
        self, cache: torch.Tensor, q: torch.Tensor, kv_b: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention over decompressed keys and values for every sequence of the step."""
        out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        self._decompressed(cache, q, kv_b, meta, out, range(meta.num_seqs))
        return out

    def _decompressed(
        self, cache: torch.Tensor, q: torch.Tensor, kv_b: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor, seqs: Collection[int],
    ) -> None:  # fmt: skip
        """Attention over decompressed keys and values, sequence by sequence, for the
        sequences ``seqs`` of the step, written into their rows of ``out``.

        On CUDA (a bf16/fp16 cache) in the cache's dtype — the queries can arrive in float32
        from the rotary step — through ``fused`` (SDPA's own causal mask aligned to the last
        key: a chunk after a cached prefix sees the whole prefix) with the values padded
        with zeros to the keys' width: what SDPA's fused kernels take (a 4k-token prefill
        of deepseek-v3-4l spent 268 of its 321 ms in the float32 math kernel), flash's or
        the memory-efficient one (``FUSED_PREFILL``). Elsewhere an
        explicit mask over 3-D operands, which keeps the math kernel (the CPU's fused one
        rounds bf16 further from float32), in blocks of queries (``causal``)."""
        mla = self.mla
        on_cuda = q.is_cuda and cache.dtype in (torch.bfloat16, torch.float16)
        dtype = cache.dtype if on_cuda else q.dtype
        pad = mla.qk_head_dim - mla.v_head_dim if on_cuda else 0
        kv_b = kv_b.to(dtype)
        for tokens, rows, mask in each_sequence(cache, meta, masks=not on_cuda, seqs=seqs):
            c, k_pe = rows.to(dtype).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            kv = F.linear(c, kv_b).unflatten(-1, (self.num_heads, -1))  # [L, H, nope + v]
            k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
            # [H, L, D] each
            operands = [x.transpose(0, 1) for x in (q[tokens].to(dtype), k, F.pad(v, (0, pad)))]
            if on_cuda:
                with sdpa_kernel(FUSED_PREFILL):
                    o = fused(*operands, self.scale)
            else:
                o = causal(*operands, mask, self.scale)  # [H, q_len, D]
            out[tokens] = o[..., : mla.v_head_dim].transpose(0, 1)
