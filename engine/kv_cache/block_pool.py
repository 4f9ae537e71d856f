"""Fixed-size KV blocks: ref-counted, hash-chained for prefix reuse, evicted LRU.

A block is in exactly one of three states:
- *in use*: ``ref_count > 0``; never evicted;
- *free and cached*: ``ref_count == 0`` with a hash; reusable by a prefix match until
  ``allocate`` needs the space and evicts it (least recently freed first);
- *free*: ``ref_count == 0`` without a hash.
Free blocks (cached or not) wait in one LRU queue. Block 0 is the null block and is
never handed out. ``on_evict`` (the tiers below, ``engine.kv_cache.tiered``) sees a cached
block's id and hash before ``allocate`` hands it out again, while its content is intact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.events import KVEvent
from kvstore.hashing import BlockHash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[BlockHash, Block] = {}
        self.events: list[KVEvent] = []
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self._event_sources: list[Callable[[], list[KVEvent]]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, hashes: list[BlockHash]) -> list[Block]:
        """The longest run of ``hashes``, from the first, that the cache holds."""
        found: list[Block] = []
        if not self.enable_caching:
            return found
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found by ``lookup``."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks (ref_count 1), evicting cached free blocks LRU-first."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; pass them tail first so that a sequence's
        last blocks are evicted before its first (which more requests share)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Publish a full block under its hash; False when it was published already or the
        hash is held by another block (which keeps it)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.events.append(KVEvent("stored", block_hash))
        return True

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block)

    def add_event_source(self, drain: Callable[[], list[KVEvent]]) -> None:
        """``drain_events`` also returns what ``drain()`` hands over (the tiers' events)."""
        self._event_sources.append(drain)

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        for drain in self._event_sources:
            events.extend(drain())
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self.events.append(KVEvent("removed", block.block_hash))
        block.block_hash = None

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        ``expected_refs`` maps block ids to the number of holders the caller knows of;
        every other block must then be free.
        """
        free_ids = set(self._free)
        assert 0 not in free_ids and self.blocks[0].ref_count == 0, "null block handed out"
        for block in self.blocks[1:]:
            in_free = block.block_id in free_ids
            assert in_free == (block.ref_count == 0), f"block {block.block_id} ref/free mismatch"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hash"
        assert all(b.block_hash == h for h, b in self._cached.items()), "cached map out of sync"
        if expected_refs is not None:
            for block in self.blocks[1:]:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_count == want, (
                    f"block {block.block_id}: ref_count {block.ref_count}, holders {want}"
                )
