"""The KV transport contract: move blocks from one process's KV cache into another's.

A transport moves *blocks*, whatever they hold. It never looks inside one: a block is one
contiguous byte run per layer (``KVCacheLayout``: each layer is a tensor
``[num_blocks, block_size, token_width]``), so K/V heads and an MLA latent travel alike.

The receiving side (a decode worker) allocates its cache through
``KVTransport.allocate_cache`` (a backend may need it somewhere special, e.g. shared
memory), opens a ``KVReceiver`` on it and hands its ``endpoint`` to peers. Before a peer
writes, the receiver is told which destination blocks a transfer may fill
(``expect``); ``forget`` withdraws that, after which writes for it are refused where the
backend can refuse them. The sending side (a prefill worker) opens a ``KVSender`` on its
own cache and calls ``send``: layer by layer (or in chunks), source block ``src[i]`` of
every layer lands in destination block ``dst[i]``. ``send`` returns only once every byte
is in place at the destination, and raises ``TransferError`` on corruption, peer death
or timeout; then the destination blocks hold garbage and must not be used.

On a CUDA cache the bytes are read on a side stream of the sender's, which waits for
``ready`` (an event the caller recorded once the source blocks were written) or, without
one, for everything queued on the device so far. The event matters where the engine keeps
queueing steps while sends run on another thread: waiting for the whole device queue made
each send of a prefill worker wait for the step launched after its blocks were done.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import msgspec

from kvstore.auth import key_of

if TYPE_CHECKING:  # the messages here travel through frontends, which run without torch
    import torch

    from kvstore.layout import KVCache, KVCacheLayout


class TransferError(RuntimeError):
    """A transfer did not complete: the destination blocks are not to be trusted."""


class KVEndpoint(msgspec.Struct, frozen=True):
    """Where a receiver listens, as peers need to know it (travels in messages)."""

    backend: str
    address: str  # shm: path of the shared segment; tcp / nccl: host:port
    layout: str  # layout_signature() of the receiving cache
    num_blocks: int
    pid: int = 0


class KVDestination(msgspec.Struct, frozen=True):
    """Where a request's KV goes: the decode worker's receiver and the blocks it reserved
    for prompt blocks ``skip_blocks ..`` (it holds the first ``skip_blocks`` itself).
    No transfer starts after ``deadline`` (wall clock): the decode worker gives up then."""

    endpoint: KVEndpoint
    block_ids: list[int]
    skip_blocks: int
    deadline: float


@dataclass(frozen=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    seconds: float


def layout_signature(cache: KVCache) -> str:
    """Layer count, block size, token width and dtype: what both ends must agree on."""
    layers, _, size, width = cache.shape
    return f"{layers}x{size}x{width}:{str(cache.layout.dtype).removeprefix('torch.')}"


def check_layout(cache: KVCache, endpoint: KVEndpoint) -> None:
    if endpoint.layout != layout_signature(cache):
        raise TransferError(
            f"KV layout mismatch: receiver {endpoint.layout}, sender {layout_signature(cache)}"
        )


def block_bytes(layout: KVCacheLayout) -> int:
    """Bytes of one block in one layer."""
    return layout.bytes_per_block // layout.num_layers


CHUNK_BYTES = 8 << 20  # a chunk of consecutive layers moved as one unit, at most


def layer_chunks(
    cache: KVCache, num_blocks: int, chunk_bytes: int | None = None
) -> list[tuple[int, int]]:
    """Runs ``[start, end)`` of consecutive layers whose ``num_blocks`` blocks make at most
    ``chunk_bytes`` (at least one layer each): small transfers move in one piece, large
    ones layer group by layer group."""
    per_layer = max(1, num_blocks * block_bytes(cache.layout))
    step = max(1, (chunk_bytes or CHUNK_BYTES) // per_layer)
    n = cache.layout.num_layers
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def check_ids(src: list[int], dst: list[int], num_blocks: int) -> None:
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destinations")
    if any(not 0 < b < num_blocks for b in dst):
        raise TransferError(f"destination block ids out of range 1..{num_blocks - 1}")


class KVReceiver(ABC):
    endpoint: KVEndpoint

    @abstractmethod
    def expect(self, transfer_id: str, dst_block_ids: list[int]) -> None:
        """Allow ``transfer_id`` to write into ``dst_block_ids``."""

    @abstractmethod
    def forget(self, transfer_id: str) -> None:
        """Withdraw ``expect``: later writes for ``transfer_id`` are dropped if possible."""

    @abstractmethod
    def landed(self, transfer_id: str) -> bool:
        """Whether every block ``expect`` allowed ``transfer_id`` to write has been written
        by a send the receiver acknowledged (backends that cannot observe the writes say
        True)."""

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    """The sending end, on its own cache. ``send`` checks what every backend checks (the
    endpoint's backend and layout, the block ids) and times the transfer; a backend
    moves the bytes in ``_send``."""

    backend: ClassVar[str]

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._side: torch.cuda.Stream | None = None  # a CUDA cache's reading stream

    def send(
        self,
        endpoint: KVEndpoint,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        timeout: float = 30.0,
        ready: torch.cuda.Event | None = None,
    ) -> TransferStats:
        """Copy blocks ``src[i]`` → ``dst[i]`` of every layer; see the module docstring."""
        started = time.perf_counter()
        if endpoint.backend != self.backend:
            raise TransferError(f"{self.backend} sender given a {endpoint.backend} endpoint")
        check_layout(self.cache, endpoint)
        check_ids(src_block_ids, dst_block_ids, endpoint.num_blocks)
        storage = self.cache.storage
        if storage.is_cuda:
            import torch

            if self._side is None:
                self._side = torch.cuda.Stream(storage.device)
            if ready is None:
                self._side.wait_stream(torch.cuda.current_stream(storage.device))
            else:
                self._side.wait_event(ready)
            with torch.cuda.stream(self._side):
                self._send(endpoint, transfer_id, src_block_ids, dst_block_ids, timeout)
        else:
            self._send(endpoint, transfer_id, src_block_ids, dst_block_ids, timeout)
        nbytes = len(src_block_ids) * self.cache.layout.bytes_per_block
        return TransferStats(len(src_block_ids), nbytes, time.perf_counter() - started)

    @abstractmethod
    def _send(
        self, endpoint: KVEndpoint, transfer_id: str, src: list[int], dst: list[int],
        timeout: float,
    ) -> None:  # fmt: skip
        """Move the blocks; return once every byte is in place, raise ``TransferError``
        otherwise. On a CUDA cache it runs on the side stream (the current one), which
        already waits for the source blocks."""

    @abstractmethod
    def close(self) -> None: ...


class KVTransport(ABC):
    """A backend: how the receiving cache is allocated, and its two ends. ``secret``: the
    cluster secret, which the two ends of a socket backend prove to each other before any
    block moves (``kvstore.auth``)."""

    name: ClassVar[str]

    def __init__(self, secret: str | bytes) -> None:
        self.key = key_of(secret)

    def allocate_cache(
        self, layout: KVCacheLayout, num_blocks: int, device: torch.device | str
    ) -> KVCache:
        """The receiving side's cache (plain memory unless the backend needs otherwise)."""
        from kvstore.layout import KVCache

        return KVCache(layout, num_blocks, device)

    @abstractmethod
    def receiver(self, cache: KVCache, host: str = "127.0.0.1") -> KVReceiver: ...

    @abstractmethod
    def sender(self, cache: KVCache) -> KVSender: ...
