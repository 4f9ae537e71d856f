"""The frontend's handle on the prefill and decode pools: what ``EngineClient`` is for
the single-engine topology, with the same surface (``start``, ``generate``, ``abort``,
``stats``, ``is_healthy``, ``shutdown``), so the server does not know the difference.

A request, seen from here:

1. ``generate`` hashes the prompt into its block chain (``kvstore.hashing``), asks the
   prefix index (``router.index``, fed by the workers' KV events) what each decode worker
   already holds of it, lets the decode pool's policy (``router.policies``) pick a decode
   worker D and sends it a ``DecodeRequest``.
2. D either prefills it itself (short uncached tail) and just streams outputs, or
   reserves blocks and answers ``KVWanted``; the prefill pool's policy then picks a
   prefill worker P (again from the index and the load this frontend has sent each
   worker) and this client sends it a ``PrefillRequest``.
3. P computes the prompt, ships the KV into D's blocks and answers ``PrefillDone`` (or
   ``PrefillFailed``); this client tells D ``KVReady`` (or ``KVFailed``) — always, also
   when the client has left, because D frees the reserved blocks only then.
4. D streams ``RequestOutput``s, first token first, into the request's queue.

Failures: a prefill that fails for a reason other than the request itself (its worker
died, the transfer broke) is retried on another prefill worker, into the same reserved
blocks. When a decode worker dies, each of its requests *migrates*: another decode
worker gets the prompt plus the tokens already streamed as a resumed request
(``output_token_ids``: they count as output, for max_tokens, penalties and a grammar), its
prefix comes from whichever cache holds it, and the client's stream goes on from the
next token, none lost or repeated. Each attempt has its own id on the worker channels
(``wire_id``), so nothing of a dead attempt can mix into the next. Leaving ``generate``
early aborts on both sides. Dead workers leave rotation and the index.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from decode import messages as dm
from engine.client import EngineDeadError
from engine.config import EngineConfig
from engine.loader import load_tokenizer, model_name
from engine.messages import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.hashing import BlockHash
from prefill import messages as pm
from router.config import PDConfig
from router.metrics import TransferMetrics, WorkerQueueCollector
from router.registry import RedisDirectory
from router.routing import Router
from router.workers import WorkerProcess

log = logging.getLogger("ferry.router")

_READY = {  # per role: the worker's ready message, and its failure to start
    "prefill": (pm.PrefillReady, pm.WorkerFailed),
    "decode": (dm.DecodeReady, pm.WorkerFailed),
}

MAX_ATTEMPTS = 4  # a request migrates at most this many times minus one


@dataclass
class _Route:
    """A client's request while its stream is open."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    arrival: float
    hashes: list[BlockHash]
    decode: WorkerProcess
    queue: asyncio.Queue
    emitted: list[int] = field(default_factory=list)  # tokens already given to the client
    attempt: int = 0
    predicted_hit: int = 0  # tokens the index said the chosen workers hold
    seen_first: bool = False
    finished: bool = False  # its last output is in the queue

    @property
    def wire_id(self) -> str:
        return self.request_id if not self.attempt else f"{self.request_id}~{self.attempt}"


@dataclass
class _Transfer:
    """A prefill whose KV a decode worker waits for (outlives the route if the client
    leaves: the decode worker must still hear how it ended)."""

    request: pm.PrefillRequest
    prefill: WorkerProcess
    decode: WorkerProcess
    queued_tokens: int
    tried: set[str] = field(default_factory=set)


class DisaggClient:
    def __init__(self, config: EngineConfig, pd: PDConfig) -> None:
        if pd.transport == "nccl" and not config.device.startswith("cuda"):
            raise ValueError("the nccl KV transport needs GPU workers (--device cuda)")
        self.config = config
        self.pd = pd
        self.model_name = ""
        self.max_model_len = 0
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        self.tokenizer = None
        self.transfers = TransferMetrics()
        self.router = Router(pd.policy, config.cache.block_size)
        self.router_metrics = self.router.metrics
        self.index = self.router.index
        self._routes: dict[str, _Route] = {}  # by the client's request id
        self._wire: dict[str, _Route] = {}  # by the id of the current attempt
        self._pending: dict[str, _Transfer] = {}  # by wire id
        self.frontend_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._tmp = tempfile.mkdtemp(prefix="ferry-")
        self._ctx = zmq.asyncio.Context()
        self.prefill: list[WorkerProcess] = []
        self.decode: list[WorkerProcess] = []
        self._joining: set[str] = set()
        self.directory: RedisDirectory | None = None
        self._directory_task: asyncio.Task | None = None

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> None:
        """Spawn the configured workers (there may be none: workers can also join at
        runtime, ``add_worker``) and wait until they are ready."""
        pd = self.pd
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.config.model))
        self.model_name = model_name(self.config.model)
        common = ["--transport", pd.transport, "--transfer-timeout", str(pd.transfer_timeout_s)]
        d_args = [*common, "--local-prefill-tokens", str(pd.local_prefill_tokens),
                  "--kv-host", pd.kv_host]  # fmt: skip
        devices = iter(worker_devices(self.config.device, pd.num_prefill + pd.num_decode))
        spawns = [(f"p{i}", "prefill", common) for i in range(pd.num_prefill)]
        spawns += [(f"d{i}", "decode", d_args) for i in range(pd.num_decode)]
        started = []
        for name, role, args in spawns:
            if pd.redis_url:  # registered for every frontend: the name must be unique
                name = f"{self.frontend_id}/{name}"
                args = [*args, "--redis", pd.redis_url, "--name", name, "--role", role]
            worker = self._handle(name, role)
            config = self.config.replace(device=next(devices))
            ready, failed = _READY[role]
            started.append(worker.spawn(f"{role}.worker", config, args, self._tmp, ready,
                                        failed, timeout))  # fmt: skip
            (self.prefill if role == "prefill" else self.decode).append(worker)
        await asyncio.gather(*started)
        self.tokenizer = await tokenizer
        for worker in self.workers:
            self._enlist(worker)
        if pd.redis_url:
            self.directory = RedisDirectory(pd.redis_url, self._join, self.index.apply,
                                            self._set_draining)  # fmt: skip
            self._directory_task = asyncio.create_task(self.directory.run())

    def _join(self, name: str, role: str, address: str) -> None:
        """A worker found in the registry: attach it in the background."""
        if any(w.name == name and w.alive for w in self.workers) or name in self._joining:
            return
        task = asyncio.create_task(self.add_worker(name, role, address))

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("worker %s at %s could not join: %s", name, address, t.exception())

        task.add_done_callback(done)

    def _set_draining(self, name: str, draining: bool) -> None:
        for w in self.workers:
            if w.name == name and draining:
                w.draining = True

    def _handle(self, name: str, role: str) -> WorkerProcess:
        decoder = pm.decode_message if role == "prefill" else dm.decode_message
        return WorkerProcess(name, role, decoder, self._ctx, self.frontend_id.encode())

    async def add_worker(self, name: str, role: str, address: str, timeout: float = 900.0):
        """Attach a worker started elsewhere (``ferry worker``) listening on ``address``;
        it takes requests once it is ready. A worker of the same name that is still
        alive is kept (a repeated registration); a dead one is replaced."""
        if role not in _READY:
            raise ValueError(f"a worker's role is prefill or decode, not {role!r}")
        pool = self.prefill if role == "prefill" else self.decode
        old = next((w for w in self.workers if w.name == name), None)
        if (old is not None and old.alive) or name in self._joining:
            return old
        worker = self._handle(name, role)
        self._joining.add(name)
        try:
            await worker.connect(address, *_READY[role], timeout)
        except BaseException:
            await worker.shutdown(b"")
            raise
        finally:
            self._joining.discard(name)
        if old is not None:
            for group in (self.prefill, self.decode):
                if old in group:
                    group.remove(old)
        pool.append(worker)
        self._enlist(worker)
        log.info("%s worker %s joined from %s", role, name, address)
        return worker

    def _enlist(self, worker: WorkerProcess) -> None:
        """Take a ready worker into rotation: the first one sets the model facts."""
        ready = worker.ready
        if self.max_model_len == 0:
            self.block_size = self.router.block_size = ready.block_size
            self.router.hash_extra = ready.hash_extra
            self.model_name = ready.model_name
        elif (ready.block_size, ready.hash_extra) != (self.block_size, self.router.hash_extra):
            worker.leave(f"{worker.name} serves another model or block size")
        self.max_model_len = min(w.ready.max_model_len for w in self.workers if w.ready)
        self.num_blocks = sum(w.ready.num_blocks for w in self.workers if w.ready)
        if worker.role == "prefill":
            worker.run(self._on_prefill, self._on_prefill_death)
        else:
            worker.run(self._on_decode, self._on_decode_death)

    async def shutdown(self) -> None:
        if self._directory_task is not None:
            self._directory_task.cancel()
            await asyncio.gather(self._directory_task, return_exceptions=True)
            await self.directory.close()
        await asyncio.gather(
            *(w.shutdown(pm.encode(pm.Shutdown())) for w in self.workers), return_exceptions=True
        )
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return any(w.alive for w in self.prefill) and any(w.alive for w in self.decode)

    def health(self) -> dict:
        health = {"healthy": self.is_healthy, "topology": "disaggregated",
                  "transport": self.pd.transport,
                  "workers": [w.describe() for w in self.workers]}  # fmt: skip
        if self.directory is not None:
            health["redis"] = {"connected": self.directory.connected,
                               "events_read": self.directory.events_read}  # fmt: skip
        return health

    def collectors(self) -> list:
        return [*self.transfers.collectors(), *self.router_metrics.collectors(),
                WorkerQueueCollector(lambda: self.workers)]  # fmt: skip

    @property
    def stats(self) -> EngineStats:
        """The workers' latest stats, summed (what the single-engine metrics show)."""
        total: dict[str, int] = {}
        for s in (w.stats for w in self.workers if w.stats is not None):
            for k, v in msgspec.structs.asdict(s).items():
                total[k] = total.get(k, 0) + v
        return EngineStats(**total)

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last has ``finish_reason``. Leaving early
        aborts it on both workers."""
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        hashes = self.router.hashes(prompt_token_ids)
        decode = self._choose_decode(hashes, len(prompt_token_ids))
        route = _Route(request_id, prompt_token_ids, sampling, time.time(), hashes, decode,
                       asyncio.Queue())  # fmt: skip
        self._routes[request_id] = route
        self._dispatch(route)
        finished = False
        try:
            while not finished:
                out = await route.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None
                yield out
        finally:
            self._close(route)
            if not finished:
                self._abort(route)

    def _choose_decode(
        self, hashes: list[BlockHash], num_tokens: int, exclude: WorkerProcess | None = None
    ) -> WorkerProcess:
        decode = [w for w in self.decode if w.alive and not w.draining and w is not exclude]
        if not decode or not any(w.alive for w in self.prefill):
            raise EngineDeadError("no live prefill/decode engine workers")
        return self.router.choose("decode", decode, hashes, num_tokens)[0]

    def _dispatch(self, route: _Route) -> None:
        """Send the route's current attempt to its decode worker."""
        self._wire[route.wire_id] = route
        route.decode.inflight += 1
        route.predicted_hit = self.router.hit_tokens(route.decode, route.hashes)
        route.decode.send(
            dm.DecodeRequest(route.wire_id, route.prompt, route.sampling, route.arrival,
                             output_token_ids=list(route.emitted)),
            dm.encode,
        )  # fmt: skip

    def _close(self, route: _Route) -> None:
        """The client is done with ``route``: stop counting it."""
        if self._routes.get(route.request_id) is route:
            del self._routes[route.request_id]
        if self._wire.pop(route.wire_id, None) is not None:
            route.decode.inflight -= 1

    async def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            self._close(route)
            self._abort(route)

    def _abort(self, route: _Route) -> None:
        wid = route.wire_id
        route.decode.send(dm.AbortDecode([wid]), dm.encode)
        pending = self._pending.get(wid)
        if pending is not None:
            pending.prefill.send(pm.AbortPrefill([wid]), pm.encode)

    # -- worker messages --------------------------------------------------------------------

    def _on_decode(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        if isinstance(msg, dm.DecodeOutputs):
            if msg.stats is not None:
                worker.stats = msg.stats
            worker.num_transferring = msg.num_transferring
            worker.draining = msg.draining
            self._apply_events(worker, msg.events)
            for out in msg.outputs:
                wid = out.request_id
                if out.finish_reason == "error" and wid in self._pending:
                    # D gave up on the KV (its reservation expired): stop the prefill too
                    self._settle(wid).prefill.send(pm.AbortPrefill([wid]), pm.encode)
                route = self._wire.get(wid)
                if route is not None and route.decode is worker:
                    self._deliver(route, out)
        elif isinstance(msg, dm.KVWanted):
            self._want_kv(worker, msg)

    def _deliver(self, route: _Route, out: RequestOutput) -> None:
        if not route.seen_first:
            route.seen_first = True
            self.router_metrics.hits(route.predicted_hit, out.num_cached_tokens)
        if route.attempt or out.request_id != route.request_id:
            # a resumed attempt: the client knows it by its own id, and its prompt only
            cached = min(out.num_cached_tokens, len(route.prompt))
            out = msgspec.structs.replace(out, request_id=route.request_id,
                                          num_cached_tokens=cached)  # fmt: skip
        route.emitted.extend(out.new_token_ids)
        route.finished = out.finish_reason is not None
        route.queue.put_nowait(out)

    def _want_kv(self, decode: WorkerProcess, msg: dm.KVWanted) -> None:
        wid = msg.request_id
        route = self._wire.get(wid)
        if route is None:  # the client left before the blocks were reserved
            decode.send(dm.KVFailed(wid, "request gone"), dm.encode)
            return
        request = pm.PrefillRequest(wid, route.prompt, route.sampling, msg.dest, route.arrival,
                                    output_token_ids=list(route.emitted))  # fmt: skip
        self._send_prefill(request, decode, set(), route.hashes)

    def _send_prefill(
        self, request: pm.PrefillRequest, decode: WorkerProcess, tried: set[str],
        hashes: list[BlockHash],
    ) -> None:  # fmt: skip
        """Have a prefill worker not in ``tried`` fill ``request.dest``; tell ``decode``
        KVFailed if none is left."""
        wid = request.request_id
        live = [w for w in self.prefill if w.alive and not w.draining and w.name not in tried]
        if not live:
            decode.send(dm.KVFailed(wid, "no live prefill worker could compute the prompt"),
                        dm.encode)  # fmt: skip
            return
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        prefill, hit = self.router.choose("prefill", live, hashes, num_tokens)
        queued = max(0, num_tokens - hit)
        prefill.inflight += 1
        prefill.queued_tokens += queued
        self._pending[wid] = _Transfer(request, prefill, decode, queued, tried | {prefill.name})
        route = self._wire.get(wid)
        if route is not None:
            route.predicted_hit = max(route.predicted_hit, hit)
        prefill.send(request, pm.encode)

    def _settle(self, wid: str) -> _Transfer:
        transfer = self._pending.pop(wid)
        transfer.prefill.inflight -= 1
        transfer.prefill.queued_tokens -= transfer.queued_tokens
        return transfer

    def _on_prefill(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        if isinstance(msg, pm.PrefillStats):
            worker.stats = msg.stats
            worker.num_transferring = msg.num_transferring
            worker.tokens_per_s = msg.tokens_per_s
            worker.draining = msg.draining
            self._apply_events(worker, msg.events)
            return
        if not isinstance(msg, pm.PrefillDone | pm.PrefillFailed):
            return
        wid = msg.request_id
        if wid not in self._pending or self._pending[wid].prefill is not worker:
            return
        transfer = self._settle(wid)
        decode = transfer.decode
        if isinstance(msg, pm.PrefillDone):
            self.transfers.record(msg.num_blocks, msg.num_bytes, msg.seconds,
                                  msg.num_streamed_blocks)  # fmt: skip
            decode.send(dm.KVReady(wid, msg.first_token, msg.logprob, msg.num_cached_tokens),
                        dm.encode)  # fmt: skip
            return
        if not msg.aborted:
            self.transfers.failures.inc()
        if msg.retry and wid in self._wire:
            self._retry_prefill(transfer, msg.error)
        else:
            decode.send(dm.KVFailed(wid, msg.error), dm.encode)

    def _retry_prefill(self, transfer: _Transfer, error: str) -> None:
        wid = transfer.request.request_id
        if time.time() > transfer.request.dest.deadline:
            transfer.decode.send(dm.KVFailed(wid, error), dm.encode)
            return
        log.warning("prefill of %s on %s failed (%s); retrying elsewhere", wid,
                    transfer.prefill.name, error)  # fmt: skip
        self.router_metrics.retries.inc()
        route = self._wire.get(wid)
        hashes = route.hashes if route is not None else []
        self._send_prefill(transfer.request, transfer.decode, transfer.tried, hashes)

    def _apply_events(self, worker: WorkerProcess, events: list) -> None:
        if events and self.directory is None:  # with Redis, the index follows its stream
            self.index.apply(worker.name, events)
        for e in events:
            self.transfers.kv_events.labels(worker.role, e.kind).inc()

    # -- deaths -------------------------------------------------------------------------------

    def _on_decode_death(self, worker: WorkerProcess) -> None:
        self.index.remove_worker(worker.name)
        for wid, transfer in list(self._pending.items()):
            if transfer.decode is worker:
                self._settle(wid).prefill.send(pm.AbortPrefill([wid]), pm.encode)
        for route in [r for r in self._wire.values() if r.decode is worker]:
            self._migrate(route, f"{worker.dead} (its engine process died)")

    def _migrate(self, route: _Route, why: str) -> None:
        """Resume ``route`` on another decode worker, from the tokens already streamed."""
        self._wire.pop(route.wire_id, None)
        route.decode.inflight -= 1
        if route.finished:
            return
        context = route.prompt + route.emitted
        hashes = self.router.hashes(context)
        try:
            if route.attempt + 1 >= MAX_ATTEMPTS:
                raise EngineDeadError(f"gave up after {MAX_ATTEMPTS} attempts")
            decode = self._choose_decode(hashes, len(context), exclude=route.decode)
        except EngineDeadError as exc:
            route.queue.put_nowait(EngineDeadError(f"{why}; {exc}"))
            return
        route.hashes, route.decode = hashes, decode
        log.warning("%s: resuming %s on %s after %d tokens", why, route.request_id,
                    route.decode.name, len(route.emitted))  # fmt: skip
        self.router_metrics.migrations.inc()
        route.attempt += 1
        self._dispatch(route)

    def _on_prefill_death(self, worker: WorkerProcess) -> None:
        self.index.remove_worker(worker.name)
        for wid, transfer in list(self._pending.items()):
            if transfer.prefill is worker:
                self._settle(wid)
                self.transfers.failures.inc()
                if wid in self._wire:
                    self._retry_prefill(transfer, f"{worker.dead} before the KV arrived")
                else:
                    transfer.decode.send(dm.KVFailed(wid, f"{worker.dead} before the KV "
                                                          "arrived"), dm.encode)  # fmt: skip


def worker_devices(device: str, count: int) -> list[str]:
    """One device per worker: a bare ``cuda`` spreads the workers over the visible GPUs in
    turn (prefill workers first); anything else (``cpu``, ``cuda:1``) is used by all."""
    if device != "cuda":
        return [device] * count
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ValueError("--device cuda, but no GPU is visible")
    return [f"cuda:{i % n}" for i in range(count)]
