"""The frontend's handle on the prefill and decode pools: what ``EngineClient`` is for
the single-engine topology, with the same surface (``start``, ``generate``, ``abort``,
``stats``, ``is_healthy``, ``shutdown``), so the server does not know the difference.

A request, seen from here:

1. ``generate`` pairs a prefill worker P and a decode worker D (``router.pairing``) and
   sends D a ``DecodeRequest``.
2. D either prefills it itself (short uncached tail) and just streams outputs, or
   reserves blocks and answers ``KVWanted``; this client forwards that to P as a
   ``PrefillRequest`` (to another P if the chosen one died meanwhile).
3. P computes the prompt, ships the KV into D's blocks and answers ``PrefillDone`` (or
   ``PrefillFailed``); this client tells D ``KVReady`` (or ``KVFailed``) — always, also
   when the client has left, because D frees the reserved blocks only then.
4. D streams ``RequestOutput``s, first token first, into the request's queue.

Leaving ``generate`` early aborts on both sides. A dead D fails its requests at once
(``EngineDeadError``) and aborts their prefills; a dead P turns its pending transfers
into ``KVFailed``, which D reports to the client as an error. Dead workers leave rotation.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from decode import messages as dm
from engine.client import EngineDeadError
from engine.config import EngineConfig
from engine.loader import load_tokenizer
from engine.messages import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from prefill import messages as pm
from router.config import PDConfig
from router.metrics import TransferMetrics, WorkerQueueCollector
from router.pairing import Candidate, get_policy
from router.workers import WorkerProcess

log = logging.getLogger("ferry.router")


@dataclass
class _Route:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    arrival: float
    prefill: WorkerProcess
    decode: WorkerProcess
    queue: asyncio.Queue


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
        self._policy = get_policy(pd.pairing)
        self._routes: dict[str, _Route] = {}
        self._pending: dict[str, tuple[WorkerProcess, WorkerProcess]] = {}  # rid -> (P, D)
        self._tmp = tempfile.mkdtemp(prefix="ferry-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        common = ["--transport", pd.transport, "--transfer-timeout", str(pd.transfer_timeout_s)]
        devices = worker_devices(config.device, pd.num_prefill + pd.num_decode)
        self.prefill = [
            self._worker(f"p{i}", "prefill", "prefill.worker", common, pm.decode_message,
                         devices[i])  # fmt: skip
            for i in range(pd.num_prefill)
        ]
        d_args = [*common, "--local-prefill-tokens", str(pd.local_prefill_tokens),
                  "--kv-host", pd.kv_host]  # fmt: skip
        self.decode = [
            self._worker(f"d{i}", "decode", "decode.worker", d_args, dm.decode_message,
                         devices[pd.num_prefill + i])  # fmt: skip
            for i in range(pd.num_decode)
        ]

    def _worker(self, name, role, module, args, decoder, device: str) -> WorkerProcess:
        config = self.config.replace(device=device)
        return WorkerProcess(name, role, module, config, args, decoder, self._tmp,
                             self._ctx, self._sync_ctx)  # fmt: skip

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> None:
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.config.model))
        await asyncio.gather(
            *(w.start(pm.PrefillReady, pm.WorkerFailed, timeout) for w in self.prefill),
            *(w.start(dm.DecodeReady, pm.WorkerFailed, timeout) for w in self.decode),
        )
        self.tokenizer = await tokenizer
        first = self.decode[0].ready
        self.model_name = first.model_name
        self.block_size = first.block_size
        self.num_blocks = sum(w.ready.num_blocks for w in self.workers)
        self.max_model_len = min(w.ready.max_model_len for w in self.workers)
        for w in self.prefill:
            w.run(self._on_prefill, self._on_prefill_death)
        for w in self.decode:
            w.run(self._on_decode, self._on_decode_death)

    async def shutdown(self) -> None:
        await asyncio.gather(
            *(w.shutdown(pm.encode(pm.Shutdown())) for w in self.workers), return_exceptions=True
        )
        self._ctx.term()
        self._sync_ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return any(w.alive for w in self.prefill) and any(w.alive for w in self.decode)

    def health(self) -> dict:
        return {"healthy": self.is_healthy, "topology": "disaggregated",
                "transport": self.pd.transport,
                "workers": [w.describe() for w in self.workers]}  # fmt: skip

    def collectors(self) -> list:
        return [*self.transfers.collectors(), WorkerQueueCollector(lambda: self.workers)]

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
        prefill = [w for w in self.prefill if w.alive]
        decode = [w for w in self.decode if w.alive]
        if not prefill or not decode:
            raise EngineDeadError("no live prefill/decode engine workers")
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        pair = self._policy.select(_candidates(prefill), _candidates(decode), prompt_token_ids)
        route = _Route(request_id, prompt_token_ids, sampling, time.time(),
                       prefill[pair.prefill], decode[pair.decode], asyncio.Queue())  # fmt: skip
        self._routes[request_id] = route
        route.decode.send(
            dm.DecodeRequest(request_id, prompt_token_ids, sampling, route.arrival), dm.encode
        )
        finished = False
        try:
            while not finished:
                out = await route.queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finish_reason is not None
                yield out
        finally:
            self._routes.pop(request_id, None)
            if not finished:
                self._abort(route)

    async def abort(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self._abort(route)

    def _abort(self, route: _Route) -> None:
        rid = route.request_id
        route.decode.send(dm.AbortDecode([rid]), dm.encode)
        pending = self._pending.get(rid)
        if pending is not None:
            pending[0].send(pm.AbortPrefill([rid]), pm.encode)

    # -- worker messages --------------------------------------------------------------------

    def _on_decode(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        if isinstance(msg, dm.DecodeOutputs):
            if msg.stats is not None:
                worker.stats = msg.stats
            worker.num_transferring = msg.num_transferring
            self._count_events(worker, msg.events)
            for out in msg.outputs:
                if out.finish_reason == "error" and out.request_id in self._pending:
                    # D gave up on the KV (its reservation expired): stop the prefill too
                    prefill, _ = self._pending.pop(out.request_id)
                    prefill.send(pm.AbortPrefill([out.request_id]), pm.encode)
                route = self._routes.get(out.request_id)
                if route is not None:
                    route.queue.put_nowait(out)
        elif isinstance(msg, dm.KVWanted):
            self._want_kv(worker, msg)

    def _want_kv(self, decode: WorkerProcess, msg: dm.KVWanted) -> None:
        rid = msg.request_id
        route = self._routes.get(rid)
        if route is None:  # the client left before the blocks were reserved
            decode.send(dm.KVFailed(rid, "request gone"), dm.encode)
            return
        prefill = route.prefill if route.prefill.alive else self._any_prefill()
        if prefill is None:
            decode.send(dm.KVFailed(rid, "no live prefill worker"), dm.encode)
            return
        self._pending[rid] = (prefill, decode)
        prefill.send(
            pm.PrefillRequest(rid, route.prompt, route.sampling, msg.dest, route.arrival),
            pm.encode,
        )

    def _any_prefill(self) -> WorkerProcess | None:
        return next((w for w in self.prefill if w.alive), None)

    def _on_prefill(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        if isinstance(msg, pm.PrefillStats):
            worker.stats = msg.stats
            worker.num_transferring = msg.num_transferring
            self._count_events(worker, msg.events)
            return
        if not isinstance(msg, pm.PrefillDone | pm.PrefillFailed):
            return
        pending = self._pending.pop(msg.request_id, None)
        if pending is None:
            return
        decode = pending[1]
        if isinstance(msg, pm.PrefillDone):
            self.transfers.record(msg.num_blocks, msg.num_bytes, msg.seconds,
                                  msg.num_streamed_blocks)  # fmt: skip
            decode.send(dm.KVReady(msg.request_id, msg.first_token, msg.logprob,
                                   msg.num_cached_tokens), dm.encode)  # fmt: skip
        else:
            if not msg.aborted:
                self.transfers.failures.inc()
            decode.send(dm.KVFailed(msg.request_id, msg.error), dm.encode)

    def _count_events(self, worker: WorkerProcess, events: list) -> None:
        for e in events:
            self.transfers.kv_events.labels(worker.role, e.kind).inc()

    # -- deaths -------------------------------------------------------------------------------

    def _on_decode_death(self, worker: WorkerProcess) -> None:
        error = EngineDeadError(f"{worker.dead} (its engine process died)")
        for route in list(self._routes.values()):
            if route.decode is worker:
                route.queue.put_nowait(error)
        for rid, (prefill, decode) in list(self._pending.items()):
            if decode is worker:
                del self._pending[rid]
                prefill.send(pm.AbortPrefill([rid]), pm.encode)

    def _on_prefill_death(self, worker: WorkerProcess) -> None:
        for rid, (prefill, decode) in list(self._pending.items()):
            if prefill is worker:
                del self._pending[rid]
                self.transfers.failures.inc()
                decode.send(dm.KVFailed(rid, f"{worker.dead} before the KV arrived"), dm.encode)


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


def _candidates(workers: list[WorkerProcess]) -> list[Candidate]:
    return [
        Candidate(w.name, w.stats.num_running if w.stats else 0,
                  w.stats.num_waiting if w.stats else 0)
        for w in workers
    ]  # fmt: skip
