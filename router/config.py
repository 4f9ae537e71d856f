"""Frozen configuration of the disaggregated topology."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PDConfig:
    """How many prefill and decode workers to spawn (more may join at runtime; with none,
    all of them do), and how KV moves between them.

    ``local_prefill_tokens``: a decode worker computes a prompt itself when at most this
    many of its tokens are missing from its prefix cache. ``transfer_timeout_s``: how
    long a decode worker keeps blocks reserved for KV that has not arrived (the prefill
    worker does not start a transfer after that).
    """

    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "shm"
    local_prefill_tokens: int = 16
    transfer_timeout_s: float = 120.0
    policy: str = "cache_aware"  # router.policies
    kv_host: str = "127.0.0.1"
    redis_url: str = ""  # workers registry + KV event stream shared by frontends (registry)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("worker counts cannot be negative")
        from router.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; "
                             f"choose from {sorted(POLICIES)}")  # fmt: skip
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
