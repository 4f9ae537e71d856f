"""KV transports: one contract (``base.KVTransport``), backends chosen by name.

``shm`` (same host, written straight into the receiver's shared-memory cache),
``cuda_ipc`` (workers sharing a GPU: written device to device into the receiver's CUDA
cache through its IPC handle), ``tcp`` (any host: framed, checksummed, back-pressured)
and ``nccl`` (GPU point-to-point, one two-rank group per sender/receiver pair, met
through the receiver's TCPStore).
"""

from __future__ import annotations

from kvstore.transport.base import (
    KVEndpoint,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
    TransferStats,
)

TRANSPORTS: dict[str, str] = {
    "shm": "kvstore.transport.shm:ShmTransport",
    "tcp": "kvstore.transport.tcp:TcpTransport",
    "nccl": "kvstore.transport.nccl:NcclTransport",
    "cuda_ipc": "kvstore.transport.cuda_ipc:CudaIpcTransport",
}


def get_transport(name: str, **options) -> KVTransport:
    """A transport backend by name (imported on first use)."""
    import importlib

    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose from {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


__all__ = [
    "TRANSPORTS", "KVEndpoint", "KVReceiver", "KVSender", "KVTransport", "TransferError",
    "TransferStats", "get_transport",
]  # fmt: skip
