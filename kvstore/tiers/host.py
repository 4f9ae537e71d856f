"""The host-memory tier: a fixed pool of block slots, least recently used goes first.

Slots live in one tensor ``[num_slots, num_layers, block_size, token_width]`` (pinned
when the device cache is on a GPU, so copies to and from it are DMA). Only the thread
that runs the engine's steps touches it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import torch

from kvstore.hashing import BlockHash
from kvstore.tiers.events import TierEvents


class HostTier:
    name = "host"

    def __init__(
        self,
        num_slots: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        events: TierEvents,
        pin_memory: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        # empty, not zeros: pages are only committed as slots fill (unless pinned)
        self.slots = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.block_bytes = self.slots[0].numel() * self.slots.element_size()
        self._events = events
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[BlockHash, int] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.evictions = 0
        self.dropped = 0  # offers refused because every slot was pinned

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> bool:
        """Keep a copy of ``block`` (any device) under ``block_hash``; evicts the least
        recently used unpinned slot when full. False when nothing could be evicted."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            self.dropped += 1
            return False
        self.slots[slot].copy_(block)
        self._lru[block_hash] = slot
        self.bytes_written += self.block_bytes
        self._events.add("stored", block_hash, self.name)
        return True

    def get(self, block_hash: BlockHash) -> torch.Tensor:
        """The stored block (a view into the slot: copy it before the next ``put``)."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self.bytes_read += self.block_bytes
        return self.slots[slot]

    @contextlib.contextmanager
    def pinned(self, hashes: Iterable[BlockHash]) -> Iterator[None]:
        """Within the block, ``put`` does not evict these (they are about to be read)."""
        held = [h for h in hashes if h in self._lru]
        for h in held:
            self._pins[h] = self._pins.get(h, 0) + 1
        try:
            yield
        finally:
            for h in held:
                self._pins[h] -= 1
                if not self._pins[h]:
                    del self._pins[h]

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim in self._lru:
            if victim not in self._pins:
                slot = self._lru.pop(victim)
                self.evictions += 1
                self._events.add("removed", victim, self.name)
                return slot
        return None

    def clear(self) -> None:
        for h in list(self._lru):
            self._free.append(self._lru.pop(h))
            self._events.add("removed", h, self.name)

    def check_integrity(self) -> None:
        slots = list(self._lru.values())
        assert len(set(slots)) == len(slots), "host slot held twice"
        assert not set(slots) & set(self._free), "host slot both free and held"
        assert len(slots) + len(self._free) == self.num_slots, "host slot lost"
        assert not self._pins, f"host slots left pinned: {len(self._pins)}"
