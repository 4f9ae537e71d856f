"""KV events: what a worker's cache gained or lost, for the router's prefix index."""

from __future__ import annotations

import msgspec

from engine.kv_cache.block_pool import BlockEvent


class KVEvent(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # "stored" | "removed"
    block_hash: bytes
    tier: str = "device"  # the worker's own KV cache (GPU or CPU memory)


def from_block_events(events: list[BlockEvent], tier: str = "device") -> list[KVEvent]:
    return [KVEvent(e.kind, e.block_hash, tier) for e in events]
