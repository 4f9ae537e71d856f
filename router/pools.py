"""The frontend's prefill, decode and encode pools: which workers there are, and their
state.

Workers are spawned by this frontend (``start``), attached when they announce themselves
(``add_worker``: ``POST /internal/workers``) or found in the Redis registry
(``router.registry``). A worker takes requests once it is ready; the first one sets the
model facts (block size, the hash extras of the prefix index, the model name), and one
that serves another model is turned away. Every message a worker sends passes through
here first: its stats update the worker's load and health figures and its KV events
feed the prefix index (unless Redis does), then the request protocol
(``router.disagg``) gets what is about requests. A dead worker leaves rotation and the
index before the protocol hears of it. Encode workers (``encode.worker``) set none of the
model facts, and count neither for the context length nor in the summed stats: they are
checked to serve the model the others serve, and their block events (the embeddings they
hold) feed the same index.
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
from typing import Protocol

import msgspec
import zmq.asyncio
from prometheus_client import Counter

from decode.messages import CODEC as DECODE
from encode.messages import CODEC as ENCODE
from engine.config import EngineConfig
from engine.media import EMBED_BLOCK_SIZE
from engine.messages import EngineStats, stats_of
from engine.worker.config import WorkerConfig
from prefill.messages import CODEC as PREFILL
from router.config import PDConfig
from router.metrics import TransferMetrics, WorkerQueueCollector
from router.registry import RedisDirectory
from router.routing import Router
from router.workers import WorkerProcess

log = logging.getLogger("ferry.router")

ROLES = {
    "prefill": ("prefill.worker", PREFILL),
    "decode": ("decode.worker", DECODE),
    "encode": ("encode.worker", ENCODE),
}


class PoolEvents(Protocol):
    """What the request protocol (``router.disagg``) hears from the pools: each message
    about requests (stats are taken in here first), a worker's death or silence (what it
    had must move elsewhere), and a silent worker answering again."""

    def worker_message(self, worker: WorkerProcess, msg: msgspec.Struct) -> None: ...

    def worker_gone(self, worker: WorkerProcess) -> None: ...

    def worker_back(self, worker: WorkerProcess) -> None: ...


RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # then a spawned worker is given up on
RESTART_WINDOW_S = 600.0  # restarts longer ago than this are forgotten


class WorkerPools:
    def __init__(
        self, config: EngineConfig, pd: PDConfig, secret: str, router: Router,
        transfers: TransferMetrics, events: PoolEvents,
    ) -> None:  # fmt: skip
        self.config = config
        self.pd = pd
        self._secret = secret
        self.router = router
        self.transfers = transfers
        self._events = events
        self._restarts: dict[str, list[float]] = {}  # name -> when it was restarted
        self.start_timeout = 900.0
        self._closing = False
        self._restarting: set[asyncio.Task] = set()
        self.restarts = Counter("ferry_worker_restarts", "Spawned workers restarted after "
                                "they died or hung", ["role"], registry=None)  # fmt: skip
        self.model_name = ""
        self.facts_set = False  # model facts come from the first worker taken in
        self.max_model_len = 0
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        self.prefill: list[WorkerProcess] = []
        self.decode: list[WorkerProcess] = []
        self.encode: list[WorkerProcess] = []
        self.embed_block_size = EMBED_BLOCK_SIZE  # an encode worker's, once one is ready
        self.frontend_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._tmp = tempfile.mkdtemp(prefix="ferry-")
        self._ctx = zmq.asyncio.Context()
        self._joining: set[str] = set()
        self.directory: RedisDirectory | None = None
        self._directory_task: asyncio.Task | None = None

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode, *self.encode]

    @property
    def engines(self) -> list[WorkerProcess]:
        """The prefill and decode workers: those that run the language model."""
        return [*self.prefill, *self.decode]

    def pool(self, role: str) -> list[WorkerProcess]:
        return {"prefill": self.prefill, "decode": self.decode, "encode": self.encode}[role]

    def live(self, role: str, exclude: WorkerProcess | None = None) -> list[WorkerProcess]:
        """The workers of ``role`` that take new requests."""
        return [w for w in self.pool(role) if w.alive and not w.draining and w is not exclude]

    # -- membership ----------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn the configured workers and wait until they are ready; then follow the
        Redis registry, if there is one."""
        self.start_timeout = timeout
        pd = self.pd
        roles = (["prefill"] * pd.num_prefill + ["decode"] * pd.num_decode
                 + ["encode"] * pd.num_encode)  # fmt: skip
        devices = worker_devices(self.config.device, len(roles))
        counts = dict.fromkeys(ROLES, 0)
        started = []
        for role, device in zip(roles, devices):
            name = f"{role[0]}{counts[role]}"
            counts[role] += 1
            if pd.redis_url:  # registered for every frontend: the name must be unique
                name = f"{self.frontend_id}/{name}"
            engine = self.config.replace(device=device, vision=self._encodes(role))
            config = WorkerConfig(role, engine, pd.transfer, name=name,
                                  redis_url=pd.redis_url)  # fmt: skip
            worker = self._handle(name, role)
            started.append(worker.spawn(ROLES[role][0], config, self._tmp, timeout,
                                        self._secret))  # fmt: skip
            self.pool(role).append(worker)
        await asyncio.gather(*started)
        for worker in self.workers:
            self._enlist(worker)
        if pd.redis_url:
            self.directory = RedisDirectory(pd.redis_url, self._join, self.router.index.apply,
                                            self._set_draining)  # fmt: skip
            self._directory_task = asyncio.create_task(self.directory.run())

    def _encodes(self, role: str) -> bool:
        """Whether a spawned worker of ``role`` runs the vision tower: the encode workers;
        the prefill workers when there are none (they encode their images themselves);
        never the decode workers (they get the prompt's KV)."""
        return role == "encode" or (role == "prefill" and self.pd.num_encode == 0)

    def _handle(self, name: str, role: str) -> WorkerProcess:
        worker = WorkerProcess(name, role, ROLES[role][1], self._ctx,
                               self.frontend_id.encode(), self._secret)  # fmt: skip
        worker.silence_timeout_s = self.pd.silence_timeout_s
        return worker

    async def add_worker(self, name: str, role: str, address: str, timeout: float = 900.0):
        """Attach a worker started elsewhere (``ferry worker``) listening on ``address``;
        it takes requests once it is ready. A worker of the same name that is still
        alive is kept (a repeated registration); a dead one is replaced."""
        if role not in ROLES:
            raise ValueError(f"a worker's role is one of {sorted(ROLES)}, not {role!r}")
        old = next((w for w in self.workers if w.name == name), None)
        if (old is not None and old.alive) or name in self._joining:
            return old
        worker = self._handle(name, role)
        self._joining.add(name)
        try:
            await worker.connect(address, timeout)
            refusal = self._refusal(worker)
            if refusal is not None:
                raise ValueError(refusal)
        except BaseException:
            await worker.shutdown()
            raise
        finally:
            self._joining.discard(name)
        if old is not None:
            for group in (self.prefill, self.decode, self.encode):
                if old in group:
                    group.remove(old)
        self.pool(role).append(worker)
        self._enlist(worker)
        log.info("%s worker %s joined from %s", role, name, address)
        return worker

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

    def _enlist(self, worker: WorkerProcess) -> None:
        """Take a ready worker into rotation: the first prefill or decode worker sets the
        model facts."""
        ready = worker.ready
        if worker.role == "encode":
            self.embed_block_size = ready.block_size
        elif not self.facts_set:
            self.block_size = self.router.block_size = ready.block_size
            self.router.hash_extra = ready.hash_extra
            self.model_name = ready.model_name
            self.facts_set = True
        worker.run(self._received, self._died, self._silenced, self._revived)
        self._sized()

    def _refusal(self, worker: WorkerProcess) -> str | None:
        """Why a ready worker cannot join the workers in rotation, if it cannot."""
        ready = worker.ready
        if worker.role == "encode" or ready.role == "encode":
            if ready.role != worker.role:
                return f"{worker.name} announced itself as {worker.role}, is {ready.role}"
            if self.model_name and ready.model_name != self.model_name:
                return f"{worker.name} encodes for {ready.model_name}, not {self.model_name}"
            return None
        if self.facts_set and (ready.block_size, ready.hash_extra) != (
            self.block_size, self.router.hash_extra
        ):  # fmt: skip
            return f"{worker.name} serves another model or block size"
        return None

    def _sized(self) -> None:
        """Context length and block count from the prefill and decode workers in rotation."""
        live = [w for w in self.engines if w.alive and w.ready is not None]
        self.max_model_len = min((w.ready.max_model_len for w in live), default=0)
        self.num_blocks = sum(w.ready.num_blocks for w in live)

    def _received(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        stats = stats_of(msg)
        if stats is not None:
            if stats.events and self.directory is None:  # with Redis, its stream feeds it
                self.router.index.apply(worker.name, stats.events)
            for e in stats.events:
                self.transfers.kv_events.labels(worker.role, e.kind).inc()
        if stats is not msg:
            self._events.worker_message(worker, msg)

    def _died(self, worker: WorkerProcess) -> None:
        self.router.index.remove_worker(worker.name)
        self._sized()
        self._events.worker_gone(worker)
        if worker.spec is not None and self.pd.restart_workers and not self._closing:
            task = asyncio.create_task(self._restart(worker))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)

    def _silenced(self, worker: WorkerProcess) -> None:
        """A joined worker went silent: out of rotation (its requests move) until heard."""
        self.router.index.remove_worker(worker.name)
        self._sized()
        self._events.worker_gone(worker)

    def _revived(self, worker: WorkerProcess) -> None:
        self._sized()
        self._events.worker_back(worker)

    async def _restart(self, dead: WorkerProcess) -> None:
        """Start a dead spawned worker again in its place, after a back-off; give up after
        ``len(RESTART_BACKOFF_S)`` restarts within ``RESTART_WINDOW_S``."""
        await dead.shutdown()  # its channel: it would reconnect to the new process
        now = time.monotonic()
        recent = [t for t in self._restarts.get(dead.name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= len(RESTART_BACKOFF_S):
            log.error("%s died %d times in %.0f s: not restarting it", dead.label,
                      len(recent) + 1, RESTART_WINDOW_S)  # fmt: skip
            return
        wait = RESTART_BACKOFF_S[len(recent)]
        self._restarts[dead.name] = [*recent, now]
        log.warning("restarting %s in %.0f s (%s)", dead.label, wait, dead.dead)
        await asyncio.sleep(wait)
        if self._closing:
            return
        module, config = dead.spec
        worker = self._handle(dead.name, dead.role)
        pool = self.pool(dead.role)
        try:
            await worker.spawn(module, config, self._tmp, self.start_timeout, self._secret)
        except asyncio.CancelledError:  # the frontend is shutting down meanwhile
            await worker.shutdown()
            raise
        except Exception as exc:  # it failed to start: that is a death too
            log.error("%s did not restart: %s", dead.label, exc)
            await worker.shutdown()
            worker.dead = str(exc)
            self._swap(pool, dead, worker)
            self._died(worker)
            return
        self._swap(pool, dead, worker)
        self.restarts.labels(dead.role).inc()
        self._enlist(worker)
        log.info("%s restarted", worker.label)

    @staticmethod
    def _swap(pool: list[WorkerProcess], old: WorkerProcess, new: WorkerProcess) -> None:
        if old in pool:
            pool[pool.index(old)] = new
        else:
            pool.append(new)

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._restarting):
            task.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        if self._directory_task is not None:
            self._directory_task.cancel()
            await asyncio.gather(self._directory_task, return_exceptions=True)
            await self.directory.close()
        await asyncio.gather(*(w.shutdown() for w in self.workers), return_exceptions=True)
        self._ctx.destroy(linger=0)  # every socket closed, none left to wait for
        shutil.rmtree(self._tmp, ignore_errors=True)

    # -- state -----------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return any(w.alive for w in self.prefill) and any(w.alive for w in self.decode)

    def health(self) -> dict:
        health = {"healthy": self.is_healthy, "topology": "disaggregated",
                  "transport": self.pd.transfer.transport,
                  "workers": [w.describe() for w in self.workers]}  # fmt: skip
        if self.directory is not None:
            health["redis"] = {"connected": self.directory.connected,
                               "events_read": self.directory.events_read}  # fmt: skip
        return health

    @property
    def stats(self) -> EngineStats:
        """The live prefill and decode workers' latest stats, summed (what the
        single-engine metrics show)."""
        total: dict[str, int] = {}
        for s in (w.stats for w in self.engines if w.alive and w.stats is not None):
            for k, v in msgspec.structs.asdict(s).items():
                total[k] = total.get(k, 0) + v
        return EngineStats(**total)

    def collectors(self) -> list:
        return [WorkerQueueCollector(lambda: self.workers), self.restarts]


def worker_devices(device: str, count: int) -> list[str]:
    """One device per worker: a bare ``cuda`` spreads the workers over the visible GPUs in
    turn (prefill workers first); anything else (``cpu``, ``cuda:1``) is used by all. A
    frontend that starts no workers needs no GPU."""
    if device != "cuda" or count == 0:
        return [device] * count
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ValueError("--device cuda, but no GPU is visible")
    return [f"cuda:{i % n}" for i in range(count)]
