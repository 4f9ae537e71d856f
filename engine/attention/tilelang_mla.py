"""MLA on CUDA: decode through the TileLang kernel in ``kernels.mla_decode``.

Same contract as every MLA backend (``engine.attention.base.MLABackend``). A pure-decode
step folds ``W_UK`` into the query, attends over the paged latents with the split-K
kernel and applies ``W_UV`` after (``TorchMLABackend.decode``, whose latent attention this
backend replaces). Prefill, chunked prefill and mixed batches, and caches the kernel does
not take (block sizes that are not a multiple of 64 tokens, latent widths it was not
built for, float32), run the torch paths. No host-device synchronisation: the grid and
the split count come from the metadata's host-side fields, so decode steps capture in
CUDA graphs.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_mla import TorchMLABackend
from kernels.mla_decode import mla_decode, mla_decode_supported


class TileLangMLABackend(TorchMLABackend):
    def attend_latents(
        self, cache: torch.Tensor, query: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        rank = self.mla.kv_lora_rank
        if not mla_decode_supported(query, cache, rank):
            return super().attend_latents(cache, query, meta)
        return mla_decode(
            query.contiguous(),
            cache,
            meta.block_tables.contiguous(),
            meta.seq_lens.contiguous(),
            kv_lora_rank=rank,
            scale=self.scale,
            max_seq_len=meta.max_seq_len,
        )
