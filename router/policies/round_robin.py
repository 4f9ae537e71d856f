"""Round-robin: each worker of the pool in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.policies.base import Candidate, Policy


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, role: str, seed: int | None = None) -> None:
        super().__init__(role, seed)
        self._turn = itertools.count()

    def select(self, candidates: Sequence[Candidate], num_tokens: int) -> int:
        return next(self._turn) % len(candidates)
