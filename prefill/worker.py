"""The prefill worker: ``python -m prefill.worker``, a role of the worker shell.

Runs an ``EngineCore`` (with ``PrefillScheduler``) on prompts only: each request
finishes after its first token and keeps its blocks. Its KV goes to the decode worker's
reserved blocks (``PrefillRequest.destination``) through the KV transport, on a
background thread, *while the prompt is still being computed*: after every step the
blocks that chunked prefill has filled are sent, each send pinning its source blocks
(``PrefillScheduler.pin``) so that a preemption or an abort cannot recycle them
mid-send. When the prompt is done, the rest (the last, partial block included) follows.
Once every send has landed the request's blocks are released — full ones stay in this
worker's prefix cache — and ``PrefillDone`` (the first token as the client gets it, and
the transfer's figures) goes to the frontend, which gives the token to the client and
tells the decode worker. Every request ends in exactly one ``PrefillDone`` or
``PrefillFailed``, and only when none of its sends is still running: the decode worker
frees its reservation on either.

A prefill worker may be one rank of an expert-parallel group (``WorkerConfig.group``),
as a decode worker may (``engine.ep.role.GroupedRole``).

Images: when the worker has no vision tower of its own (an encode pool encodes them),
a request with images waits in ``prefill.embeddings.EmbeddingWaits`` until encode workers
have written their embeddings into this worker's inbox, and enters the engine with them;
with a tower (no encode pool), its items carry the files and the engine encodes them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch

from engine import logs
from engine.core import EngineCore
from engine.ep.role import GroupedRole
from engine.kv_cache.block_pool import Block
from engine.media import EmbeddingInbox, blocks_for, embedding_layout
from engine.messages import Abort, EngineRequest, RequestOutput, WorkerReady, WorkerStats
from engine.pd_scheduler import PREFILLED, PrefillScheduler
from engine.worker.config import WorkerConfig
from engine.worker.shell import Outbox, main
from kvstore.transport import KVTransport, TransferStats, get_transport
from kvstore.transport.base import KVDestination
from prefill.embeddings import EmbeddingWaits
from prefill.messages import (
    CODEC,
    EmbeddingsFailed,
    EmbeddingsReady,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
)

log = logging.getLogger("ferry.prefill")

_SENDING_POLL_MS = 1  # only transfers in flight: wait this long for messages


@dataclass
class _Shipment:
    """One request's KV on its way to ``dest``."""

    dest: KVDestination
    num_tokens: int  # whose KV goes: the prompt (with a resumed request's outputs)
    sent: int = 0  # leading destination blocks whose send has been started
    streamed: int = 0  # of those, started before the prompt was done
    jobs: list[tuple[Future[TransferStats], list[Block]]] = field(default_factory=list)
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    started: float | None = None  # wall clock when its prefill began computing
    outcome: RequestOutput | None = None  # the prefill's end, once it has ended
    failure: PrefillFailed | None = None  # set when no KV will be delivered
    trace_id: str = ""  # the HTTP request it belongs to (log lines name it)

    @property
    def settled(self) -> bool:
        return not self.jobs and (self.failure is not None or self.outcome is not None)


class PrefillWorker(GroupedRole):
    role = "prefill"
    codec = CODEC

    def __init__(self, config: WorkerConfig, secret: str) -> None:
        experts = self.join_group(config)
        self.core = EngineCore(config.engine, scheduler_cls=PrefillScheduler, experts=experts)
        self.sched: PrefillScheduler = self.core.scheduler  # type: ignore[assignment]
        self.block_size = self.core.config.cache.block_size
        transport = get_transport(config.transfer.transport, secret=secret)
        self.sender = transport.sender(self.core.kv_cache)
        self.timeout = config.transfer.timeout_s
        self.waits = self._embedding_waits(config, transport)
        self.shipments: dict[str, _Shipment] = {}
        self.tokens_per_s = 0.0
        self._out = Outbox()
        self._stepped = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-send")

    def _embedding_waits(
        self, config: WorkerConfig, transport: KVTransport
    ) -> EmbeddingWaits | None:
        """Where encode workers write this worker's image embeddings: an inbox for two
        contexts' worth of image tokens (None: a text model, or a tower of its own)."""
        vision = self.core.model_config.vision
        if vision is None or self.core.media.encoder is not None:
            return None
        dtype = self.core.kv_cache.layout.dtype
        layout = embedding_layout(vision.out_hidden_size, dtype)
        num_blocks = 2 * blocks_for(self.core.max_model_len, layout.block_size) + 1
        inbox = EmbeddingInbox(transport, layout, num_blocks, config.engine.device,
                               config.transfer.kv_host)  # fmt: skip
        return EmbeddingWaits(inbox, self.timeout, config.name or f"prefill-{id(self):x}")

    def ready(self) -> WorkerReady:
        return self.core.ready(self.role, **self.group_ready())

    @property
    def sending(self) -> bool:
        return any(s.jobs for s in self.shipments.values())

    @property
    def busy(self) -> bool:
        return self.core.has_work or self.group_busy

    @property
    def settled(self) -> bool:
        waiting = self.waits is not None and self.waits.pending
        return (not self.core.has_work and not self.sending and not self.sched.num_transferring
                and not waiting)  # fmt: skip

    @property
    def wait_ms(self) -> int:
        return _SENDING_POLL_MS if self.sending else super().wait_ms

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: msgspec.Struct) -> EngineRequest | None:
        self._stepped = True  # the stats may have changed: report them
        if isinstance(msg, Abort):
            for rid in msg.request_ids:
                self._abort(rid)
            return None
        if isinstance(msg, EmbeddingsReady | EmbeddingsFailed):
            if self.waits is not None:
                if isinstance(msg, EmbeddingsReady):
                    self.waits.ready(msg.request_id, msg.index)
                else:
                    self.waits.failed(msg.request_id, msg.index, msg.error)
            return None
        media = msg.request.media
        if self.waits is not None and media and not media[0].data:
            self.waits.add(msg)  # enters the engine once its embeddings are here
        else:
            self._add(msg)
        return msg.request

    def _add(self, msg: PrefillRequest, embeddings: list[torch.Tensor] | None = None) -> None:
        request = msg.request
        err = self.core.add_request(request, embeddings)
        if err is not None:
            self._out.replies.append((PrefillFailed(request.request_id, err.error), True))
            return
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        self.shipments[request.request_id] = _Shipment(msg.destination, num_tokens,
                                                       trace_id=request.trace_id)  # fmt: skip

    def _abort(self, rid: str) -> None:
        if self.waits is not None and rid in self.waits:
            self.waits.cancel(rid)
            return
        ship = self.shipments.get(rid)
        if ship is not None and ship.failure is None:
            self._stop(rid, ship, PrefillFailed(rid, "aborted", aborted=True))

    def _stop(self, rid: str, ship: _Shipment, failure: PrefillFailed) -> None:
        """No KV will be delivered: stop computing, give the blocks back (those still being
        sent stay pinned until their send ends), report once the sends have drained."""
        ship.failure = failure
        self.sched.stop(rid)

    # -- steps ------------------------------------------------------------------------------

    def step(self) -> Outbox:
        working = self.core.has_work
        self._stepped |= working
        before = {rid: self.sched.computed_tokens(rid) for rid in self.shipments}
        started = time.perf_counter()
        for out in self.engine_step():
            if out.finish_reason is not None:
                self._prefilled(out)
        if working:
            self._measure(before, time.perf_counter() - started)
        for rid, ship in self.shipments.items():
            computed = self.sched.computed_tokens(rid)
            if ship.failure is None and computed is not None:
                self._ship(rid, ship, min(computed, ship.num_tokens))
        return self._report()

    def tick(self) -> Outbox:
        if self.group is not None:  # the group's round, with nothing of its own to run
            return self.step()
        return self._report()

    def _report(self) -> Outbox:
        """Collect the sends that have ended; report requests whose KV is settled; move
        requests whose image embeddings have arrived into the engine."""
        self._collect()
        if self.waits is not None:
            self._take_embeddings()
        out, self._out = self._out, Outbox()
        if out.replies or self._stepped:
            out.stats = self.stats()
        self._stepped = False
        return out

    def _take_embeddings(self) -> None:
        assert self.waits is not None
        ready, failures = self.waits.take()
        for request, embeddings in ready:
            self._add(request, embeddings)
        for f in failures:
            failed = PrefillFailed(f.request_id, f.error, aborted=f.aborted)
            self._out.replies.append((failed, True))
        for wanted in self.waits.reserve():
            self._out.replies.append((wanted, False))
        self._stepped |= bool(ready or failures)

    def _measure(self, before: dict[str, int | None], seconds: float) -> None:
        """Fold this step's prompt tokens per second into the moving average."""
        computed = 0
        for rid, was in before.items():
            if was is None:
                continue
            now = self.sched.computed_tokens(rid)
            if now is None:  # it ended this step: its whole prompt is computed
                now = self.shipments[rid].num_tokens
            computed += max(0, now - was)
        if computed and seconds > 0:
            rate, old = computed / seconds, self.tokens_per_s
            self.tokens_per_s = 0.8 * old + 0.2 * rate if old else rate

    def _prefilled(self, out: RequestOutput) -> None:
        rid = out.request_id
        ship = self.shipments.get(rid)
        if ship is None or ship.failure is not None:
            self.sched.release(rid)
            return
        ship.outcome = out
        if out.finish_reason in ("error", "abort"):
            error = out.error or f"prefill ended: {out.finish_reason}"
            self._stop(rid, ship, PrefillFailed(rid, error))
        elif out.finish_reason == PREFILLED:
            self._ship(rid, ship, ship.num_tokens, final=True)
        # otherwise the first token ends the request: D needs no more KV

    def _ship(self, rid: str, ship: _Shipment, num_tokens: int, final: bool = False) -> None:
        """Start sending the computed blocks among the first ``num_tokens`` prompt tokens
        that have not been sent; ``final``: the prompt is done, its partial block too."""
        dest = ship.dest
        now = time.time()
        if ship.started is None and (num_tokens or final):
            ship.started = now  # the transfer's time runs from here, not from the queue
        end = -(-num_tokens // self.block_size) if final else num_tokens // self.block_size
        begin = dest.skip_blocks + ship.sent
        if end - dest.skip_blocks > len(dest.block_ids):
            self._stop(rid, ship, PrefillFailed(
                rid, f"{end - dest.skip_blocks} blocks to send, {len(dest.block_ids)} reserved"
            ))  # fmt: skip
            return
        if end <= begin:
            return
        if now > min(dest.deadline, ship.started + self.timeout):
            self._stop(rid, ship, PrefillFailed(
                rid, "the prompt's KV took longer than the transfer timeout"
            ))  # fmt: skip
            return
        blocks = self.sched.pin(self.sched.blocks(rid)[begin:end])
        src = [b.block_id for b in blocks]
        dst = dest.block_ids[ship.sent : ship.sent + len(src)]
        job = self._pool.submit(self.sender.send, dest.endpoint, rid, src, dst, self.timeout,
                                self._written())  # fmt: skip
        ship.jobs.append((job, blocks))
        ship.sent += len(src)
        if not final:
            ship.streamed += len(src)

    def _written(self) -> torch.cuda.Event | None:
        """On CUDA, an event past every step run so far (the blocks being sent were
        written by one of them): the send waits for it, not for steps launched later."""
        storage = self.core.kv_cache.storage
        if not storage.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(storage.device))
        return event

    def _collect(self) -> None:
        for rid, ship in list(self.shipments.items()):
            while ship.jobs and ship.jobs[0][0].done():
                job, blocks = ship.jobs.pop(0)
                self.sched.unpin(blocks)
                try:
                    stats = job.result()
                except Exception as exc:  # TransferError, or anything the backend raised
                    if ship.failure is None:
                        log.warning("KV transfer of %s failed: %s", rid, exc,
                                    extra=logs.about(ship.trace_id))  # fmt: skip
                        failure = PrefillFailed(rid, f"KV transfer failed: {exc}", retry=True)
                        self._stop(rid, ship, failure)
                    continue
                ship.num_blocks += stats.num_blocks
                ship.num_bytes += stats.num_bytes
                ship.seconds += stats.seconds
            if ship.settled:
                del self.shipments[rid]
                self._out.replies.append((ship.failure or self._done(rid, ship), True))

    def _done(self, rid: str, ship: _Shipment) -> PrefillDone:
        self.sched.release(rid)
        out = ship.outcome
        if out.finish_reason == PREFILLED:  # the client's stream goes on from the decode worker
            out = msgspec.structs.replace(out, finish_reason=None)
        return PrefillDone(out, ship.num_blocks, ship.num_bytes, ship.seconds, ship.streamed)

    def stats(self) -> WorkerStats:
        return WorkerStats(self.sched.stats(), self.sched.num_transferring,
                           self.core.drain_kv_events(), self.tokens_per_s,
                           self.draining, self.expert_stats())  # fmt: skip

    def check_integrity(self) -> None:
        self.core.check_integrity()
        if self.waits is not None:
            self.waits.check_integrity()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sender.close()
        super().close()
        if self.waits is not None:
            self.waits.close()


if __name__ == "__main__":
    main(PrefillWorker)
