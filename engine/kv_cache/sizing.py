"""How big the KV cache and the host-memory tier are when no size is given.

A fixed size fits no machine: 1 GiB of KV per worker was 22 full contexts of the default
model at 8k tokens on a laptop, and 4 GiB of host tier per worker could grow past the
laptop's free memory. Sized from what they serve instead:

- the KV cache holds ``AUTO_KV_CONTEXTS`` full contexts of ``max_model_len`` tokens, at
  most ``AUTO_KV_MAX_BYTES`` (the old fixed size; a large model's contexts hit it);
- the host tier takes ``HOST_TIER_SHARE`` of the memory available when the frontend
  starts, shared by the workers it starts, at most ``HOST_TIER_MAX_BYTES`` a worker.
"""

from __future__ import annotations

import os

AUTO_KV_CONTEXTS = 2
AUTO_KV_MAX_BYTES = 1 << 30
HOST_TIER_SHARE = 0.02
HOST_TIER_MAX_BYTES = 4 << 30


def auto_kv_blocks(max_model_len: int, block_size: int, bytes_per_block: int) -> int:
    """Blocks (the null block included) for ``AUTO_KV_CONTEXTS`` contexts of
    ``max_model_len`` tokens, or as many as ``AUTO_KV_MAX_BYTES`` holds if fewer."""
    per_context = -(-max_model_len // block_size)
    cap = max(1, AUTO_KV_MAX_BYTES // bytes_per_block)
    return min(AUTO_KV_CONTEXTS * per_context, cap) + 1


def available_memory_bytes() -> int:
    """Memory the system can give without swapping: ``MemAvailable`` of /proc/meminfo,
    else half the physical memory (systems without /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def host_tier_bytes(available: int, workers: int) -> int:
    """One worker's host tier: its share of ``HOST_TIER_SHARE`` of ``available`` bytes
    among ``workers`` workers, at most ``HOST_TIER_MAX_BYTES``."""
    return min(int(available * HOST_TIER_SHARE) // max(1, workers), HOST_TIER_MAX_BYTES)
