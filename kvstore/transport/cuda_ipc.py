"""CUDA IPC transport (workers sharing a GPU): the sender writes straight into the receiver's
GPU cache, device to device.

The receiving cache is an ordinary CUDA allocation. Its endpoint carries the CUDA IPC
handle of that allocation, exported once (``UntypedStorage._share_cuda_``: what
``torch.multiprocessing`` sends for a CUDA tensor), as base64 JSON in ``address``. A
sender opens it once per receiver (``UntypedStorage._new_shared_cuda``) and moves each
chunk of consecutive layers (``layer_chunks``) with one gather and one scatter on the
sender's side stream (which waits for the prefill that wrote the source blocks:
``KVSender.send``), then waits for the copy: ``send`` returns once every byte is in place.
No staging through host memory and no bytes on a wire, hence no checksum. Peer death is
detected through the receiver's pid before and after each transfer, as shm does, and the
mapping of a dead peer is dropped; its memory stays allocated until the last importer
lets go, so a write racing the death lands in a dead allocation, never in another
process's. ``forget`` cannot stop a copy already running: senders honour the transfer
deadline of the pairing protocol instead (``prefill.worker``), as with shm.

A process cannot open its own IPC handle, so a sender in the receiver's own process
writes through the receiver's tensor, found by address in a process-local table. The
secret is not used: opening the handle needs the same host and access to the GPU.
"""

from __future__ import annotations

import base64
import json
import os
import threading

import torch

from kvstore.layout import KVCache, KVCacheLayout
from kvstore.procs import pid_alive
from kvstore.transport.base import (
    KVEndpoint,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
    layer_chunks,
    layout_signature,
)

_PREFIX = "cuda-ipc:"
_LOCAL: dict[str, torch.Tensor] = {}  # address -> the receiving storage, in its own process
_LOCAL_LOCK = threading.Lock()


def export_handle(storage: torch.Tensor) -> str:
    """The endpoint address of ``storage`` (a contiguous CUDA tensor): its IPC handle."""
    if storage.storage_offset() or not storage.is_contiguous():
        raise ValueError("a cuda_ipc cache must be a whole, contiguous tensor")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = (
        storage.untyped_storage()._share_cuda_()
    )
    fields = [device, _b64(handle), size, offset, _b64(ref_handle), ref_offset, _b64(event), sync]
    return _PREFIX + base64.b64encode(json.dumps(fields).encode()).decode()


def open_handle(address: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``export_handle`` exported, mapped into this process."""
    if not address.startswith(_PREFIX):
        raise ValueError(f"not a cuda_ipc address: {address[:40]!r}")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = json.loads(
        base64.b64decode(address[len(_PREFIX) :])
    )
    storage = torch.UntypedStorage._new_shared_cuda(
        device, _unb64(handle), size, offset, _unb64(ref_handle), ref_offset, _unb64(event), sync
    )
    return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(storage, 0, shape)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class CudaIpcReceiver(KVReceiver):
    def __init__(self, cache: KVCache) -> None:
        address = export_handle(cache.storage)
        self.endpoint = KVEndpoint(
            "cuda_ipc", address, layout_signature(cache), cache.num_blocks, os.getpid()
        )
        with _LOCAL_LOCK:
            _LOCAL[address] = cache.storage

    def expect(self, transfer_id: str, dst_block_ids: list[int]) -> None:
        pass  # the sender writes directly; nothing to arm

    def forget(self, transfer_id: str) -> None:
        pass  # cannot stop a direct write: senders honour the transfer deadline instead

    def landed(self, transfer_id: str) -> bool:
        return True  # direct writes are not observed (only this host's GPU users can map)

    def close(self) -> None:
        with _LOCAL_LOCK:
            _LOCAL.pop(self.endpoint.address, None)


class CudaIpcSender(KVSender):
    backend = "cuda_ipc"

    def __init__(self, cache: KVCache) -> None:
        super().__init__(cache)
        if not cache.storage.is_cuda:
            raise ValueError("a cuda_ipc sender needs a CUDA cache")
        self._maps: dict[str, torch.Tensor] = {}

    def _send(
        self, endpoint: KVEndpoint, transfer_id: str, src: list[int], dst: list[int],
        timeout: float,
    ) -> None:  # fmt: skip
        dest = self._destination(endpoint)
        source = self.cache.storage
        src_ids = torch.tensor(src, dtype=torch.long).to(source.device, non_blocking=True)
        dst_ids = torch.tensor(dst, dtype=torch.long).to(dest.device, non_blocking=True)
        for start, end in layer_chunks(self.cache, len(src)):
            part = source[start:end].index_select(1, src_ids)
            dest[start:end].index_copy_(1, dst_ids, part.to(dest.device, non_blocking=True))
        torch.cuda.current_stream(source.device).synchronize()
        if not pid_alive(endpoint.pid):
            self._maps.pop(endpoint.address, None)
            raise TransferError(f"receiver pid {endpoint.pid} died during the transfer")

    def _destination(self, endpoint: KVEndpoint) -> torch.Tensor:
        if not pid_alive(endpoint.pid):
            self._maps.pop(endpoint.address, None)
            raise TransferError(f"receiver pid {endpoint.pid} is gone")
        dest = self._maps.get(endpoint.address)
        if dest is None:
            with _LOCAL_LOCK:
                dest = _LOCAL.get(endpoint.address)
            if dest is None:
                lay = self.cache.layout
                shape = (lay.num_layers, endpoint.num_blocks, lay.block_size, lay.token_width)
                try:
                    dest = open_handle(endpoint.address, shape, lay.dtype)
                except (ValueError, RuntimeError) as exc:
                    raise TransferError(
                        f"cannot open the receiver's CUDA IPC handle: {exc}"
                    ) from exc
            self._maps[endpoint.address] = dest
        return dest

    def close(self) -> None:
        self._maps.clear()


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def allocate_cache(
        self, layout: KVCacheLayout, num_blocks: int, device: torch.device | str
    ) -> KVCache:
        if torch.device(device).type != "cuda":
            raise ValueError("the cuda_ipc KV transport needs a CUDA cache; use shm on the CPU")
        return KVCache(layout, num_blocks, device)

    def receiver(self, cache: KVCache, host: str = "127.0.0.1") -> CudaIpcReceiver:
        return CudaIpcReceiver(cache)

    def sender(self, cache: KVCache) -> CudaIpcSender:
        return CudaIpcSender(cache)
