"""Cache-aware: send the prompt where the least work stands between it and its first
token, counting what the workers' caches already hold.

Prefill pool: the cost of a worker is the time to clear what it has queued plus this
prompt's uncached tokens, ``(queued_tokens + num_tokens - hit_tokens) / rate``, with the
worker's measured prefill rate (the pool's mean while it is unknown). A cached prefix
thus wins exactly while it saves more than the queue ahead of it costs, so a prefix that
every worker holds (a shared system prompt) cannot pull all the load onto one of them.

Encode pool: the same cost as prefill, with image tokens and the worker's measured
encode rate (a worker whose embedding cache holds the image has none of its tokens to
compute).

Decode pool: among the workers not busier than the least busy by more than a margin,
the one holding most of the prompt (an earlier turn's KV: less to move, or a tail short
enough to prefill locally); then the least busy.

Ties go to the workers in turn, so equal workers share equal requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.policies.base import Candidate, Policy

DECODE_MARGIN = 0.25  # a decode worker this much busier than the least busy is passed over


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, role: str, seed: int | None = None) -> None:
        super().__init__(role, seed)
        self._turn = itertools.count()

    def select(self, candidates: Sequence[Candidate], num_tokens: int) -> int:
        if self.computes:
            keys = self._prefill_costs(candidates, num_tokens)
        else:
            keys = self._decode_costs(candidates)
        best = min(keys)
        tied = [i for i, k in enumerate(keys) if k == best]
        return tied[next(self._turn) % len(tied)]

    @staticmethod
    def _prefill_costs(candidates: Sequence[Candidate], num_tokens: int) -> list[tuple]:
        known = [c.tokens_per_s for c in candidates if c.tokens_per_s > 0]
        default = sum(known) / len(known) if known else 1.0
        costs = []
        for c in candidates:
            rate = c.tokens_per_s if c.tokens_per_s > 0 else default
            work = c.queued_tokens + max(0, num_tokens - c.hit_tokens)
            costs.append((round(work / rate, 6),))
        return costs

    @staticmethod
    def _decode_costs(candidates: Sequence[Candidate]) -> list[tuple]:
        least = min(c.inflight for c in candidates)
        limit = least + max(2, int(least * DECODE_MARGIN))
        return [
            (c.inflight > limit, -c.hit_tokens, c.inflight) for c in candidates
        ]  # fmt: skip
