"""KV events: what a cache or a tier below it gained or lost, for the router's prefix index.

One type everywhere: the block pool and the tiers emit it, workers send it on their
channels and to Redis, the router's index applies it.
"""

from __future__ import annotations

import msgspec


class KVEvent(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # "stored" | "removed"
    block_hash: bytes
    # "device": the worker's own KV cache (GPU or CPU memory); "host": its host-memory tier;
    # "file": the file tier, which every worker on the machine shares
    tier: str = "device"
