"""What a policy sees of each worker, and the one method it implements."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

# The pools a policy can serve: an encode worker's work is image tokens to run through the
# vision tower, which policies weigh as a prefill worker's prompt tokens.
POOLS = ("prefill", "decode", "encode")


@dataclass(frozen=True)
class Candidate:
    """A live worker of one pool, as the frontend knows it when a request arrives.

    ``hit_tokens`` comes from the prefix index (what the worker's caches hold of this
    prompt, or of this image for an encode worker); ``inflight`` and ``queued_tokens`` are
    this frontend's own exact count of what it has sent the worker and not yet seen
    finish; the rest is the worker's latest report.
    """

    name: str
    hit_tokens: int = 0
    inflight: int = 0  # requests sent to it and not finished
    queued_tokens: int = 0  # prompt tokens sent to it to compute, not yet computed
    num_running: int = 0
    num_waiting: int = 0
    kv_free: float = 1.0  # fraction of its KV blocks free
    tokens_per_s: float = 0.0  # its measured prefill rate; 0 while unknown


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self, role: str, seed: int | None = None) -> None:
        if role not in POOLS:
            raise ValueError(f"a policy serves one of the pools {POOLS}, not {role!r}")
        self.role = role
        self.rng = random.Random(seed)

    @property
    def computes(self) -> bool:
        """Whether the pool's cost is work to compute (prefill, encode: tokens over a
        rate) rather than requests to carry (decode)."""
        return self.role != "decode"

    @abstractmethod
    def select(self, candidates: Sequence[Candidate], num_tokens: int) -> int:
        """Index of the chosen candidate; ``candidates`` is non-empty, ``num_tokens`` is
        the prompt's length."""
