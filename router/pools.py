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

**Expert-parallel groups** (``PDConfig.decode_ep`` / ``prefill_ep``, or ranks that say so
in their ready message): each rank is a worker of its own here — its own channel, prefix
index entries, load and health — named ``<worker>/r<rank>``, and the spawned ranks of a
group meet through a rendezvous file in this frontend's private temporary directory. A
group lives and dies whole: when one rank dies or goes silent, every other rank of its
group leaves rotation at once and the spawned ones are killed (so none waits in a
collective for a peer that is gone), each rank's requests migrate as on any death, and
once every rank's death is handled the group is started again, all ranks together.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any, Protocol

import msgspec
import zmq.asyncio
from prometheus_client import Counter

from decode.messages import CODEC as DECODE
from encode.messages import CODEC as ENCODE
from engine.config import EMBED_BLOCK_SIZE, EngineConfig
from engine.messages import EngineStats, stats_of
from engine.worker.config import GroupMember, WorkerConfig
from prefill.messages import CODEC as PREFILL
from router.config import PDConfig
from router.metrics import ExpertLoadCollector, TransferMetrics, WorkerQueueCollector
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
        self.groups: dict[str, list[WorkerProcess]] = {}  # group name -> its ranks, in order
        self._regrouping: set[str] = set()  # groups being started again
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
        plan = [("prefill", pd.prefill_ep)] * pd.num_prefill
        plan += [("decode", pd.decode_ep)] * pd.num_decode
        plan += [("encode", 1)] * pd.num_encode
        devices = iter(worker_devices(self.config.device, sum(size for _, size in plan)))
        counts = dict.fromkeys(ROLES, 0)
        started = []
        for role, size in plan:
            name = f"{role[0]}{counts[role]}"
            counts[role] += 1
            if pd.redis_url:  # registered for every frontend: the name must be unique
                name = f"{self.frontend_id}/{name}"
            ranks = self._specs(role, name, [next(devices) for _ in range(size)])
            for rank_name, config in ranks:
                worker = self._handle(rank_name, role)
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

    def _specs(self, role: str, name: str, devices: list[str]) -> list[tuple[str, WorkerConfig]]:
        """(name, config) of each process of the worker ``name``: one, or the ranks of an
        expert-parallel group on ``devices`` (one each), which meet through a fresh
        rendezvous file here."""
        pd = self.pd

        def config(device: str, worker: str, group: GroupMember | None = None) -> WorkerConfig:
            engine = self.config.replace(device=device, vision=self._encodes(role))
            return WorkerConfig(role, engine, pd.transfer,
                                name=worker, redis_url=pd.redis_url, group=group)  # fmt: skip

        if len(devices) == 1:
            return [(name, config(devices[0], name))]
        if devices[0].startswith("cuda") and len(set(devices)) < len(devices):
            raise ValueError(f"an expert-parallel group of {len(devices)} ranks needs as many "
                             f"GPUs, one per rank (got {devices})")  # fmt: skip
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        rendezvous = f"{self._tmp}/{safe}-{uuid.uuid4().hex[:8]}.rendezvous"
        ranks = []
        for rank, device in enumerate(devices):
            member = GroupMember(name, rank, len(devices), rendezvous)
            ranks.append((f"{name}/r{rank}", config(device, f"{name}/r{rank}", member)))
        return ranks

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
        model facts; a rank of a group joins the group's list."""
        ready = worker.ready
        if worker.group:
            ranks = self.groups.setdefault(worker.group, [])
            ranks[:] = sorted([r for r in ranks if r.name != worker.name] + [worker],
                              key=lambda r: r.rank)  # fmt: skip
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
        self._take_down(worker)
        self._sized()
        self._events.worker_gone(worker)
        worker.mourned = True
        if self._closing or not self.pd.restart_workers:
            return
        if worker.group:
            self._restart_when_down(worker.group)
        elif worker.spec is not None:
            self._track(self._restart(worker))

    def _silenced(self, worker: WorkerProcess) -> None:
        """A joined worker went silent: out of rotation (its requests move) until heard."""
        self.router.index.remove_worker(worker.name)
        self._take_down(worker)
        self._sized()
        self._events.worker_gone(worker)

    def _take_down(self, worker: WorkerProcess) -> None:
        """A rank of a group is gone: so is the rest of the group. Every other rank leaves
        rotation now (its own death follows from its pump), and a spawned one is killed
        (not while this frontend stops them all)."""
        if self._closing:
            return
        for rank in self.groups.get(worker.group, []) if worker.group else []:
            if rank is worker or rank.dead is not None:
                continue
            rank.leave(f"{rank.label}: {worker.label} of its group {worker.group} is gone")
            if rank.proc is not None and rank.proc.poll() is None:
                rank.proc.kill()

    def _restart_when_down(self, group: str) -> None:
        """Once the death of every rank of a spawned group has been handled, start the
        group again."""
        ranks = self.groups.get(group, [])
        spawned = all(r.spec is not None for r in ranks)
        if spawned and all(r.mourned for r in ranks) and group not in self._regrouping:
            self._regrouping.add(group)
            self._track(self._restart_group(group))

    def _track(self, restart) -> None:
        """Run a restart as a task that shutdown cancels."""
        task = asyncio.create_task(restart)
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    def _revived(self, worker: WorkerProcess) -> None:
        self._sized()
        self._events.worker_back(worker)

    def _backoff(self, name: str, label: str, why: str | None) -> float | None:
        """Seconds to wait before restarting ``name`` again; None once it has been
        restarted ``len(RESTART_BACKOFF_S)`` times within ``RESTART_WINDOW_S``."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= len(RESTART_BACKOFF_S):
            log.error("%s died %d times in %.0f s: not restarting it", label, len(recent) + 1,
                      RESTART_WINDOW_S)  # fmt: skip
            return None
        self._restarts[name] = [*recent, now]
        wait = RESTART_BACKOFF_S[len(recent)]
        log.warning("restarting %s in %.0f s (%s)", label, wait, why)
        return wait

    async def _restart_group(self, group: str) -> None:
        """Start every rank of a dead spawned group again, together (a fresh rendezvous,
        the same devices and names), after a back-off; a group that fails to start is dead
        again (and tried again, with the next back-off)."""
        try:
            failed = await self._start_group_again(group)
        finally:
            self._regrouping.discard(group)
        if failed:
            self._restart_when_down(group)

    async def _start_group_again(self, group: str) -> bool:
        """Whether starting ``group`` again failed."""
        dead = list(self.groups[group])
        role = dead[0].role
        await asyncio.gather(*(r.shutdown() for r in dead))
        wait = self._backoff(group, f"{role} group {group}", dead[0].dead)
        if wait is None:
            return False
        await asyncio.sleep(wait)
        if self._closing:
            return False
        specs = self._specs(role, group, [r.spec[1].engine.device for r in dead])
        fresh = [self._handle(name, role) for name, _ in specs]
        try:
            outcomes = await asyncio.gather(*(
                w.spawn(ROLES[role][0], config, self._tmp, self.start_timeout, self._secret)
                for w, (_, config) in zip(fresh, specs)
            ), return_exceptions=True)  # fmt: skip
        except asyncio.CancelledError:  # the frontend is shutting down meanwhile
            await asyncio.gather(*(w.shutdown() for w in fresh), return_exceptions=True)
            raise
        for old, new in zip(dead, fresh):
            self._swap(self.pool(role), old, new)
        self.groups[group] = fresh
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            log.error("%s group %s did not restart: %s", role, group, failure)
            for w in fresh:
                if w.proc is not None and w.proc.poll() is None:
                    w.proc.kill()
                await w.shutdown()
                w.dead, w.mourned = w.dead or f"did not restart: {failure}", True
            self._sized()
            return True
        for w in fresh:
            self.restarts.labels(role).inc()
            self._enlist(w)
        log.info("%s group %s restarted", role, group)
        return False

    async def _restart(self, dead: WorkerProcess) -> None:
        """Start a dead spawned worker again in its place, after a back-off; give up after
        ``len(RESTART_BACKOFF_S)`` restarts within ``RESTART_WINDOW_S``."""
        await dead.shutdown()  # its channel: it would reconnect to the new process
        wait = self._backoff(dead.name, dead.label, dead.dead)
        if wait is None:
            return
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
        if self.groups:
            health["groups"] = [
                {"name": name, "role": ranks[0].role, "size": len(ranks),
                 "healthy": all(r.alive for r in ranks), "ranks": [r.name for r in ranks]}
                for name, ranks in self.groups.items() if ranks
            ]  # fmt: skip
        if self.directory is not None:
            health["redis"] = {"connected": self.directory.connected,
                               "events_read": self.directory.events_read}  # fmt: skip
        return health

    @property
    def stats(self) -> EngineStats:
        """The live prefill and decode workers' latest stats, summed (what the
        single-engine metrics show)."""
        total: dict[str, Any] = {}
        for s in (w.stats for w in self.engines if w.alive and w.stats is not None):
            for k, v in msgspec.structs.asdict(s).items():
                total[k] = _add(total.get(k), v)
        return EngineStats(**total)

    def collectors(self) -> list:
        return [WorkerQueueCollector(lambda: self.workers),
                ExpertLoadCollector(lambda: self.groups), self.restarts]  # fmt: skip


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


def _add(total: Any, value: Any) -> Any:
    """``total + value`` for a stats field: numbers add, per-position lists add elementwise
    (the longer list's tail kept)."""
    if total is None:
        return value
    if isinstance(value, list):
        longer, shorter = (total, value) if len(total) >= len(value) else (value, total)
        return [a + b for a, b in zip(longer, shorter)] + longer[len(shorter) :]
    return total + value
