"""The one worker shell: the loop every worker process runs, whatever its role.

A role (``WorkerRole``: the aggregated engine, prefill, decode) owns an engine and what
it moves; the shell owns the process around it — the channel to the frontends, the
Redis registration, the parent watch, drain and shutdown — so every role gets them the
same way. ``main(role_cls)`` is a role module's ``python -m`` entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import msgspec

from engine import envs, heap, logs
from engine.messages import (
    Codec,
    RequestOutput,
    Shutdown,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from engine.worker.channel import WorkerChannel
from engine.worker.config import WorkerConfig, leave_stopping_to_the_frontend

log = logging.getLogger("ferry.worker")

HEARTBEAT_S = 1.0  # stats reach every frontend at least this often (their liveness check)


@dataclass
class Outbox:
    """What a role has to say after a step.

    ``replies``: (message, last) pairs, each message with a ``request_id``, sent to the
    frontend that opened that request (``last``: nothing more will be said about it).
    ``outputs``: tokens, to their requests' frontends, the one with ``finish_reason`` last.
    ``ended``: requests that ended without a word (aborted): their frontend is forgotten.
    ``stats``: for every frontend, when something changed (None: nothing did).
    """

    replies: list[tuple[msgspec.Struct, bool]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    stats: WorkerStats | None = None


class RoleStopped(Exception):
    """Raised by a role's ``step`` or ``tick`` when the worker cannot go on (a rank whose
    expert-parallel group lost a rank): the shell logs the reason in one line, closes the
    role and returns 1, the process's exit status."""


class OpenedRequest(Protocol):
    """A request a message opened: its id, the HTTP request it belongs to, and the tokens
    it brings (a prompt's; an image's embedding rows)."""

    @property
    def request_id(self) -> str: ...

    @property
    def trace_id(self) -> str: ...

    @property
    def num_input_tokens(self) -> int: ...


class WorkerRole(ABC):
    """What a worker does, plugged into the shell's loop (``serve``).

    The contract, per loop iteration of the shell:

    1. Every input that has arrived goes to ``handle``, in order (never ``Shutdown``: the
       shell stops on it). ``handle`` returns the request the message opens, if it opens
       one (an ``EngineRequest``, or a role's own request message: ``OpenedRequest``);
       the shell then sends that request's replies and outputs to the frontend it came
       from, and logs one line when it ends (``RequestLog``).
    2. ``step()`` runs once: at most one engine step, plus whatever the role moves; its
       ``Outbox`` is sent at once.
    3. When ``busy`` is false the shell first waits up to ``wait_ms`` for an input; if none
       comes it calls ``tick()`` (timers: a reservation that expired) and sends its outbox
       instead of stepping. Stats go to every frontend at least every ``HEARTBEAT_S``
       (``stats()``): frontends tell by them that the worker is alive.

    Drain: once the drain event is set, ``draining`` is true (and said in every stats
    message: frontends send nothing new), and the shell returns once ``stoppable`` — by
    default ``settled`` (nothing running, nothing held for a transfer); a rank of a group
    only once its whole group is. ``Shutdown`` goes to ``shutdown()``: True (the default)
    and the shell returns at once; False (a rank of a group, which stops with its group)
    and it returns once ``stoppable``. ``check_integrity`` runs whenever the role is settled,
    when ``FERRY_DEBUG_INTEGRITY`` is on. ``step`` and ``tick`` may raise ``RoleStopped``
    to end the worker. ``close`` runs once, after the loop, however it ended. A role is
    built as ``role_cls(config, secret)``; one that cannot be built (its constructor
    raises) is reported to the frontends as ``WorkerFailed``.
    """

    role: ClassVar[str]
    codec: ClassVar[Codec]
    draining: bool = False

    @abstractmethod
    def ready(self) -> WorkerReady: ...

    @abstractmethod
    def handle(self, msg: msgspec.Struct) -> OpenedRequest | None: ...

    @abstractmethod
    def step(self) -> Outbox: ...

    @abstractmethod
    def stats(self) -> WorkerStats: ...

    @property
    @abstractmethod
    def busy(self) -> bool: ...

    @property
    def settled(self) -> bool:
        return not self.busy

    @property
    def stoppable(self) -> bool:
        return self.settled

    def shutdown(self) -> bool:
        """A frontend sent ``Shutdown``: whether the shell returns at once."""
        return True

    @property
    def wait_ms(self) -> int:
        return int(HEARTBEAT_S * 1000)

    def tick(self) -> Outbox:
        return Outbox()

    def check_integrity(self) -> None:  # noqa: B027 - optional for a role
        pass

    def close(self) -> None:  # noqa: B027 - optional for a role
        pass


def serve(role_cls: type[WorkerRole], config: WorkerConfig, channel: WorkerChannel,
          secret: str, drain: threading.Event | None = None) -> int:  # fmt: skip
    """Run the role ``role_cls(config, secret)`` on ``channel`` until shut down, orphaned
    or drained (``drain``: once set, finish what it has and return); registered on Redis
    as ``config.name`` when ``config.redis_url`` is set. ``secret``: the cluster secret
    (the channel proves it already; the role's KV transport proves it too). Returns the
    process's exit status: 1 when the role could not start or stopped (``RoleStopped``)."""
    drain = drain or threading.Event()
    started = process_age()
    registration = None
    if config.redis_url:
        from kvstore.registry import WorkerRegistration

        announcement = {"name": config.name, "role": config.role, "address": channel.address}
        registration = WorkerRegistration(config.redis_url, announcement, drain)
        registration.start()
        channel.event_sink = registration.publish
    try:
        try:
            role = role_cls(config, secret)
        except Exception as exc:
            # one line; the traceback only when debugging
            log.error("%s worker failed to start: %s: %s", config.role, type(exc).__name__, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
            channel.ready(WorkerFailed(f"{type(exc).__name__}: {exc}"))
            channel.linger()
            return 1
        ready = role.ready()
        ready = msgspec.structs.replace(ready, startup={"process": started, **ready.startup})
        frozen = heap.freeze_startup()  # built and warmed up: the rest is serving
        log.debug("%d objects of the startup frozen out of garbage collection", frozen)
        heap.pauses()
        channel.ready(ready)
        _announce_ready(config, ready, channel.address)
        channel.start_heartbeat(HEARTBEAT_S)
        name = config.name or channel.address
        try:
            _loop(role, channel, drain, _orphan_check(config.exit_with_parent), RequestLog())
        except RoleStopped as exc:
            log.error("%s worker %s stopped: %s", config.role, name, exc)
            return 1
        finally:
            role.close()
        log.info("%s worker %s stopped", config.role, name)
        return 0
    finally:
        if registration is not None:
            registration.stop()
        channel.close()


def _announce_ready(config: WorkerConfig, ready: WorkerReady, address: str) -> None:
    """What runs here: the worker, its device, its KV cache, how KV moves, its tiers."""
    name = config.name or config.role
    transport = "" if config.role == "engine" else f", KV transport {config.transfer.transport}"
    receiver = ready.endpoint.address if ready.endpoint is not None else None
    if receiver is not None:  # a /proc/<pid>/fd path or a port: for whoever debugs transfers
        log.debug("%s worker %s receives KV at %s", config.role, name, receiver)
    tiers = config.engine.cache.tiers_summary()
    cache = (f"KV cache {logs.size(ready.kv_cache_bytes)} ({ready.num_blocks} blocks of "
             f"{ready.block_size} tokens, context {ready.max_model_len})")  # fmt: skip
    if config.role == "encode":  # image embeddings, kept in memory and the file tier only
        tiers = dataclasses.replace(config.engine.cache, host_memory_gb=0).tiers_summary()
        cache = (f"embedding cache {logs.size(ready.kv_cache_bytes)} ({ready.num_blocks} "
                 f"blocks of {ready.block_size} rows)")  # fmt: skip
    logs.announce(
        f"{config.role} worker {name} ready on {ready.device or config.engine.device}: "
        f"{cache}{transport}, tiers: {tiers}{startup_phrase(ready.startup)}",
        worker=name, role=config.role, device=ready.device, address=address,
        kv_cache_bytes=ready.kv_cache_bytes, kv_blocks=ready.num_blocks,
        block_size=ready.block_size, transport=config.transfer.transport,
        receiver=receiver, tiers=tiers,
    )  # fmt: skip


STARTUP_NAMES = {"process": "process", "weights": "weights", "compile": "kernels",
                 "warm_up": "warm-up", "graphs": "graphs"}  # fmt: skip


def startup_phrase(startup: dict[str, float]) -> str:
    """``; started in 9.6 s: process 1.2, weights 0.4, kernels 7.4, graphs 0.3`` (the
    phases of ``WorkerReady.startup`` that took a tenth of a second or more)."""
    phases = [(STARTUP_NAMES.get(k, k.replace("_", " ")), v) for k, v in startup.items()]
    shown = ", ".join(f"{name} {v:.1f}" for name, v in phases if v >= 0.05)
    return f"; started in {sum(startup.values()):.1f} s: {shown}" if shown else ""


@dataclass
class _Opened:
    trace_id: str
    prompt_tokens: int
    started: float = field(default_factory=time.monotonic)
    output_tokens: int = 0


class RequestLog:
    """One info line per request a worker ends, naming the HTTP request it belongs to
    (``EngineRequest.trace_id``): how it ended, its prompt and output tokens, how long it
    was here. Token ids and text are never logged."""

    def __init__(self) -> None:
        self._open: dict[str, _Opened] = {}

    def opened(self, request: OpenedRequest) -> None:
        self._open[request.request_id] = _Opened(request.trace_id, request.num_input_tokens)

    def output(self, out: RequestOutput) -> None:
        req = self._open.get(out.request_id)
        if req is None:
            return
        req.output_tokens += len(out.new_token_ids)
        if out.finish_reason is not None:
            reason = out.finish_reason + (f" ({out.error})" if out.error else "")
            self._ended(out.request_id, reason, out.num_cached_tokens)

    def replied(self, msg: msgspec.Struct) -> None:
        """A role's last reply about a request (``PrefillDone``, ``PrefillFailed``)."""
        error = getattr(msg, "error", None)
        self._ended(msg.request_id, type(msg).__name__ + (f" ({error})" if error else ""))

    def aborted(self, rid: str) -> None:
        self._ended(rid, "aborted")

    def _ended(self, rid: str, how: str, cached: int | None = None) -> None:
        req = self._open.pop(rid, None)
        if req is None:
            return
        seconds = time.monotonic() - req.started
        cached_text = "" if cached is None else f" ({cached} cached)"
        log.info("%s ended (%s) after %.3f s: %d prompt tokens%s, %d output tokens", rid, how,
                 seconds, req.prompt_tokens, cached_text, req.output_tokens,
                 extra=logs.about(req.trace_id, {
                     "engine_request_id": rid, "outcome": how, "seconds": round(seconds, 6),
                     "prompt_tokens": req.prompt_tokens, "output_tokens": req.output_tokens,
                     "cached_tokens": cached}))  # fmt: skip


def _loop(role: WorkerRole, channel: WorkerChannel, drain: threading.Event,
          orphaned: Callable[[], bool], requests: RequestLog) -> None:  # fmt: skip
    check = envs.DEBUG_INTEGRITY.get()
    stopping = False  # Shutdown arrived; the role stops with its group
    worked = False  # stepped since the last idle moment
    while True:
        role.draining = drain.is_set()
        if (role.draining or stopping) and role.stoppable:
            if not stopping:
                channel.stats(role.stats())
            return
        if not role.busy and not channel.poll(role.wait_ms):
            if orphaned():
                return
            if worked:
                heap.trim()
                worked = False
            _send(channel, role, role.tick(), requests)
            continue
        worked = True
        for frontend, msg in channel.pending():
            if isinstance(msg, Shutdown):
                if role.shutdown():
                    return
                stopping = True
                continue
            opened = role.handle(msg)
            if opened is not None:
                channel.claim(opened.request_id, frontend)
                requests.opened(opened)
        _send(channel, role, role.step(), requests)
        if check and role.settled:
            role.check_integrity()


def _send(channel: WorkerChannel, role: WorkerRole, outbox: Outbox, requests: RequestLog) -> None:
    for msg, last in outbox.replies:
        channel.reply(msg.request_id, msg, last)
        if last:
            requests.replied(msg)
    for out in outbox.outputs:
        requests.output(out)
    for rid in outbox.ended:
        channel.release(rid)
        requests.aborted(rid)
    stats = outbox.stats
    if stats is None and channel.last_stats + HEARTBEAT_S <= time.monotonic():
        stats = role.stats()
    if stats is not None:
        stats.gc = heap.pauses().snapshot()
    if outbox.outputs:
        channel.outputs(outbox.outputs, stats)
    elif stats is not None:
        channel.stats(stats)


def process_age() -> float:
    """Seconds since this process started (the interpreter's start and the imports, when
    called first thing); 0 where ``/proc`` does not say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _orphan_check(enabled: bool) -> Callable[[], bool]:
    """Whether the process that started this one (a frontend) has gone, when ``enabled``."""
    parent = os.getppid()
    return lambda: enabled and os.getppid() != parent


def main(role_cls: type[WorkerRole], argv: list[str] | None = None) -> None:
    """A role module's entry point: ``python -m <module> --config <WorkerConfig JSON>``."""
    parser = argparse.ArgumentParser(description=f"a ferry {role_cls.role} worker")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=WorkerConfig)
    logs.configure(logs.LogConfig.from_environment(), config.name or config.role)
    if config.exit_with_parent:  # the frontend stops it: a signal to the group is for that
        leave_stopping_to_the_frontend()
    secret = envs.CLUSTER_SECRET.get()
    if not secret:
        sys.exit(f"a {role_cls.role} worker needs the cluster secret in "
                 f"${envs.CLUSTER_SECRET.name} (a frontend that spawns it sets it)")
    sys.exit(serve(role_cls, config, WorkerChannel(config.listen, role_cls.codec, secret),
                   secret))  # fmt: skip
