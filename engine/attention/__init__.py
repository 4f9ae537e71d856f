"""Attention backends, chosen by device. CUDA kernels register here when present."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from engine.attention.torch_sdpa import TorchSDPABackend

_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchSDPABackend}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _BACKENDS[name] = cls


def backend_for(device: str, name: str = "auto") -> type[AttentionBackend]:
    if name == "auto":
        name = "torch"
    return _BACKENDS[name]


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "backend_for",
    "register_backend",
]
