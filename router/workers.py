"""A worker process as the frontend sees it: spawned, supervised, talked to over ZMQ.

``WorkerProcess`` starts ``python -m <module> --config ... --input ... --output ...``,
waits for its ready message, then pumps its messages to a handler; when the process
exits it is marked dead (it leaves rotation, ``/health`` shows it) and ``on_death`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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
    def __init__(
        self,
        name: str,
        role: str,
        module: str,
        config: EngineConfig,
        args: list[str],
        decode: Callable[[bytes], msgspec.Struct],
        tmpdir: str,
        ctx: zmq.asyncio.Context,
        sync_ctx: zmq.Context,
    ) -> None:
        self.name = name
        self.role = role
        self.module = module
        self.config = config
        self.args = args
        self._decode = decode
        self.ready: msgspec.Struct | None = None
        self.dead: str | None = None
        self.stats = None  # the worker's latest EngineStats
        self.num_transferring = 0
        self.tokens_per_s = 0.0  # a prefill worker's measured rate
        # what this frontend has sent it and not yet seen finish (the router's load view)
        self.inflight = 0
        self.queued_tokens = 0
        self.proc: subprocess.Popen | None = None
        self._in_addr = f"ipc://{tmpdir}/{name}-in"
        self._out_addr = f"ipc://{tmpdir}/{name}-out"
        self._in = sync_ctx.socket(zmq.PUSH)
        self._out = ctx.socket(zmq.PULL)
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.dead is None and self.proc is not None and self.proc.poll() is None

    async def start(self, ready_type: type, failed_type: type, timeout: float) -> None:
        self._in.bind(self._in_addr)
        self._out.bind(self._out_addr)
        cmd = [
            sys.executable, "-m", self.module,
            "--config", msgspec.json.encode(self.config).decode(),
            "--input", self._in_addr, "--output", self._out_addr, *self.args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._out.poll(500):
                msg = self._decode(await self._out.recv())
                if isinstance(msg, ready_type):
                    self.ready = msg
                    return
                if isinstance(msg, failed_type):
                    raise RuntimeError(f"{self.name} failed to start: {msg.message}")
            elif self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}")
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s")

    def run(
        self,
        on_message: Callable[[WorkerProcess, msgspec.Struct], None],
        on_death: Callable[[WorkerProcess], None],
    ) -> None:
        self._task = asyncio.create_task(self._pump(on_message, on_death))

    async def _pump(self, on_message, on_death) -> None:
        while True:
            if await self._out.poll(500):
                on_message(self, self._decode(await self._out.recv()))
            elif self.proc.poll() is not None:
                code = self.proc.returncode
                self.dead = f"{self.role} worker {self.name} exited with code {code}"
                log.error("%s", self.dead)
                on_death(self)
                return

    def send(self, msg: msgspec.Struct, encode: Callable[[msgspec.Struct], bytes]) -> None:
        if self.alive:
            with contextlib.suppress(zmq.ZMQError):
                self._in.send(encode(msg), zmq.NOBLOCK)

    async def shutdown(self, shutdown_msg: bytes) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._in.send(shutdown_msg, zmq.NOBLOCK)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
            except TimeoutError:
                self.proc.kill()
        if self._task is not None:
            self._task.cancel()
        self._in.close(linger=0)
        self._out.close(linger=0)

    def describe(self) -> dict:
        return {
            "name": self.name, "role": self.role, "healthy": self.alive,
            "pid": self.proc.pid if self.proc else None, "error": self.dead,
        }  # fmt: skip
