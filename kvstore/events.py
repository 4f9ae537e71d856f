"""KV events: what a worker's cache gained or lost, for the router's prefix index."""

from __future__ import annotations

import msgspec

from engine.kv_cache.block_pool import BlockEvent


class KVEvent(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # "stored" | "removed"
    block_hash: bytes
    # "device": the worker's own KV cache (GPU or CPU memory); "host": its host-memory tier;
    # "file": the file tier, which every worker on the machine shares
    tier: str = "device"


def from_block_events(events: list[BlockEvent]) -> list[KVEvent]:
    return [KVEvent(e.kind, e.block_hash, e.tier) for e in events]
