"""The router's prefix index: which worker holds which KV block, in which tier.

Built only from the workers' own KV events (``kvstore.events.KVEvent``: a block hash
stored in or removed from a tier), so it knows what the workers really hold. Blocks are
keyed by the one block hash of ``kvstore.hashing``: the frontend hashes a prompt the way
every worker does and asks, per worker, for the longest run of leading blocks it can
serve without computing them.

Tiers: ``device`` and ``host`` belong to one worker; ``file`` is the shared file tier,
which every worker on the machine can load from, so a block held there counts for all
of them (until its TTL runs out, if the index is given one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from kvstore.events import KVEvent
from kvstore.hashing import BlockHash

SHARED_TIER = "file"
_SHARED = "\x00shared"  # the holder name under which shared-tier blocks are kept
_TIER_BITS = {"device": 1, "host": 2, SHARED_TIER: 4}


class PrefixIndex:
    def __init__(
        self, shared_ttl_s: float | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._holders: dict[BlockHash, dict[str, int]] = {}  # hash -> holder -> tier bits
        self._held: dict[str, set[BlockHash]] = {}  # holder -> hashes
        # for lookups: one bit per holder (the shared tier's is bit 0), and per block the
        # bits of its holders, so that a lookup is one AND per block
        self._bits: dict[str, int] = {_SHARED: 1}
        self._masks: dict[BlockHash, int] = {}
        self._shared_seen: dict[BlockHash, float] = {}  # shared block -> when stored
        self.shared_ttl_s = shared_ttl_s
        self.clock = clock

    # -- updates ------------------------------------------------------------------------------

    def apply(self, worker: str, events: Iterable[KVEvent]) -> None:
        for e in events:
            bit = _TIER_BITS.get(e.tier)
            if bit is None:
                continue
            holder = _SHARED if e.tier == SHARED_TIER else worker
            if e.kind == "stored":
                self._store(holder, e.block_hash, bit)
            elif e.kind == "removed":
                self._remove(holder, e.block_hash, bit)

    def remove_worker(self, worker: str) -> None:
        """Forget everything ``worker`` holds (it died or left; its cache is gone)."""
        bit = self._bits.pop(worker, 0)
        for h in self._held.pop(worker, ()):
            holders = self._holders[h]
            del holders[worker]
            self._masks[h] &= ~bit
            if not holders:
                del self._holders[h]
                del self._masks[h]

    def _store(self, holder: str, h: BlockHash, bit: int) -> None:
        holders = self._holders.setdefault(h, {})
        holders[holder] = holders.get(holder, 0) | bit
        self._masks[h] = self._masks.get(h, 0) | self._bit(holder)
        self._held.setdefault(holder, set()).add(h)
        if holder == _SHARED:
            self._shared_seen[h] = self.clock()

    def _remove(self, holder: str, h: BlockHash, bit: int) -> None:
        holders = self._holders.get(h)
        if holders is None or holder not in holders:
            return
        bits = holders[holder] & ~bit
        if bits:
            holders[holder] = bits
            return
        del holders[holder]
        self._held[holder].discard(h)
        self._masks[h] &= ~self._bits[holder]
        if holder == _SHARED:
            self._shared_seen.pop(h, None)
        if not holders:
            del self._holders[h]
            del self._masks[h]

    def _bit(self, holder: str) -> int:
        bit = self._bits.get(holder)
        if bit is None:  # the lowest bit no holder uses
            taken = 0
            for b in self._bits.values():
                taken |= b
            bit = (taken + 1) & ~taken
            self._bits[holder] = bit
        return bit

    def expire(self) -> None:
        """Drop shared-tier blocks older than the TTL (their files are gone by now)."""
        if self.shared_ttl_s is None:
            return
        cutoff = self.clock() - self.shared_ttl_s
        for h in [h for h, t in self._shared_seen.items() if t < cutoff]:
            self._remove(_SHARED, h, _TIER_BITS[SHARED_TIER])

    # -- queries ------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        """For each of ``workers``: how many of the leading ``hashes`` it can serve from a
        cache (any of its tiers, or the shared tier)."""
        self.expire()
        result = dict.fromkeys(workers, 0)
        bits = [(w, self._bit(w)) for w in workers]  # one that holds nothing: shared only
        active = 0
        for _, bit in bits:
            active |= bit
        masks = self._masks
        n = 0
        for h in hashes:
            mask = masks.get(h, 0)
            if not mask & 1:  # not in the shared tier: only its holders go on
                dropped = active & ~mask
                if dropped:
                    for w, bit in bits:
                        if bit & dropped:
                            result[w] = n
                    active &= mask
                    if not active:
                        return result
            n += 1
        for w, bit in bits:
            if bit & active:
                result[w] = n
        return result

    def tiers(self, worker: str, h: BlockHash) -> set[str]:
        """The tiers in which ``worker`` can find block ``h`` (the shared one included)."""
        holders = self._holders.get(h, {})
        bits = holders.get(worker, 0) | holders.get(_SHARED, 0)
        return {tier for tier, bit in _TIER_BITS.items() if bits & bit}

    def num_blocks(self, worker: str | None = None) -> int:
        """Blocks held by ``worker`` (in any of its tiers), or distinct blocks known."""
        if worker is None:
            return len(self._holders)
        return len(self._held.get(worker, ()))
