"""The CPU backend: C kernels (``kernels.cpu``) for the KV store and pure decode steps,
torch SDPA (``TorchSDPABackend``) for prefill and wherever the kernels cannot run.

At decode the torch path gathers every context into a padded batch and builds a mask,
per layer and step; the kernel reads the paged cache through the block table instead.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.cpu_kernels import cpu_kernels_for


def _adjacent_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``cat((k, v), 1)`` as a view when v follows k in each row (q/k/v sliced from one
    fused projection), else None."""
    t, width = k.shape[0], k[0].numel()
    if k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1]:
        return None
    if v.data_ptr() != k.data_ptr() + width * k.element_size():
        return None
    return k.as_strided((t, 2 * width), (k.stride(0), 1))


class CpuBackend(TorchSDPABackend):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cache = self.cache.layers[layer]
        cpu = cpu_kernels_for(q)
        if cpu is None or cache.dtype != torch.float32 or k.dtype != torch.float32:
            return super().forward(layer, q, k, v, meta)
        kv = _adjacent_rows(k, v)
        if kv is None:
            kv = torch.cat((k.flatten(1), v.flatten(1)), dim=1)
        cpu.store_kv(kv, cache.view(-1, cache.shape[-1]), meta.slot_mapping)
        if not meta.is_pure_decode:
            return self._varlen(cache, q, meta)
        return self._decode(cache, q, meta)

    def _decode(
        self, cache: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cpu = cpu_kernels_for(q)
        if cpu is None or cache.dtype != torch.float32 or q.dtype != torch.float32:
            return super()._decode(cache, q, meta)
        return cpu.decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, self.num_kv_heads, self.scale
        )
