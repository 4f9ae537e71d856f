"""Shared-memory transport (same host): the sender writes straight into the receiver's cache.

The receiving cache lives in a memfd (anonymous shared memory that disappears with its
last user, so a dead process leaks nothing); its endpoint is ``/proc/<pid>/fd/<fd>``.
A sender maps it once and copies the blocks with one gather and one scatter per chunk of
consecutive layers (``layer_chunks``): no staging segment, no bytes on a wire, hence no
checksum. Peer death is detected through the receiver's pid
before and after each transfer; the mapping of a dead peer is dropped. ``forget`` cannot
stop a copy already running: the pairing protocol gives every transfer a deadline after
which the sender does not start it (see ``prefill.worker``).

CPU caches only (GPU memory would need CUDA IPC handles).
"""

from __future__ import annotations

import os

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


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class ShmReceiver(KVReceiver):
    def __init__(self, cache: KVCache, fd: int) -> None:
        self._fd = fd
        path = f"/proc/{os.getpid()}/fd/{fd}"
        self.endpoint = KVEndpoint(
            "shm", path, layout_signature(cache), cache.num_blocks, os.getpid()
        )

    def expect(self, transfer_id: str, dst_block_ids: list[int]) -> None:
        pass  # the sender writes directly; nothing to arm

    def forget(self, transfer_id: str) -> None:
        pass  # cannot stop a direct write: senders honour the transfer deadline instead

    def landed(self, transfer_id: str) -> bool:
        return True  # direct writes are not observed (only this host's processes can map)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmSender(KVSender):
    backend = "shm"

    def __init__(self, cache: KVCache) -> None:
        super().__init__(cache)
        self._maps: dict[str, torch.Tensor] = {}

    def _send(
        self, endpoint: KVEndpoint, transfer_id: str, src: list[int], dst: list[int],
        timeout: float,
    ) -> None:  # fmt: skip
        dest = self._destination(endpoint)
        src_ids = torch.tensor(src, dtype=torch.long)
        dst_ids = torch.tensor(dst, dtype=torch.long)
        for start, end in layer_chunks(self.cache, len(src)):
            part = self.cache.storage[start:end].index_select(1, src_ids)
            dest[start:end].index_copy_(1, dst_ids, part)
        if not pid_alive(endpoint.pid):
            self._drop(endpoint)
            raise TransferError(f"receiver pid {endpoint.pid} died during the transfer")

    def _destination(self, endpoint: KVEndpoint) -> torch.Tensor:
        if not pid_alive(endpoint.pid):
            self._drop(endpoint)
            raise TransferError(f"receiver pid {endpoint.pid} is gone")
        dest = self._maps.get(endpoint.address)
        if dest is None:
            lay = self.cache.layout
            shape = (lay.num_layers, endpoint.num_blocks, lay.block_size, lay.token_width)
            try:
                dest = _map(endpoint.address, shape, lay.dtype)
            except (OSError, RuntimeError) as exc:
                raise TransferError(f"cannot map {endpoint.address}: {exc}") from exc
            self._maps[endpoint.address] = dest
        return dest

    def _drop(self, endpoint: KVEndpoint) -> None:
        self._maps.pop(endpoint.address, None)

    def close(self) -> None:
        self._maps.clear()


class ShmTransport(KVTransport):
    """The secret is not used: only processes of this host that may open another's
    ``/proc/<pid>/fd`` (the same user, or root) can map its cache."""

    name = "shm"

    def __init__(self, secret: str | bytes) -> None:
        super().__init__(secret)
        self._fds: dict[int, int] = {}  # id(cache) -> memfd

    def allocate_cache(
        self, layout: KVCacheLayout, num_blocks: int, device: torch.device | str
    ) -> KVCache:
        if torch.device(device).type != "cpu":
            raise ValueError("the shm KV transport needs a CPU cache; use tcp or nccl on GPU")
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.token_width)
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        fd = os.memfd_create("ferry-kv")
        size = itemsize
        for n in shape:
            size *= n
        os.ftruncate(fd, size)
        storage = _map(f"/proc/self/fd/{fd}", shape, layout.dtype)
        cache = KVCache(layout, num_blocks, device, storage)
        self._fds[id(cache)] = fd
        return cache

    def receiver(self, cache: KVCache, host: str = "127.0.0.1") -> ShmReceiver:
        fd = self._fds.pop(id(cache), None)
        if fd is None:
            raise ValueError("an shm receiver needs a cache from ShmTransport.allocate_cache")
        return ShmReceiver(cache, fd)

    def sender(self, cache: KVCache) -> ShmSender:
        return ShmSender(cache)
