"""Attention backends, chosen by device, cache dtype and attention kind.

Two kinds: ``gqa`` (``AttentionBackend``: per-head k and v in the cache; TileLang kernels
on CUDA for bf16/fp16 caches, torch SDPA for a float32 cache on CUDA, C kernels around
torch SDPA on the CPU (``cpu_backend``), torch SDPA elsewhere)
and ``mla`` (``MLABackend``: one latent per token; the TileLang decode kernel on CUDA,
torch ops for everything else). ``build_backend`` reads which kind a model needs from its
config.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, MLABackend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.tilelang_backend import TileLangBackend
from engine.attention.tilelang_mla import TileLangMLABackend
from engine.attention.torch_mla import TorchMLABackend
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.config import ModelConfig
from kernels import ATTENTION_DTYPES, kernels_usable
from kvstore.layout import KVCache

log = logging.getLogger("ferry.attention")

_BACKENDS: dict[str, dict[str, type]] = {
    "gqa": {"torch": TorchSDPABackend, "tilelang": TileLangBackend, "cpu": CpuBackend},
    "mla": {"torch": TorchMLABackend, "tilelang": TileLangMLABackend},
}


def register_backend(name: str, cls: type, kind: str = "gqa") -> None:
    _BACKENDS[kind][name] = cls


def backend_for(
    device: str, name: str = "auto", kind: str = "gqa", dtype: torch.dtype | None = None
) -> type:
    """The ``kind`` backend called ``name``; ``auto`` picks TileLang where its kernels can
    run (CUDA, and for ``gqa`` a bf16/fp16 cache: ``dtype``, None for unknown), the CPU
    backend on the CPU, torch otherwise (each where one is registered for ``kind``)."""
    backends = _BACKENDS[kind]
    if name == "auto":
        on_cpu = str(device).split(":")[0] == "cpu"
        if "tilelang" in backends and kernels_usable(device):
            if kind == "gqa" and dtype is not None and dtype not in ATTENTION_DTYPES:
                log.info("attention runs through torch SDPA on %s: the TileLang kernels take "
                         "bf16 or fp16, the KV cache is %s", device, dtype)  # fmt: skip
                return backends["torch"]
            name = "tilelang"
        else:
            name = "cpu" if on_cpu and "cpu" in backends else "torch"
    return backends[name]


def build_backend(
    cache: KVCache, config: ModelConfig, scale: float, device: str, name: str = "auto"
) -> AttentionBackend | MLABackend:
    """The backend a model of ``config`` attends through, over ``cache``."""
    if config.mla is not None:
        return backend_for(device, name, "mla")(cache, config.num_heads, config.mla, scale)
    cls = backend_for(device, name, "gqa", cache.layout.dtype)
    return cls(cache, config.num_heads, config.num_kv_heads, config.head_dim, scale)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "MLABackend",
    "backend_for",
    "build_backend",
    "register_backend",
]
