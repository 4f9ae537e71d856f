"""Frozen configuration of one worker process, declared once: every default is here.

A frontend builds a ``WorkerConfig`` per worker it spawns and hands it over as JSON on
the worker's command line (like ``EngineConfig`` inside it); ``ferry worker`` builds one
from its flags. Nothing is patched on afterwards.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig

ROLES = ("engine", "prefill", "decode", "encode")


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from prefill to decode workers (and image embeddings from encode to
    prefill workers: the same transport).

    ``timeout_s``: how long the KV of a prompt may take once its prefill has started (a
    prefill worker starts no send later, and gives each send this long);
    ``queue_timeout_s``: how long it may wait for a prefill worker to start it. A decode
    worker keeps blocks reserved for KV that has not arrived for their sum.
    ``local_prefill_tokens``: a decode worker computes a prompt itself when at most this
    many of its tokens are missing from its prefix cache. ``kv_host``: the address a decode
    worker's KV receiver binds.
    """

    transport: str = "shm"
    timeout_s: float = 120.0
    queue_timeout_s: float = 600.0
    local_prefill_tokens: int = 16
    kv_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if not self.timeout_s > 0 or not self.queue_timeout_s >= 0:
            raise ValueError("the KV transfer timeouts must be positive")


@dataclass(frozen=True)
class GroupMember:
    """This worker as rank ``rank`` of the expert-parallel group ``name`` of ``size``
    ranks (``engine.ep.group``): each rank is a worker process with its own channel,
    scheduler and KV cache, and the ranks meet through the ``FileStore`` at
    ``rendezvous`` (a path in a directory only the group's owner can read), the group's
    own connections bound to ``host``."""

    name: str
    rank: int
    size: int
    rendezvous: str
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker: its role, its engine, how its KV moves, where it listens and who hears
    of it. ``listen``: the ZMQ address its channel binds (``ipc://`` when a frontend spawns
    it, ``tcp://`` for ``ferry worker``). ``redis_url``: register there as ``name`` and
    publish KV events there. ``exit_with_parent``: exit when the process that started it
    is gone. ``group``: the expert-parallel group it is a rank of (None: none)."""

    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    listen: str = ""
    name: str = ""
    redis_url: str = ""
    exit_with_parent: bool = False
    group: GroupMember | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"a worker's role is one of {ROLES}, not {self.role!r}")

    def replace(self, **changes: Any) -> WorkerConfig:
        return dataclasses.replace(self, **changes)


def leave_stopping_to_the_frontend() -> None:
    """In a worker a frontend spawned (``WorkerConfig.exit_with_parent``), from its first
    instruction: a signal sent to the whole process group (Ctrl-C in a terminal; SIGTERM
    from systemd's KillMode=control-group, ``timeout`` or a runtime that signals the
    group) is for the frontend. It reaches every process at once: a worker that died of
    it would leave the requests in flight nothing to finish on while the frontend drains,
    and its supervisor would see a crash (and restart it) before the frontend had learnt
    that it is stopping. The frontend stops its workers itself once it has drained, and a
    worker whose frontend is gone exits."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
