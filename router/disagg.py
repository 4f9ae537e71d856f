"""The frontend's client of the disaggregated topology: one request's prefill/decode
protocol, over the pools of ``router.pools``. It serves the server through the same
``ServingClient`` surface as the aggregated engine's client (``engine.client``).

A request, seen from here:

1. ``generate`` hashes the prompt into its block chain (``kvstore.hashing``), asks the
   prefix index (``router.index``, fed by the workers' KV events) what each decode worker
   already holds of it, lets the decode pool's policy (``router.policies``) pick a decode
   worker D and sends it a ``DecodeRequest``.
2. D either prefills it itself (short uncached tail) and just streams outputs, or
   reserves blocks and answers ``KVWanted``; the prefill pool's policy then picks a
   prefill worker P (again from the index and the load this frontend has sent each
   worker) and this client sends it a ``PrefillRequest``.
3. P computes the prompt, ships the KV into D's blocks and answers ``PrefillDone`` with
   the first token (or ``PrefillFailed``). The token goes to the client at once; D is
   told ``KVReady`` (or ``KVFailed``) — always, also when the client has left, because D
   frees the reserved blocks only then.
4. D streams the outputs from the second token on into the request's queue.

Images: the request's ``MediaItem``s (with their files) stay here. The decode worker gets
them without the files (it needs only their positions: its prompt arrives as KV, and it
never computes a tail that holds image tokens itself). A prefill worker that runs a vision
tower (``WorkerReady.encodes_images``: there is no encode pool) gets the files; one that
does not asks for the embeddings (``EmbeddingsWanted``) and ``router.encoding`` has the
encode pool write them into its inbox.

Failures: a prefill that fails for a reason other than the request itself (its worker
died, the transfer broke) is retried on another prefill worker, into the same reserved
blocks. When a decode worker dies, each of its requests *migrates*: another decode
worker gets the prompt plus the tokens already streamed as a resumed request
(``output_token_ids``: they count as output, for max_tokens, penalties and a grammar), its
prefix comes from whichever cache holds it, and the client's stream goes on from the
next token, none lost or repeated. Each attempt has its own id on the worker channels
(``wire_id``), so nothing of a dead attempt can mix into the next. Leaving ``generate``
early aborts on both sides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec

from decode.messages import DecodeRequest, KVFailed, KVReady, KVWanted
from encode.messages import Encoded, EncodeFailed
from engine import logs
from engine.client import EngineDeadError, offer, outputs_of
from engine.config import EngineConfig
from engine.loader import load_image_inputs, load_tokenizer, model_name
from engine.messages import Abort, EngineRequest, EngineStats, MediaItem, Outputs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.vision import ImageInputs
from kvstore import auth
from kvstore.hashing import BlockHash, MediaSpan
from prefill.messages import EmbeddingsWanted, PrefillDone, PrefillFailed, PrefillRequest
from router.config import PDConfig
from router.encoding import Encoding
from router.metrics import EncodeMetrics, TransferMetrics
from router.pools import WorkerPools
from router.routing import Router
from router.workers import WorkerProcess

log = logging.getLogger("ferry.router")

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
    media: list[MediaItem] = field(default_factory=list)  # the prompt's images, with files
    emitted: list[int] = field(default_factory=list)  # tokens already given to the client
    attempt: int = 0
    predicted_hit: int = 0  # tokens the index said the chosen workers hold
    seen_first: bool = False
    finished: bool = False  # its last output is in the queue
    trace_id: str = ""  # the HTTP request it belongs to (the workers' log lines name it)

    @property
    def wire_id(self) -> str:
        return self.request_id if not self.attempt else f"{self.request_id}~{self.attempt}"

    @property
    def spans(self) -> list[MediaSpan]:
        return [(m.offset, m.end, m.content_hash) for m in self.media]

    def engine_request(self, wire_id: str, files: bool = False) -> EngineRequest:
        """The request as a worker gets it: a resumed one carries what was streamed;
        ``files``: its images with their files (for a worker that encodes them)."""
        media = self.media if files else [m.without_data() for m in self.media]
        return EngineRequest(wire_id, self.prompt, self.sampling, self.arrival,
                             output_token_ids=list(self.emitted), media=media,
                             trace_id=self.trace_id)  # fmt: skip


@dataclass
class _Transfer:
    """A prefill whose KV a decode worker waits for (outlives the route if the client
    leaves: the decode worker must still hear how it ended)."""

    request: PrefillRequest
    prefill: WorkerProcess
    decode: WorkerProcess
    queued_tokens: int
    tried: set[str] = field(default_factory=set)


class DisaggClient:
    """``secret``: the cluster secret every worker proves (default: a fresh one, which only
    the workers this client spawns learn)."""

    def __init__(self, config: EngineConfig, pd: PDConfig, secret: str | None = None) -> None:
        if pd.transfer.transport == "nccl" and not config.device.startswith("cuda"):
            raise ValueError("the nccl KV transport needs GPU workers (--device cuda)")
        self.config = config
        self.tokenizer = None
        self.images: ImageInputs | None = None
        self.transfers = TransferMetrics()
        self.encode_metrics = EncodeMetrics()
        self.router = Router(pd.policy, config.cache.block_size)
        self.router_metrics = self.router.metrics
        self.index = self.router.index
        self.pools = WorkerPools(config, pd, secret or auth.make_secret(), self.router,
                                 self.transfers, self)  # fmt: skip
        self.encoding = Encoding(self.pools, self.router, self.encode_metrics)
        self._routes: dict[str, _Route] = {}  # by the client's request id
        self._wire: dict[str, _Route] = {}  # by the id of the current attempt
        self._pending: dict[str, _Transfer] = {}  # by wire id
        self._left: dict[str, list[str]] = {}  # a silent worker's wire ids, moved elsewhere

    # -- the serving surface -------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> None:
        """Spawn the configured workers (there may be none: workers can also join at
        runtime, ``add_worker``) and wait until they are ready."""
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.config.model))
        images = asyncio.create_task(asyncio.to_thread(load_image_inputs, self.config.model))
        self.pools.model_name = model_name(self.config.model)  # until a worker says
        await self.pools.start(timeout)
        self.tokenizer = await tokenizer
        self.images = await images

    async def shutdown(self) -> None:
        await self.pools.shutdown()

    def join(self, name: str, role: str, address: str) -> asyncio.Task:
        """Attach the worker ``name`` listening on ``address`` in the background."""
        return asyncio.create_task(self.pools.add_worker(name, role, address))

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.pools.workers

    @property
    def model_name(self) -> str:
        return self.pools.model_name

    @property
    def max_model_len(self) -> int:
        return self.pools.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.pools.is_healthy

    @property
    def stats(self) -> EngineStats:
        return self.pools.stats

    def health(self) -> dict:
        return self.pools.health()

    def collectors(self) -> list:
        return [*self.transfers.collectors(), *self.router_metrics.collectors(),
                *self.encode_metrics.collectors(), *self.pools.collectors()]  # fmt: skip

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    def stop_all(self, reason: str) -> None:
        for route in list(self._routes.values()):
            route.finished = True
            route.queue.put_nowait(EngineDeadError(reason))
            self._close(route)
            self._abort(route)

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        media: Sequence[MediaItem] = (), trace_id: str = "",
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Stream the request's outputs; the last has ``finish_reason``. Leaving early
        aborts it on every worker. ``media``: the prompt's images, with their files."""
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        media = list(media)
        if media:
            self._check_encoders()
        spans = [(m.offset, m.end, m.content_hash) for m in media]
        hashes = self.router.hashes(prompt_token_ids, spans)
        decode = self._choose_decode(hashes, len(prompt_token_ids))
        route = _Route(request_id, prompt_token_ids, sampling, time.time(), hashes, decode,
                       asyncio.Queue(), media, trace_id=trace_id)  # fmt: skip
        self._routes[request_id] = route
        self._dispatch(route)
        finished = False
        try:
            async for out in outputs_of(route.queue):
                finished = out.finish_reason is not None
                yield out
        finally:
            self._close(route)
            if not finished:
                self._abort(route)

    def _check_encoders(self) -> None:
        """Raise ``EngineDeadError`` when nothing live can encode images: no encode worker,
        and no prefill worker with a vision tower of its own."""
        if self.pools.live("encode"):
            return
        if any(w.ready is not None and w.ready.encodes_images for w in self.pools.live("prefill")):
            return
        raise EngineDeadError("no live encode worker (and no prefill worker that encodes "
                              "images itself)")  # fmt: skip

    def _choose_decode(
        self, hashes: list[BlockHash], num_tokens: int, exclude: WorkerProcess | None = None
    ) -> WorkerProcess:
        decode = self.pools.live("decode", exclude)
        if not decode or not any(w.alive for w in self.pools.prefill):
            raise EngineDeadError("no live prefill/decode engine workers")
        return self.router.choose("decode", decode, hashes, num_tokens)[0]

    def _dispatch(self, route: _Route) -> None:
        """Send the route's current attempt to its decode worker."""
        wid = route.wire_id
        self._wire[wid] = route
        route.decode.inflight += 1
        route.predicted_hit = self.router.hit_tokens(route.decode, route.hashes)
        route.decode.send(DecodeRequest(route.engine_request(wid)))

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
        route.decode.send(Abort([wid]))
        pending = self._pending.get(wid)
        if pending is not None:
            pending.prefill.send(Abort([wid]))
        if route.media:
            self.encoding.abort(wid)

    # -- worker messages --------------------------------------------------------------------

    def worker_message(self, worker: WorkerProcess, msg: msgspec.Struct) -> None:
        if isinstance(msg, Outputs):
            self._decoded(worker, msg.outputs)
        elif isinstance(msg, KVWanted):
            self._want_kv(worker, msg)
        elif isinstance(msg, PrefillDone | PrefillFailed):
            self._prefilled(worker, msg)
        elif isinstance(msg, EmbeddingsWanted):
            route = self._wire.get(msg.request_id)
            if route is None:
                self.encoding.want(worker, msg, None)
            else:
                self.encoding.want(worker, msg, route.media, route.trace_id)
        elif isinstance(msg, Encoded | EncodeFailed):
            self.encoding.received(worker, msg)

    def _decoded(self, worker: WorkerProcess, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            wid = out.request_id
            if out.finish_reason == "error" and wid in self._pending:
                # D gave up on the KV (its reservation expired): stop the prefill too
                self._settle(wid).prefill.send(Abort([wid]))
            route = self._wire.get(wid)
            if route is not None and route.decode is worker:
                self._deliver(route, out)

    def _deliver(self, route: _Route, out: RequestOutput) -> None:
        if route.finished:
            return  # the first token already ended it (the decode worker says so too)
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
        if not offer(route.queue, out):
            route.finished = True
            self._close(route)
            self._abort(route)

    def _want_kv(self, decode: WorkerProcess, msg: KVWanted) -> None:
        wid = msg.request_id
        route = self._wire.get(wid)
        if route is None:  # the client left before the blocks were reserved
            decode.send(KVFailed(wid, "request gone"))
            return
        request = PrefillRequest(route.engine_request(wid), msg.destination)
        self._send_prefill(request, decode, set(), route.hashes)

    def _send_prefill(
        self, request: PrefillRequest, decode: WorkerProcess, tried: set[str],
        hashes: list[BlockHash],
    ) -> None:  # fmt: skip
        """Have a prefill worker not in ``tried`` fill the request's destination; tell
        ``decode`` KVFailed if none is left."""
        wid = request.request_id
        live = [w for w in self.pools.live("prefill") if w.name not in tried]
        if not live:
            decode.send(KVFailed(wid, "no live prefill worker could compute the prompt"))
            return
        engine_request = request.request
        num_tokens = len(engine_request.prompt_token_ids) + len(engine_request.output_token_ids)
        prefill, hit = self.router.choose("prefill", live, hashes, num_tokens)
        request = self._with_files(request, prefill)
        queued = max(0, num_tokens - hit)
        prefill.inflight += 1
        prefill.queued_tokens += queued
        self._pending[wid] = _Transfer(request, prefill, decode, queued, tried | {prefill.name})
        route = self._wire.get(wid)
        if route is not None:
            route.predicted_hit = max(route.predicted_hit, hit)
        prefill.send(request)

    def _with_files(self, request: PrefillRequest, prefill: WorkerProcess) -> PrefillRequest:
        """``request`` as ``prefill`` takes it: with the image files if it encodes them."""
        route = self._wire.get(request.request_id)
        if route is None or not route.media:
            return request
        files = prefill.ready is not None and prefill.ready.encodes_images
        engine_request = route.engine_request(request.request_id, files=files)
        return msgspec.structs.replace(request, request=engine_request)

    def _settle(self, wid: str) -> _Transfer:
        transfer = self._pending.pop(wid)
        transfer.prefill.inflight -= 1
        transfer.prefill.queued_tokens -= transfer.queued_tokens
        return transfer

    def _prefilled(self, worker: WorkerProcess, msg: PrefillDone | PrefillFailed) -> None:
        wid = msg.request_id
        if wid not in self._pending or self._pending[wid].prefill is not worker:
            return
        transfer = self._settle(wid)
        decode = transfer.decode
        if isinstance(msg, PrefillDone):
            self.transfers.record(msg.num_blocks, msg.num_bytes, msg.seconds,
                                  msg.num_streamed_blocks)  # fmt: skip
            self._first_token(wid, transfer, msg.output)
            decode.send(KVReady(msgspec.structs.replace(msg.output, prompt_logprobs=None)))
            return
        if not msg.aborted:
            self.transfers.failures.inc()
        if msg.retry and wid in self._wire:
            self._retry_prefill(transfer, msg.error)
        else:
            decode.send(KVFailed(wid, msg.error))

    def _first_token(self, wid: str, transfer: _Transfer, out: RequestOutput) -> None:
        """The client gets the first token straight from the prefill worker: the decode
        worker, told the KV is ready, goes on from the second. Cached tokens count what
        either worker already held."""
        route = self._wire.get(wid)
        if route is None or route.decode is not transfer.decode:
            return
        held = transfer.request.destination.skip_blocks * self.pools.block_size
        if held > out.num_cached_tokens:
            out = msgspec.structs.replace(out, num_cached_tokens=held)
        self._deliver(route, out)

    def _retry_prefill(self, transfer: _Transfer, error: str) -> None:
        wid = transfer.request.request_id
        if time.time() > transfer.request.destination.deadline:
            transfer.decode.send(KVFailed(wid, error))
            return
        log.warning("prefill of %s on %s failed (%s); retrying elsewhere", wid,
                    transfer.prefill.name, error,
                    extra=logs.about(transfer.request.request.trace_id))  # fmt: skip
        self.router_metrics.retries.inc()
        route = self._wire.get(wid)
        hashes = route.hashes if route is not None else []
        self._send_prefill(transfer.request, transfer.decode, transfer.tried, hashes)

    # -- deaths -------------------------------------------------------------------------------

    def worker_gone(self, worker: WorkerProcess) -> None:
        """``worker`` died, or went silent: what it had moves elsewhere."""
        mine = [w for w, t in self._pending.items() if worker in (t.prefill, t.decode)]
        mine += [w for w, r in self._wire.items() if r.decode is worker]
        if worker.dead is None:  # only silent: it may come back with these still running
            self._left[worker.name] = mine
        self.encoding.died(worker)
        if worker.role == "encode":
            return
        if worker.role == "decode":
            self._decode_died(worker)
        else:
            self._prefill_died(worker)

    def worker_back(self, worker: WorkerProcess) -> None:
        """A silent worker answers again: stop what it still runs that moved elsewhere."""
        left = self._left.pop(worker.name, [])
        if left:
            worker.send(Abort(left))

    def _decode_died(self, worker: WorkerProcess) -> None:
        for wid, transfer in list(self._pending.items()):
            if transfer.decode is worker:
                self._settle(wid).prefill.send(Abort([wid]))
        for route in [r for r in self._wire.values() if r.decode is worker]:
            self._migrate(route, f"{worker.dead} (its engine process died)")

    def _migrate(self, route: _Route, why: str) -> None:
        """Resume ``route`` on another decode worker, from the tokens already streamed."""
        self._wire.pop(route.wire_id, None)
        route.decode.inflight -= 1
        if route.finished:
            return
        context = route.prompt + route.emitted
        hashes = self.router.hashes(context, route.spans)
        try:
            if route.attempt + 1 >= MAX_ATTEMPTS:
                raise EngineDeadError(f"gave up after {MAX_ATTEMPTS} attempts")
            decode = self._choose_decode(hashes, len(context), exclude=route.decode)
        except EngineDeadError as exc:
            route.queue.put_nowait(EngineDeadError(f"{why}; {exc}"))
            return
        route.hashes, route.decode = hashes, decode
        log.warning("%s: resuming %s on %s after %d tokens", why, route.request_id,
                    route.decode.name, len(route.emitted),
                    extra=logs.about(route.trace_id))  # fmt: skip
        self.router_metrics.migrations.inc()
        route.attempt += 1
        self._dispatch(route)

    def _prefill_died(self, worker: WorkerProcess) -> None:
        for wid, transfer in list(self._pending.items()):
            if transfer.prefill is worker:
                self._settle(wid)
                self.transfers.failures.inc()
                why = f"{worker.dead} before the KV arrived"
                if wid in self._wire:
                    self._retry_prefill(transfer, why)
                else:
                    transfer.decode.send(KVFailed(wid, why))
