"""P/D pairing: which prefill and which decode worker serve a request.

One narrow contract, ``PairingPolicy.select``; policies are chosen by name from
``POLICIES``. Round-robin is the only one so far; a cache- and load-aware policy (fed by
the workers' KV events) replaces it without touching the callers.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A healthy worker as a policy sees it."""

    name: str
    num_running: int = 0
    num_waiting: int = 0


@dataclass(frozen=True)
class Pair:
    prefill: int  # index into the prefill candidates
    decode: int  # index into the decode candidates


class PairingPolicy(ABC):
    @abstractmethod
    def select(
        self, prefill: Sequence[Candidate], decode: Sequence[Candidate], prompt: Sequence[int]
    ) -> Pair:
        """Pick one of each; both sequences are non-empty and hold healthy workers only."""


class RoundRobin(PairingPolicy):
    """Each pool in turn, independently."""

    def __init__(self) -> None:
        self._p = itertools.count()
        self._d = itertools.count()

    def select(
        self, prefill: Sequence[Candidate], decode: Sequence[Candidate], prompt: Sequence[int]
    ) -> Pair:
        return Pair(next(self._p) % len(prefill), next(self._d) % len(decode))


POLICIES: dict[str, type[PairingPolicy]] = {"round_robin": RoundRobin}


def get_policy(name: str) -> PairingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown pairing policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
