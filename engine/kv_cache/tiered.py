"""The tiers below one engine's device cache: host memory (``kvstore.tiers.HostTier``),
then files shared by every worker of the machine (``kvstore.tiers.FileTier``).

How blocks move (``KVCacheManager`` drives it; schedulers know nothing of tiers):
- **down on eviction**: when ``BlockPool.allocate`` reuses a cached block, ``offload``
  copies its content into the host tier first;
- **down on compute**: full blocks published by ``allocate`` are copied out after the
  step that computed them (``write_through``) and queued for the file tier's writer;
- **up on a prefix hit**: ``match`` extends the device cache's run of hits with host hits,
  then file hits (read and verified right away, so a corrupt file, or one the file
  system will not give back, only shortens the match), and ``load`` copies them into the
  request's fresh blocks.

The file tier raises nothing here: its faults are misses, skipped writes and its
``degraded`` state (``kv_file_degraded`` in ``stats``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvstore.events import KVEvent
from kvstore.hashing import BlockHash
from kvstore.layout import KVCache
from kvstore.tiers.events import TierEvents
from kvstore.tiers.file import FileTier
from kvstore.tiers.fileio import DEFAULT_FILE_MODE
from kvstore.tiers.format import BlockMeta
from kvstore.tiers.host import HostTier

log = logging.getLogger("ferry.engine")


@dataclass(frozen=True)
class TierHit:
    """One block of a prefix found below the device cache."""

    block_hash: BlockHash
    tier: str  # "host" | "file"
    data: torch.Tensor | None = None  # file hits: the verified content; host: read on load


def block_meta(cache: KVCache, fingerprint: str) -> BlockMeta:
    lay = cache.layout
    comps = tuple((c.name, tuple(c.shape)) for c in lay.components)
    return BlockMeta(fingerprint, lay.num_layers, lay.block_size, comps, lay.dtype)


class KVTiers:
    def __init__(
        self,
        cache: KVCache,
        host: HostTier | None,
        file: FileTier | None,
        events: TierEvents,
    ) -> None:
        self.cache = cache
        self.host = host
        self.file = file
        self.events = events
        self._staged: dict[BlockHash, torch.Tensor] = {}  # file reads of the latest match

    @classmethod
    def build(
        cls,
        cache: KVCache,
        fingerprint: str,
        host_bytes: int,
        kv_dir: str,
        file_capacity_bytes: int,
        file_ttl_s: float,
        file_mode: int = DEFAULT_FILE_MODE,
    ) -> KVTiers | None:
        """The tiers asked for (``host_bytes`` 0: no host tier; ``kv_dir`` "": no files;
        ``file_mode``: permission bits of block files)."""
        if host_bytes <= 0 and not kv_dir:
            return None
        meta = block_meta(cache, fingerprint)
        events = TierEvents()
        host = None
        if host_bytes > 0:
            slots = host_bytes // cache.layout.bytes_per_block
            pin = cache.storage.is_cuda
            host = HostTier(slots, meta.block_shape, meta.dtype, events, pin_memory=pin)
        file = None
        if kv_dir:
            file = FileTier(kv_dir, meta, file_capacity_bytes, file_ttl_s, events, mode=file_mode)
        return cls(cache, host, file, events)

    def _block(self, block_id: int) -> torch.Tensor:
        return self.cache.storage[:, block_id]

    # -- down -------------------------------------------------------------------------------

    def offload(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached device block is about to be reused: keep its content in host memory."""
        if self.host is not None:
            self.host.put(block_hash, self._block(block_id))

    def write_through(self, blocks: list[tuple[int, BlockHash]]) -> None:
        """Queue freshly computed blocks for the file tier (copied out now: the device
        block may be reused before the writer gets to it)."""
        if self.file is None:
            return
        new = [(i, h) for i, h in blocks if not self.file.known(h)]
        if not new:
            return
        storage = self.cache.storage
        ids = torch.tensor([i for i, _ in new], device=storage.device)
        copies = storage.index_select(1, ids).cpu()  # one gather (one transfer on a GPU)
        for n, (_, block_hash) in enumerate(new):
            self.file.put(block_hash, copies[:, n])

    # -- up ---------------------------------------------------------------------------------

    def match(self, hashes: list[BlockHash]) -> list[TierHit]:
        """Hits for the leading run of ``hashes``, each from host memory or else a file."""
        hits: list[TierHit] = []
        staged: dict[BlockHash, torch.Tensor] = {}
        for h in hashes:
            if self.host is not None and h in self.host:
                hits.append(TierHit(h, "host"))
                continue
            if self.file is None:
                break
            data = self._staged.get(h)
            if data is None:
                data = self.file.load(h)
            if data is None:
                break
            staged[h] = data
            hits.append(TierHit(h, "file", data))
        self._staged = staged  # a request that waits for blocks is matched again next step
        return hits

    @contextlib.contextmanager
    def pinned(self, hits: tuple[TierHit, ...]) -> Iterator[None]:
        """Host hits stay while the block is open, whatever ``offload`` does meanwhile."""
        if self.host is None:
            yield
            return
        with self.host.pinned(h.block_hash for h in hits if h.tier == "host"):
            yield

    def load(self, hits: tuple[TierHit, ...], block_ids: list[int]) -> None:
        """Copy each hit into its device block."""
        for hit, block_id in zip(hits, block_ids, strict=False):
            if hit.tier == "host":
                assert self.host is not None
                data = self.host.get(hit.block_hash)
            else:
                data = hit.data
            assert data is not None
            self._block(block_id).copy_(data)
        for hit in hits:
            self._staged.pop(hit.block_hash, None)
            if hit.data is not None and self.file is not None:
                self.file.recycle(hit.data)  # copied: its buffer serves the next read

    # -- reporting ------------------------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    def stats(self) -> dict[str, int]:
        """Counters as ``EngineStats`` fields."""
        out: dict[str, int] = {}
        if self.host is not None:
            h = self.host
            out.update(
                kv_host_blocks_used=len(h), kv_host_blocks_total=h.num_slots,
                kv_host_bytes_read=h.bytes_read, kv_host_bytes_written=h.bytes_written,
                kv_host_evictions=h.evictions,
            )  # fmt: skip
        if self.file is not None:
            f = self.file.stats()
            out.update(
                kv_file_bytes_read=f["bytes_read"], kv_file_bytes_written=f["bytes_written"],
                kv_file_evictions=f["evictions"], kv_file_expired=f["expired"],
                kv_file_checksum_failures=f["checksum_failures"],
                kv_file_writes_dropped=f["dropped"], kv_file_read_errors=f["read_errors"],
                kv_file_write_errors=f["write_errors"], kv_file_degraded=f["degraded"],
            )  # fmt: skip
        return out

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()

    def close(self) -> None:
        """Finish the file tier's queued writes."""
        if self.file is not None:
            self.file.close()
