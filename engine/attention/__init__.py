"""Attention backends, chosen by device: TileLang kernels on CUDA, C kernels around torch
SDPA on the CPU (``cpu_backend``), torch SDPA elsewhere."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from engine.attention.cpu_backend import CpuBackend
from engine.attention.tilelang_backend import TileLangBackend
from engine.attention.torch_sdpa import TorchSDPABackend
from kernels import kernels_usable

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchSDPABackend,
    "tilelang": TileLangBackend,
    "cpu": CpuBackend,
}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _BACKENDS[name] = cls


def backend_for(device: str, name: str = "auto") -> type[AttentionBackend]:
    """The backend called ``name``; ``auto`` picks TileLang where its kernels can run and
    the CPU backend on the CPU."""
    if name == "auto":
        if kernels_usable(device):
            name = "tilelang"
        else:
            name = "cpu" if str(device).split(":")[0] == "cpu" else "torch"
    return _BACKENDS[name]


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "backend_for",
    "register_backend",
]
