"""Load-aware: the power of two choices.

Two workers drawn at random, the less loaded one wins: for prefill (and encode) the one
with fewer prompt (image) tokens waiting to be computed, for decode the one with fewer
requests in flight (then more free KV). Nearly as even as asking every worker, with none
of the herding that always picking the global minimum causes when load figures lag.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Candidate, Policy


class LoadAware(Policy):
    name = "load_aware"

    def select(self, candidates: Sequence[Candidate], num_tokens: int) -> int:
        if len(candidates) == 1:
            return 0
        a, b = self.rng.sample(range(len(candidates)), 2)
        return min((a, b), key=lambda i: self._load(candidates[i]))

    def _load(self, c: Candidate) -> tuple:
        if self.computes:
            return (c.queued_tokens, c.inflight, c.num_waiting)
        return (c.inflight, c.num_running + c.num_waiting, -c.kv_free)
