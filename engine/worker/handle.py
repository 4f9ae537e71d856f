"""A worker as a frontend holds it: its channel, its process, its health, its stats.

The channel is a DEALER socket connected to the address the worker binds
(``engine.worker.channel``); it opens with the cluster-secret handshake — each side
proves it holds the secret (``kvstore.auth``), and a worker that cannot is refused —
after which the worker sends its ready message. A worker is either spawned by this
frontend (``spawn``: ``python -m <role module>`` on an ``ipc://`` address, dead when the
process exits, or killed when it hangs) or started elsewhere and attached (``connect``:
``ferry worker``, out of rotation while it is not heard from). Workers send stats at
least every second and a heartbeat from a thread of their own; ``run`` says what
silence does. A dead worker's ``on_death`` runs once. The aggregated engine's client and
the worker pools use the same handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engine import envs, logs
from engine.messages import (
    Codec,
    EngineStats,
    ExpertStats,
    GcStats,
    Shutdown,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    stats_of,
)
from engine.worker.channel import CHALLENGE, FRONTEND, HELLO, PROOF, WORKER
from engine.worker.config import WorkerConfig, leave_stopping_to_the_frontend
from kvstore import auth

log = logging.getLogger("ferry.workers")

_ROOT = Path(__file__).resolve().parents[2]
_COPY_BELOW = 1 << 16  # bytes: a frame at least this large is sent without a copy


class WorkerHandle:
    silence_timeout_s = 5.0
    forget_after_s = 300.0

    def __init__(
        self, name: str, role: str, codec: Codec, ctx: zmq.asyncio.Context, identity: bytes,
        secret: str | bytes,
    ) -> None:  # fmt: skip
        self.name = name
        self._key = auth.key_of(secret)
        self._identity = identity
        self.role = role
        self.address = ""
        self.codec = codec
        self.ready: WorkerReady | None = None
        self.dead: str | None = None
        self.silent = False  # joined elsewhere and not heard lately (back when heard again)
        self.spec: tuple[str, WorkerConfig] | None = None  # how it was spawned (module, config)
        self.draining = False
        self.stats: EngineStats | None = None  # the worker's latest
        self.experts: ExpertStats | None = None  # an expert-parallel rank's latest
        self.gc: GcStats | None = None  # its garbage collector's pauses, latest
        self.ready_s = 0.0  # from spawn (or connect) to its ready message
        self.mourned = False  # its death has been handled
        self.stopping = False  # this frontend is stopping it (``shutdown``): its exit is no news
        self.num_transferring = 0
        self.tokens_per_s = 0.0  # a prefill worker's measured rate
        self.proc: subprocess.Popen | None = None
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._task: asyncio.Task | None = None
        self._heard = time.monotonic()

    @property
    def label(self) -> str:
        """How log lines and errors name it."""
        if self.name == self.role:  # the aggregated engine
            return f"{self.role} process"
        return f"{self.role} worker {self.name}"

    @property
    def group(self) -> str:
        """The expert-parallel group it is a rank of ("" for none), as its ready says."""
        return self.ready.group if self.ready is not None else ""

    @property
    def rank(self) -> int:
        return self.ready.rank if self.ready is not None else 0

    @property
    def alive(self) -> bool:
        running = self.proc is None or self.proc.poll() is None
        return self.dead is None and not self.silent and running

    async def spawn(
        self, module: str, config: WorkerConfig, tmpdir: str, timeout: float, secret: str
    ) -> WorkerReady:
        """Start ``python -m <module>`` serving ``config`` on an ipc address in ``tmpdir``
        (the cluster ``secret`` in its environment, not on its command line, and this
        process's log settings: ``engine.logs.child_environment``) and wait until it is
        ready."""
        address = f"ipc://{tmpdir}/{re.sub(r'[^A-Za-z0-9_.-]', '_', self.name)}"
        self.spec = (module, config)
        config = config.replace(listen=address, exit_with_parent=True)
        cmd = [sys.executable, "-m", module, "--config", msgspec.json.encode(config).decode()]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
            envs.CLUSTER_SECRET.name: secret,
            **logs.child_environment(),
        }
        # SIGINT and SIGTERM ignored from its first instruction, even while it imports and
        # loads: a signal to the process group is for the frontend, which drains and then
        # stops its workers itself (``Shutdown``, or a kill once past the wait)
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=leave_stopping_to_the_frontend)
        return await self.connect(address, timeout)

    async def connect(self, address: str, timeout: float) -> WorkerReady:
        """Open the channel to a worker listening on ``address``: the handshake, then its
        ready message. Raises ``auth.AuthError`` if the worker does not prove the secret."""
        self.address = address
        self._sock.connect(address)
        mine = auth.nonce()
        self._sock.send(HELLO + mine, zmq.NOBLOCK)
        started = time.monotonic()
        deadline = started + timeout
        proved = False
        while time.monotonic() < deadline:
            if await self._sock.poll(500):
                payload = await self._sock.recv()
                if not proved:
                    self._answer(payload, mine)
                    proved = True
                    continue
                msg = self.codec.decode_reply(payload)
                if isinstance(msg, WorkerReady):
                    self.ready = msg
                    self._heard = time.monotonic()
                    self.ready_s = self._heard - started
                    return msg
                if isinstance(msg, WorkerFailed):
                    raise RuntimeError(f"{self.name} failed to start: {msg.message}")
            elif self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}")
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s")

    def _answer(self, challenge: bytes, mine: bytes) -> None:
        """Check the worker's proof and send ours."""
        size = 1 + auth.NONCE_BYTES + auth.PROOF_BYTES
        if challenge[:1] != CHALLENGE or len(challenge) != size:
            raise auth.AuthError(f"{self.name} at {self.address} did not open the handshake")
        theirs, answer = challenge[1 : 1 + auth.NONCE_BYTES], challenge[1 + auth.NONCE_BYTES :]
        try:
            auth.check(self._key, WORKER, self._identity, theirs, mine, answer)
        except auth.AuthError as exc:
            raise auth.AuthError(f"{self.name} at {self.address}: {exc} (is it given the "
                                 "same --cluster-secret?)") from None  # fmt: skip
        reply = auth.proof(self._key, FRONTEND, self._identity, mine, theirs)
        self._sock.send(PROOF + reply, zmq.NOBLOCK)

    def observe(self, stats: WorkerStats) -> None:
        """Take in the worker's latest stats."""
        self.stats = stats.stats
        self.num_transferring = stats.num_transferring
        self.tokens_per_s = stats.tokens_per_s
        self.draining = stats.draining
        if stats.experts is not None:
            self.experts = stats.experts
        if stats.gc is not None:
            self.gc = stats.gc

    def run(
        self,
        on_message: Callable[[WorkerHandle, msgspec.Struct], None],
        on_death: Callable[[WorkerHandle], None],
        on_silence: Callable[[WorkerHandle], None] | None = None,
        on_revive: Callable[[WorkerHandle], None] | None = None,
    ) -> None:
        """Feed every message from the worker to ``on_message`` until it dies (the stats a
        message carries are taken in first).

        Silence: a worker not heard from for ``silence_timeout_s`` (it sends a heartbeat
        every second, even through a long step) is stopped or hung. One this frontend
        spawned is killed — it dies, ``on_death`` runs. One that joined from elsewhere is
        only out of rotation (``on_silence``) until it is heard again (``on_revive``), or
        dead once silent for ``forget_after_s``."""
        self._task = asyncio.create_task(self._pump(on_message, on_death, on_silence, on_revive))

    async def _pump(self, on_message, on_death, on_silence, on_revive) -> None:
        while self.dead is None:
            if await self._sock.poll(500):
                self._heard = time.monotonic()
                msg = self.codec.decode_reply(await self._sock.recv())
                stats = stats_of(msg)
                if stats is not None:
                    self.observe(stats)
                if self.silent:
                    self.silent = False
                    log.warning("%s answers again: back in rotation", self.label)
                    if on_revive is not None:
                        on_revive(self)
                on_message(self, msg)
            elif self.proc is not None and self.proc.poll() is not None:
                self.dead = self.dead or f"{self.label} exited with code {self.proc.returncode}"
            elif self.dead is None:
                self._check_silence(on_silence)
        log.log(logging.DEBUG if self.stopping else logging.ERROR, "%s", self.dead)
        on_death(self)

    def _check_silence(self, on_silence) -> None:
        quiet = time.monotonic() - self._heard
        if quiet <= self.silence_timeout_s:
            return
        what = f"{self.label} at {self.address} stopped answering ({quiet:.0f}s)"
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.dead = f"{what}; killed"
        elif quiet > self.forget_after_s:
            self.dead = f"{what}; gone"
        elif not self.silent:
            self.silent = True
            log.error("%s: out of rotation until it answers", what)
            if on_silence is not None:
                on_silence(self)

    def leave(self, reason: str) -> None:
        """Take the worker out of rotation (it left the registry); ``on_death`` follows."""
        if self.dead is None:
            self.dead = reason

    def send(self, msg: msgspec.Struct) -> None:
        if self.alive:
            with contextlib.suppress(zmq.ZMQError):
                data = self.codec.encode(msg)
                # a large frame (an image file) goes without a copy into zmq's own buffer
                self._sock.send(data, zmq.NOBLOCK, copy=len(data) < _COPY_BELOW)

    async def shutdown(self) -> None:
        """Stop a spawned worker (one that never became ready is killed: it would not hear
        a Shutdown before its handshake); just disconnect from one that joined elsewhere."""
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            if self.ready is None:
                self.proc.kill()
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(self.codec.encode(Shutdown()), zmq.NOBLOCK)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
            except TimeoutError:
                self.proc.kill()
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)

    def describe(self) -> dict:
        described = {
            "name": self.name, "role": self.role, "healthy": self.alive,
            "draining": self.draining, "address": self.address,
            "pid": self.proc.pid if self.proc else None, "error": self.dead,
        }  # fmt: skip
        if self.group:
            described.update(group=self.group, rank=self.rank)
        if self.ready is not None and self.ready.startup:  # seconds its start took, by phase
            described["startup"] = {k: round(v, 3) for k, v in self.ready.startup.items()}
        return described
