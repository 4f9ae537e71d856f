"""What the tiers gained or lost, collected from any thread until the engine drains it."""

from __future__ import annotations

import threading

from kvstore.events import KVEvent
from kvstore.hashing import BlockHash


class TierEvents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def add(self, kind: str, block_hash: BlockHash, tier: str) -> None:
        with self._lock:
            self._events.append(KVEvent(kind, block_hash, tier))

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
