"""A prefill or decode worker as the frontend sees it: its channel, its health, its load.

The channel is a DEALER socket connected to the address the worker binds
(``engine.ipc.WorkerChannel``); it opens with an empty message (the hello), which the
worker answers with its ready message. A worker is either spawned by this frontend
(``spawn``: a child process on an ``ipc://`` address, dead when the process exits) or
started elsewhere and attached at runtime (``connect``: ``ferry worker``, dead when it has
not been heard from for ``silence_timeout_s`` — workers send stats at least every
second). A dead worker leaves rotation, ``/health`` shows it and ``on_death`` runs once.
A worker that says it is draining stays alive for what it runs but gets no new requests.
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

from engine.config import EngineConfig

log = logging.getLogger("ferry.router")

_ROOT = Path(__file__).resolve().parent.parent


class WorkerProcess:
    silence_timeout_s = 5.0

    def __init__(
        self, name: str, role: str, decode: Callable[[bytes], msgspec.Struct],
        ctx: zmq.asyncio.Context, identity: bytes,
    ) -> None:  # fmt: skip
        self.name = name
        self.role = role
        self.address = ""
        self._decode = decode
        self.ready: msgspec.Struct | None = None
        self.dead: str | None = None
        self.draining = False
        self.stats = None  # the worker's latest EngineStats
        self.num_transferring = 0
        self.tokens_per_s = 0.0  # a prefill worker's measured rate
        # what this frontend has sent it and not yet seen finish (the router's load view)
        self.inflight = 0
        self.queued_tokens = 0
        self.proc: subprocess.Popen | None = None
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._task: asyncio.Task | None = None
        self._heard = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.dead is None and (self.proc is None or self.proc.poll() is None)

    @property
    def spawned(self) -> bool:
        return self.proc is not None

    async def spawn(
        self, module: str, config: EngineConfig, args: list[str], tmpdir: str,
        ready_type: type, failed_type: type, timeout: float,
    ) -> None:  # fmt: skip
        """Start ``python -m <module>`` on an ipc address and wait until it is ready."""
        address = f"ipc://{tmpdir}/{re.sub(r'[^A-Za-z0-9_.-]', '_', self.name)}"
        cmd = [
            sys.executable, "-m", module, "--config", msgspec.json.encode(config).decode(),
            "--listen", address, "--exit-with-parent", *args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(cmd, env=env)
        await self.connect(address, ready_type, failed_type, timeout)

    async def connect(
        self, address: str, ready_type: type, failed_type: type, timeout: float
    ) -> None:
        """Open the channel to a worker listening on ``address``; wait for its ready."""
        self.address = address
        self._sock.connect(address)
        self._sock.send(b"", zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._sock.poll(500):
                msg = self._decode(await self._sock.recv())
                if isinstance(msg, ready_type):
                    self.ready = msg
                    self._heard = time.monotonic()
                    return
                if isinstance(msg, failed_type):
                    raise RuntimeError(f"{self.name} failed to start: {msg.message}")
            elif self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}")
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s")

    def run(
        self,
        on_message: Callable[[WorkerProcess, msgspec.Struct], None],
        on_death: Callable[[WorkerProcess], None],
    ) -> None:
        self._task = asyncio.create_task(self._pump(on_message, on_death))

    async def _pump(self, on_message, on_death) -> None:
        while self.dead is None:
            if await self._sock.poll(500):
                self._heard = time.monotonic()
                on_message(self, self._decode(await self._sock.recv()))
            elif self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                self.dead = f"{self.role} worker {self.name} exited with code {code}"
            elif self.proc is None and time.monotonic() - self._heard > self.silence_timeout_s:
                self.dead = (f"{self.role} worker {self.name} at {self.address} stopped "
                             f"answering ({self.silence_timeout_s:.0f}s)")  # fmt: skip
        log.error("%s", self.dead)
        on_death(self)

    def leave(self, reason: str) -> None:
        """Take the worker out of rotation (it left the registry); ``on_death`` follows."""
        if self.dead is None:
            self.dead = reason

    def send(self, msg: msgspec.Struct, encode: Callable[[msgspec.Struct], bytes]) -> None:
        if self.alive:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(msg), zmq.NOBLOCK)

    async def shutdown(self, shutdown_msg: bytes) -> None:
        """Stop a spawned worker; just disconnect from one that joined from elsewhere."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(shutdown_msg, zmq.NOBLOCK)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
            except TimeoutError:
                self.proc.kill()
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)

    def describe(self) -> dict:
        return {
            "name": self.name, "role": self.role, "healthy": self.alive,
            "draining": self.draining, "address": self.address,
            "pid": self.proc.pid if self.proc else None, "error": self.dead,
        }  # fmt: skip
