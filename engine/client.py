"""The server's side of the engine: the ``ServingClient`` interface, and its aggregated
implementation.

``ServingClient`` is everything the server (``server.app``, ``server.serving``) asks of
the engine side, whichever topology runs behind it: ``EngineClient`` here (one engine
process that prefills and decodes) or ``router.disagg.DisaggClient`` (prefill and decode
pools). ``EngineClient`` spawns ``python -m engine.core`` through the worker handle
(``engine.worker.handle``), fans the engine's outputs out to one asyncio queue per
request, and keeps the tokenizer here, in the frontend process, not in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import msgspec
import zmq.asyncio

from engine.config import EngineConfig
from engine.loader import load_image_inputs, load_tokenizer
from engine.messages import (
    ENGINE,
    Abort,
    EngineRequest,
    EngineStats,
    MediaItem,
    Outputs,
    RequestOutput,
)
from engine.sampling_params import SamplingParams
from engine.vision import ImageInputs
from engine.worker.config import WorkerConfig
from engine.worker.handle import WorkerHandle
from kvstore import auth

log = logging.getLogger("ferry.client")


class EngineDeadError(RuntimeError):
    """The engine process is gone; requests in flight cannot complete."""


class ReaderTooSlow(RuntimeError):
    """A request's reader fell ``OUTPUT_BUFFER`` outputs behind: it was aborted."""


OUTPUT_BUFFER = 1024  # outputs one request may have waiting for its reader


def offer(queue: asyncio.Queue, item: RequestOutput | Exception) -> bool:
    """Put ``item`` on a request's queue; when its reader has fallen ``OUTPUT_BUFFER``
    behind, empty the queue, leave ``ReaderTooSlow`` in it and return False: the caller
    aborts the request, so a reader that stops reading holds a bounded buffer and slows
    no one else."""
    if queue.qsize() < OUTPUT_BUFFER or isinstance(item, Exception):
        queue.put_nowait(item)
        return True
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(ReaderTooSlow(f"the reader fell {OUTPUT_BUFFER} outputs behind"))
    return False


async def outputs_of(queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue (as ``offer`` fills it) up to the last. Outputs
    that piled up while the reader was busy come out joined into one: a reader that falls
    behind (a busy frontend at high concurrency) catches up with fewer, larger chunks
    instead of paying its per-output cost (detokenizing, rendering, writing) for each."""
    while True:
        out = await queue.get()
        if isinstance(out, Exception):
            raise out
        while out.finish_reason is None and not queue.empty():
            later = queue.get_nowait()
            if isinstance(later, Exception):
                yield out
                raise later
            out = out.then(later)
        yield out
        if out.finish_reason is not None:
            return


class WorkerRefused(ValueError):
    """A worker asked to join a topology that takes none (one engine process)."""


class ServingClient(Protocol):
    """What the server needs from the engine side.

    ``start`` brings the engines up (and waits until they are ready), ``shutdown`` stops
    them. ``generate`` streams one request's outputs (the last has ``finish_reason``);
    leaving it early aborts the request everywhere, as ``abort`` does. ``health`` is the
    body of ``/health`` (None: status only), ``stats`` the engines' summed figures,
    ``workers`` the handles of the worker processes, and ``collectors`` their own
    Prometheus collectors. ``images``: what the frontend needs to
    put images into a prompt (None: the model takes none); ``generate``'s ``media`` are
    the prompt's images, with their files. ``join`` starts attaching a worker
    that announced itself (the task ends once it is ready, or with why not) or raises
    ``WorkerRefused`` at once. ``trace_id``: the HTTP request a generated request belongs
    to, which the workers' log lines name. ``num_in_flight`` counts the requests being generated;
    ``stop_all`` ends every one of them with ``EngineDeadError(reason)`` (a server that
    is shutting down).
    """

    tokenizer: Any
    model_name: str
    max_model_len: int
    images: ImageInputs | None

    @property
    def is_healthy(self) -> bool: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def workers(self) -> Sequence[WorkerHandle]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        media: Sequence[MediaItem] = (), trace_id: str = "",
    ) -> AsyncIterator[RequestOutput]: ...  # fmt: skip

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> dict | None: ...

    def collectors(self) -> list: ...

    def join(self, name: str, role: str, address: str) -> asyncio.Task: ...

    @property
    def num_in_flight(self) -> int: ...

    def stop_all(self, reason: str) -> None: ...


class EngineClient:
    """The aggregated topology: one engine process does prefill and decode. ``secret``:
    the cluster secret the engine process proves on its channel (default: a fresh one)."""

    def __init__(self, config: EngineConfig, secret: str | None = None) -> None:
        self.config = config
        self._secret = secret or auth.make_secret()
        self.model_name = ""
        self.max_model_len = 0
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        self.tokenizer = None
        self.images: ImageInputs | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._tmp = tempfile.mkdtemp(prefix="ferry-")
        self._ctx = zmq.asyncio.Context()
        self._engine = WorkerHandle("engine", "engine", ENGINE, self._ctx, b"frontend",
                                    self._secret)  # fmt: skip
        self._stats = EngineStats()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> None:
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.config.model))
        images = asyncio.create_task(asyncio.to_thread(load_image_inputs, self.config.model))
        ready = await self._engine.spawn("engine.core", WorkerConfig("engine", self.config),
                                         self._tmp, timeout, self._secret)  # fmt: skip
        self.tokenizer = await tokenizer
        self.images = await images
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.block_size = ready.block_size
        self.num_blocks = ready.num_blocks
        self._engine.run(self._received, self._died)

    async def shutdown(self) -> None:
        await self._engine.shutdown()
        self._ctx.destroy(linger=0)  # every socket closed, none left to wait for
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return self._engine.alive

    @property
    def stats(self) -> EngineStats:
        return self._engine.stats or self._stats

    @property
    def workers(self) -> list[WorkerHandle]:
        return [self._engine]

    def health(self) -> None:
        return None

    def collectors(self) -> list:
        return []

    def join(self, name: str, role: str, address: str) -> asyncio.Task:
        raise WorkerRefused("this server runs one engine (--aggregated): no worker can join it")

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        media: Sequence[MediaItem] = (),
        trace_id: str = "",
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Stream the engine's outputs for one request; the last has ``finish_reason``.
        Leaving early (break, cancellation) aborts the request in the engine. The engine
        encodes the images of ``media`` itself."""
        if not self.is_healthy:
            raise EngineDeadError(self._engine.dead or "engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        self._engine.send(EngineRequest(request_id, prompt_token_ids, sampling, time.time(),
                                        media=list(media), trace_id=trace_id))  # fmt: skip
        finished = False
        try:
            async for out in outputs_of(queue):
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._engine.send(Abort([request_id]))

    async def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._engine.send(Abort([request_id]))

    def _received(self, engine: WorkerHandle, msg: msgspec.Struct) -> None:
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None and not offer(queue, out):
                    self._queues.pop(out.request_id)
                    self._engine.send(Abort([out.request_id]))

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def stop_all(self, reason: str) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(EngineDeadError(reason))
            self._engine.send(Abort([rid]))
        self._queues.clear()

    def _died(self, engine: WorkerHandle) -> None:
        reason = engine.dead or "engine process exited"
        log.error("%s; failing %d requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
