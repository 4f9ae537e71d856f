"""The frontend's handle on an engine process.

``EngineClient`` starts ``python -m engine.core`` as a child process, talks to it over
two ZMQ sockets (requests out, output batches in) and fans the engine's output
batches out to one asyncio queue per request. The tokenizer lives here, in the
frontend process, not in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.loader import load_tokenizer
from engine.messages import (
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineStats,
    RequestOutput,
    Shutdown,
    decode_message,
    encode,
)
from engine.sampling_params import SamplingParams

log = logging.getLogger("ferry.client")

_ROOT = Path(__file__).resolve().parent.parent


class EngineDeadError(RuntimeError):
    """The engine process is gone; requests in flight cannot complete."""


class EngineClient:
    # the engine computes a request's prompt logprobs in its prefill and sends them on
    # its first output (``RequestOutput.prompt_logprobs``)
    serves_prompt_logprobs = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stats = EngineStats()
        self.model_name = ""
        self.max_model_len = 0
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        self.tokenizer = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._proc: subprocess.Popen | None = None
        self._dead: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="ferry-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._in = self._sync_ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> None:
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        cmd = [
            sys.executable, "-m", "engine.core",
            "--config", msgspec.json.encode(self.config).decode(),
            "--input", in_addr, "--output", out_addr,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self._proc = subprocess.Popen(cmd, env=env)
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.config.model))
        ready = await self._wait_ready(timeout)
        self.tokenizer = await tokenizer_task
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.block_size = ready.block_size
        self.num_blocks = ready.num_blocks
        self._task = asyncio.create_task(self._output_loop())

    async def _wait_ready(self, timeout: float) -> EngineReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._out.poll(500):
                msg = decode_message(await self._out.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    raise RuntimeError(f"engine failed to start: {msg.message}")
            elif self._proc.poll() is not None:
                raise RuntimeError(f"engine process exited with code {self._proc.returncode}")
        raise TimeoutError(f"engine not ready after {timeout:.0f}s")

    async def shutdown(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._in.send(encode(Shutdown()), zmq.NOBLOCK)
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 10)
            except TimeoutError:
                self._proc.kill()
        if self._task is not None:
            self._task.cancel()
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.poll() is None

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream the engine's outputs for one request; the last has ``finish_reason``.
        Leaving early (break, cancellation) aborts the request in the engine."""
        if not self.is_healthy:
            raise EngineDeadError(self._dead or "engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        self._send(EngineRequest(request_id, prompt_token_ids, sampling, time.time()))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.is_healthy:
                self._send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None and self.is_healthy:
            self._send(AbortRequests([request_id]))

    def _send(self, msg: msgspec.Struct) -> None:
        self._in.send(encode(msg))

    async def _output_loop(self) -> None:
        while True:
            if await self._out.poll(1000):
                msg = decode_message(await self._out.recv())
                if isinstance(msg, EngineOutputs):
                    self._dispatch(msg)
            elif self._proc.poll() is not None:
                self._fail_all(f"engine process exited with code {self._proc.returncode}")
                return

    def _dispatch(self, msg: EngineOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats
        for out in msg.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        log.error("%s; failing %d requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
