"""Frozen configuration of the disaggregated topology."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.worker.config import TransferConfig


@dataclass(frozen=True)
class PDConfig:
    """How many prefill, decode and encode workers to spawn (more may join at runtime;
    with none, all of them do; no encode workers: the prefill workers encode images
    themselves), how KV and image embeddings move between them (``transfer``, which the
    spawned workers get), how each request's workers are chosen (``policy``:
    ``router.policies``), the Redis that frontends share workers and KV events through
    (``redis_url``), whether a spawned worker that dies or hangs is started again
    (``restart_workers``), and how long a worker may go unheard (its heartbeat comes every
    second, even mid-step) before it counts as hung (``silence_timeout_s``).
    ``prefill_ep`` / ``decode_ep``: each spawned worker of that role is an expert-parallel
    group of that many rank processes (``engine.ep``), each rank a worker of its own to the
    router."""

    num_prefill: int = 1
    num_decode: int = 1
    num_encode: int = 0
    transfer: TransferConfig = field(default_factory=TransferConfig)
    policy: str = "cache_aware"
    redis_url: str = ""
    prefill_ep: int = 1
    decode_ep: int = 1
    restart_workers: bool = True
    silence_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_encode) < 0:
            raise ValueError("worker counts cannot be negative")
        if self.prefill_ep < 1 or self.decode_ep < 1:
            raise ValueError("an expert-parallel group has at least one rank")
        if self.silence_timeout_s <= 0:
            raise ValueError("the worker silence timeout must be positive")
        from router.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; "
                             f"choose from {sorted(POLICIES)}")  # fmt: skip
