"""Random: a uniformly random worker of the pool."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Candidate, Policy


class RandomChoice(Policy):
    name = "random"

    def select(self, candidates: Sequence[Candidate], num_tokens: int) -> int:
        return self.rng.randrange(len(candidates))
