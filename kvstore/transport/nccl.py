"""NCCL transport (GPU to GPU): a TCP control connection plus point-to-point NCCL data.

Each (sender, receiver) pair forms its own two-rank process group — sender rank 0,
receiver rank 1 — through the receiver's ``TCPStore`` under a ``PrefixStore`` named by
the pair, so prefill and decode pools grow and shrink without one global world and
without ``init_process_group``. Per transfer the sender writes a ``HEAD`` frame on the
control connection (transfer id, destination block ids, layer count), then sends the
gathered blocks in chunks of consecutive layers (``chunks``: up to ``CHUNK_BYTES`` each,
so a small transfer is one NCCL op and a large one streams layer group by layer group);
the receiver ``recv``s each chunk into a staging tensor on its device and scatters it
into the blocks, then answers ``ACK`` or ``NACK``.
A transfer the receiver does not expect is still received (the two ranks must match
sends and receives) but not written.

``backend="gloo"`` runs the same code path on CPU tensors; it exists to test the
rendezvous and the protocol on machines without GPUs, not as a transport to deploy.
Endpoint address: ``host:control_port/store_port``.
"""

from __future__ import annotations

import datetime
import socket
import threading
import uuid

import torch
import torch.distributed as dist

from kvstore.layout import KVCache
from kvstore.transport.base import (
    KVEndpoint,
    KVSender,
    KVTransport,
    TransferError,
    layer_chunks,
    layout_signature,
)
from kvstore.transport.tcp import (
    ACK,
    NOT_EXPECTED,
    SocketReceiver,
    answer,
    check_reply,
    prove_to_receiver,
    read_frame,
    write_frame,
)

HELLO, HEAD = 5, 6
_TAG = 0
CHUNK_BYTES = 64 << 20  # one send carries this many bytes of consecutive layers, at most


def _group(backend: str, store: dist.Store, rank: int, timeout: float):
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, delta)
    raise ValueError(f"unknown process group backend {backend!r}")


def chunks(cache: KVCache, num_blocks: int, num_layers: int) -> list[tuple[int, int]]:
    """Runs of consecutive layers, each at most ``CHUNK_BYTES`` of the transfer: one
    send/recv each, so a small transfer is one NCCL op, not one per layer."""
    return layer_chunks(cache, num_blocks, CHUNK_BYTES)


def _use_device(cache: KVCache) -> None:
    """Make the cache's GPU current in this thread (threads start on device 0)."""
    device = cache.layers[0].device
    if device.type == "cuda":
        torch.cuda.set_device(device)


class NcclReceiver(SocketReceiver):
    def __init__(
        self, cache: KVCache, host: str, key: bytes, backend: str, timeout: float
    ) -> None:
        super().__init__(cache, host, key)
        self.backend = backend
        self.timeout = timeout
        self._store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout),
                                    wait_for_workers=False)  # fmt: skip
        address = f"{host}:{self.port}/{self._store.port}"
        self.endpoint = KVEndpoint("nccl", address, layout_signature(cache), cache.num_blocks)
        self._listen()

    def _serve(self, conn: socket.socket) -> None:
        _use_device(self.cache)
        hello = read_frame(conn)
        if hello.kind != HELLO:
            return
        group = _group(self.backend, dist.PrefixStore(hello.transfer_id, self._store), 1,
                       self.timeout)  # fmt: skip
        write_frame(conn, ACK, hello.transfer_id)
        while True:
            head = read_frame(conn, max_blocks=self.cache.num_blocks, max_payload=0)
            if head.kind != HEAD:
                return
            ids = head.block_ids.tolist()
            answer(conn, head.transfer_id, self._receive(group, head.transfer_id, ids,
                                                         head.layer))  # fmt: skip

    def _receive(self, group, tid: str, ids: list[int], num_layers: int) -> str | None:
        ok = self._allowed(tid, ids)
        storage = self.cache.storage
        index = torch.tensor(ids, dtype=torch.long, device=storage.device)
        for start, end in chunks(self.cache, len(ids), num_layers):
            part = storage[start:end]
            buf = torch.empty((end - start, len(ids), *part.shape[2:]), dtype=part.dtype,
                              device=part.device)  # fmt: skip
            group.recv([buf], 0, _TAG).wait()
            if ok:
                part.index_copy_(1, index, buf)
        if storage.is_cuda:
            torch.cuda.synchronize(storage.device)
        if not ok:
            return NOT_EXPECTED
        self._acknowledged(tid, set(ids))
        return None


class _Pair:
    def __init__(self, sock: socket.socket, group) -> None:
        self.sock = sock
        self.group = group
        self.lock = threading.Lock()


class NcclSender(KVSender):
    backend = "nccl"

    def __init__(self, cache: KVCache, key: bytes, backend: str, timeout: float) -> None:
        super().__init__(cache)
        self._key = key
        self.group_backend = backend
        self.timeout = timeout
        self._pairs: dict[str, _Pair] = {}
        self._guard = threading.Lock()

    def _send(
        self, endpoint: KVEndpoint, transfer_id: str, src: list[int], dst: list[int],
        timeout: float,
    ) -> None:  # fmt: skip
        _use_device(self.cache)
        pair = self._pair(endpoint, timeout)
        storage = self.cache.storage
        index = torch.tensor(src, dtype=torch.long, device=storage.device)
        n_layers = storage.shape[0]
        with pair.lock:
            try:
                pair.sock.settimeout(timeout)
                write_frame(pair.sock, HEAD, transfer_id, n_layers, dst)
                for start, end in chunks(self.cache, len(src), n_layers):
                    data = storage[start:end].index_select(1, index)
                    pair.group.send([data], 1, _TAG).wait()
                reply = read_frame(pair.sock)
            except (OSError, ConnectionError, RuntimeError) as exc:
                self._drop(endpoint)
                raise TransferError(f"KV transfer to {endpoint.address} failed: {exc}") from exc
        check_reply(reply, transfer_id)

    def _pair(self, endpoint: KVEndpoint, timeout: float) -> _Pair:
        with self._guard:
            pair = self._pairs.get(endpoint.address)
            if pair is not None:
                return pair
            control, store_port = endpoint.address.split("/")
            host, port = control.rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                prove_to_receiver(sock, self._key, endpoint.address)
                name = f"pair-{uuid.uuid4().hex}"
                write_frame(sock, HELLO, name)
                store = dist.TCPStore(host, int(store_port), None, False,
                                      datetime.timedelta(seconds=timeout))  # fmt: skip
                group = _group(self.group_backend, dist.PrefixStore(name, store), 0,
                               self.timeout)  # fmt: skip
                if read_frame(sock).kind != ACK:
                    raise ConnectionError("receiver refused the pairing")
            except (OSError, ConnectionError, RuntimeError) as exc:
                raise TransferError(f"cannot pair with {endpoint.address}: {exc}") from exc
            pair = self._pairs[endpoint.address] = _Pair(sock, group)
            return pair

    def _drop(self, endpoint: KVEndpoint) -> None:
        with self._guard:
            pair = self._pairs.pop(endpoint.address, None)
        if pair is not None:
            pair.sock.close()

    def close(self) -> None:
        for pair in self._pairs.values():
            pair.sock.close()
        self._pairs.clear()


class NcclTransport(KVTransport):
    name = "nccl"

    def __init__(self, secret: str | bytes, backend: str = "nccl", timeout: float = 60.0) -> None:
        super().__init__(secret)
        self.backend = backend
        self.timeout = timeout

    def receiver(self, cache: KVCache, host: str = "127.0.0.1") -> NcclReceiver:
        return NcclReceiver(cache, host, self.key, self.backend, self.timeout)

    def sender(self, cache: KVCache) -> NcclSender:
        return NcclSender(cache, self.key, self.backend, self.timeout)
