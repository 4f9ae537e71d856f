"""One routing decision: hash the prompt, ask the prefix index, let the pool's policy pick.

``Router`` is what the frontend (``router.disagg``) and the router benchmark share. A
worker, for it, is anything with ``name``, ``inflight``, ``queued_tokens``,
``tokens_per_s`` and ``stats`` (its latest ``EngineStats`` or None).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstore.hashing import BlockHash, MediaSpan, hash_chain
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.policies import POOLS, Candidate, get_policy


class Router:
    def __init__(
        self, policy: str, block_size: int = 16, hash_extra: bytes = b"",
        metrics: RouterMetrics | None = None, index: PrefixIndex | None = None,
    ) -> None:  # fmt: skip
        self.index = index if index is not None else PrefixIndex()
        self.policies = {role: get_policy(policy, role) for role in POOLS}
        self.block_size = block_size
        self.hash_extra = hash_extra
        self.metrics = metrics or RouterMetrics(policy)

    def hashes(self, tokens: Sequence[int], media: Sequence[MediaSpan] = ()) -> list[BlockHash]:
        """The block chain a worker can have cached of a request with these tokens (and
        images, ``media``): every full block before the last token (which is always
        computed)."""
        return hash_chain(tokens[:-1], self.block_size, self.hash_extra, media=media)

    def choose(
        self, role: str, workers: Sequence[Any], hashes: Sequence[BlockHash], num_tokens: int,
        block_size: int | None = None,
    ) -> tuple[Any, int]:  # fmt: skip
        """A worker of the ``role`` pool (``workers``: non-empty, all live) and the tokens of
        the request its caches hold, as the index knows them (``block_size``: tokens per
        hash, the KV block size unless given: an encode worker's embedding blocks)."""
        started = time.perf_counter()
        size = block_size or self.block_size
        hits = self.index.match(hashes, [w.name for w in workers])
        candidates = [candidate(w, min(hits[w.name] * size, num_tokens)) for w in workers]
        i = self.policies[role].select(candidates, num_tokens)
        self.metrics.decided(role, time.perf_counter() - started)
        return workers[i], candidates[i].hit_tokens

    def hit_tokens(self, worker: Any, hashes: Sequence[BlockHash]) -> int:
        return self.index.match(hashes, [worker.name])[worker.name] * self.block_size


def candidate(w: Any, hit_tokens: int) -> Candidate:
    stats = w.stats
    if stats is None:
        return Candidate(w.name, hit_tokens, w.inflight, w.queued_tokens,
                         tokens_per_s=w.tokens_per_s)  # fmt: skip
    total = stats.kv_blocks_total
    free = 1.0 - stats.kv_blocks_used / total if total else 1.0
    return Candidate(w.name, hit_tokens, w.inflight, w.queued_tokens, stats.num_running,
                     stats.num_waiting, free, w.tokens_per_s)  # fmt: skip
