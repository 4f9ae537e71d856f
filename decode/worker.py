"""The decode worker: ``python -m decode.worker``, a role of the worker shell.

Runs an ``EngineCore`` (with ``DecodeScheduler``) whose KV cache the transport can write
into, and a ``KVReceiver`` on it. A ``DecodeRequest`` whose uncached tail is longer than
``local_prefill_tokens`` gets blocks reserved for its whole prompt, then ``KVWanted``
(the destination blocks) goes to the frontend, which has a prefill worker fill them.
``KVReady`` admits it with the prompt computed and its first token (which the frontend
has already given the client, so the outputs sent from here start at the second);
``KVFailed`` ends it with an error. A short tail is prefilled here.

Reserved blocks are freed only when no write can still be coming: on ``KVReady`` /
``KVFailed`` (the frontend sends one for every ``KVWanted``, also when the prefill worker
died or the client left), or the transfer timeout plus a grace period after the
reservation. An abort that arrives while the KV is on its way waits for one of those.
"""

from __future__ import annotations

import logging
import time

import msgspec

from decode.messages import CODEC, DecodeRequest, KVFailed, KVReady, KVWanted
from engine import logs
from engine.core import EngineCore
from engine.messages import Abort, EngineRequest, RequestOutput, WorkerReady, WorkerStats
from engine.pd_scheduler import DecodeScheduler
from engine.worker.config import WorkerConfig
from engine.worker.shell import Outbox, WorkerRole, main
from kvstore.transport import get_transport
from kvstore.transport.base import KVDestination

log = logging.getLogger("ferry.decode")

GRACE_S = 10.0  # after a reservation's deadline: time for a transfer already started


class DecodeWorker(WorkerRole):
    role = "decode"
    codec = CODEC

    def __init__(self, config: WorkerConfig, secret: str) -> None:
        transfer = config.transfer
        backend = get_transport(transfer.transport, secret=secret)
        self.core = EngineCore(config.engine, cache_factory=backend.allocate_cache,
                               scheduler_cls=DecodeScheduler)  # fmt: skip
        self.sched: DecodeScheduler = self.core.scheduler  # type: ignore[assignment]
        self.receiver = backend.receiver(self.core.kv_cache, transfer.kv_host)
        self.local_prefill_tokens = transfer.local_prefill_tokens
        self.timeout = transfer.timeout_s + transfer.queue_timeout_s
        self.deadlines: dict[str, float] = {}
        self.cancelled: set[str] = set()
        self._out = Outbox()
        self._touched = False

    def ready(self) -> WorkerReady:
        return self.core.ready(self.role, self.receiver.endpoint)

    @property
    def busy(self) -> bool:
        return self.core.has_work or bool(self.sched.reserving)

    @property
    def settled(self) -> bool:
        return not self.busy and not self.sched.num_transferring

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: msgspec.Struct) -> EngineRequest | None:
        self._touched = True  # the stats may have changed: report them
        if isinstance(msg, DecodeRequest):
            self._add(msg)
            return msg.request
        if isinstance(msg, KVReady):
            self._kv_ready(msg.output)
        elif isinstance(msg, KVFailed):
            self._kv_failed(msg.request_id, msg.error)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self._abort(rid)
        return None

    def _add(self, msg: DecodeRequest) -> None:
        rid = msg.request_id
        if msg.remote_prefill:
            self.sched.expect_kv(rid, self.local_prefill_tokens)
        err = self.core.add_request(msg.request)
        if err is not None:
            self.sched.unexpect_kv(rid)
            self._out.outputs.append(err)

    def _kv_ready(self, first: RequestOutput) -> None:
        rid = first.request_id
        if rid not in self.sched.incoming:
            return
        if first.finish_reason is None and not self.receiver.landed(rid):
            # all of the prompt's KV should be here; what is missing would be read as KV
            self._kv_failed(rid, "told the KV was ready, but not all of it has landed")
            return
        self._settle(rid)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            self._end(rid)
            return
        logprob = first.logprobs[0] if first.logprobs else None
        out = self.sched.admit_transferred(rid, first.new_token_ids[0], logprob,
                                           first.num_cached_tokens)  # fmt: skip
        if out.finish_reason is not None:  # the token is the client's already: just the end
            self._out.outputs.append(msgspec.structs.replace(out, new_token_ids=[], logprobs=None))

    def _kv_failed(self, rid: str, error: str) -> None:
        if rid not in self.sched.requests:
            return
        self._settle(rid)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            self._end(rid)
        else:
            self.core.abort([rid])
            self._out.outputs.append(RequestOutput(rid, [], "error", error=error))

    def _abort(self, rid: str) -> None:
        if rid in self.sched.incoming:
            self.cancelled.add(rid)  # a write may be on its way: wait for its outcome
        else:
            self._end(rid)

    def _end(self, rid: str) -> None:
        """Stop ``rid`` without a word to the frontend (it asked for that)."""
        self.core.abort([rid])
        self._out.ended.append(rid)

    def _settle(self, rid: str) -> None:
        self.receiver.forget(rid)
        self.deadlines.pop(rid, None)

    # -- steps ------------------------------------------------------------------------------

    def _reserve(self) -> None:
        bs = self.core.config.cache.block_size
        for req in self.sched.reserve_pending():
            skip = req.num_cached_tokens // bs
            dst = [b.block_id for b in req.blocks[skip:]]
            deadline = time.time() + self.timeout
            self.receiver.expect(req.request_id, dst)
            self.deadlines[req.request_id] = deadline + GRACE_S
            dest = KVDestination(self.receiver.endpoint, dst, skip, deadline)
            self._out.replies.append((KVWanted(req.request_id, dest), False))

    def _expire(self) -> None:
        """Free the reservations whose KV did not arrive in time."""
        now = time.time()
        for rid, limit in list(self.deadlines.items()):
            if now > limit:
                req = self.sched.requests.get(rid)
                log.warning("KV for %s did not arrive in time; freeing its blocks", rid,
                            extra=logs.about(req.trace_id if req else ""))  # fmt: skip
                self._touched = True
                self._kv_failed(rid, "the prompt's KV did not arrive in time")

    def tick(self) -> Outbox:
        self._expire()
        return self._take()

    def step(self) -> Outbox:
        self._expire()
        self._reserve()
        self._touched |= self.core.has_work
        if self.core.has_work:
            self._out.outputs += self.core.step()
        return self._take()

    def _take(self) -> Outbox:
        out, self._out = self._out, Outbox()
        if self._touched or out.outputs or out.replies:
            out.stats = self.stats()
        self._touched = False
        return out

    def stats(self) -> WorkerStats:
        return WorkerStats(self.sched.stats(), self.sched.num_transferring,
                           self.core.drain_kv_events(), draining=self.draining)  # fmt: skip

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def close(self) -> None:
        self.receiver.close()


if __name__ == "__main__":
    main(DecodeWorker)
