"""The decode worker process: ``python -m decode.worker``.

Runs an ``EngineCore`` (with ``PDScheduler``) whose KV cache the transport can write
into, and a ``KVReceiver`` on it. A ``DecodeRequest`` whose uncached tail is longer than
``--local-prefill-tokens`` gets blocks reserved for its whole prompt, then ``KVWanted``
(the destination blocks) goes to the frontend, which has a prefill worker fill them.
``KVReady`` admits it with the prompt computed and its first token; ``KVFailed`` ends it
with an error. A short tail is prefilled here.

Reserved blocks are freed only when no write can still be coming: on ``KVReady`` /
``KVFailed`` (the frontend sends one for every ``KVWanted``, also when the prefill worker
died or the client left), or ``--transfer-timeout`` plus a grace period after the
reservation. An abort that arrives while the KV is on its way waits for one of those.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import msgspec

from decode.messages import (
    AbortDecode,
    DecodeOutputs,
    DecodeReady,
    DecodeRequest,
    KVFailed,
    KVReady,
    KVWanted,
    Shutdown,
    WorkerFailed,
    decode_input,
    encode,
)
from engine import envs
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.ipc import WorkerChannel, add_worker_args, linger, parent_watch, run_worker_main
from engine.messages import EngineRequest, RequestOutput
from engine.pd_scheduler import PDScheduler
from kvstore.transport import get_transport
from kvstore.transport.base import KVDestination

log = logging.getLogger("ferry.decode")

_IDLE_POLL_MS = 1000
_GRACE_S = 10.0  # after a reservation's deadline: time for a transfer already started


class DecodeWorker:
    def __init__(
        self, config: EngineConfig, transport: str, local_prefill_tokens: int, timeout: float,
        host: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        backend = get_transport(transport)
        self.core = EngineCore(config, cache_factory=backend.allocate_cache,
                               scheduler_cls=PDScheduler)  # fmt: skip
        self.sched: PDScheduler = self.core.scheduler  # type: ignore[assignment]
        self.receiver = backend.receiver(self.core.kv_cache, host)
        self.local_prefill_tokens = local_prefill_tokens
        self.timeout = timeout
        self.deadlines: dict[str, float] = {}
        self.cancelled: set[str] = set()
        self.outputs: list[RequestOutput] = []
        self.wanted: list[KVWanted] = []
        self.draining = False  # finishing what it has (reported to frontends)
        self._touched = False

    @property
    def busy(self) -> bool:
        return self.core.has_work or bool(self.sched.reserving)

    def handle(self, msg: DecodeRequest | KVReady | KVFailed | AbortDecode) -> None:
        self._touched = True  # the stats may have changed: report them
        if isinstance(msg, DecodeRequest):
            self._add(msg)
        elif isinstance(msg, KVReady):
            self._kv_ready(msg)
        elif isinstance(msg, KVFailed):
            self._kv_failed(msg.request_id, msg.error)
        else:
            for rid in msg.request_ids:
                self._abort(rid)

    def _add(self, msg: DecodeRequest) -> None:
        rid = msg.request_id
        if msg.remote_prefill:
            self.sched.expect_kv(rid, self.local_prefill_tokens)
        engine_msg = EngineRequest(rid, msg.prompt_token_ids, msg.sampling, msg.arrival_time,
                                   msg.cache_salt, msg.output_token_ids)  # fmt: skip
        err = self.core.add_request(engine_msg)
        if err is not None:
            self.sched.unexpect_kv(rid)
            self.outputs.append(err)

    def _kv_ready(self, msg: KVReady) -> None:
        rid = msg.request_id
        req = self.sched.incoming.get(rid)
        if req is None:
            return
        self._settle(rid)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            self.core.abort([rid])
            return
        req.num_cached_tokens = max(req.num_cached_tokens, msg.num_cached_tokens)
        self.outputs.append(self.sched.admit_transferred(rid, msg.first_token, msg.logprob))

    def _kv_failed(self, rid: str, error: str) -> None:
        if rid not in self.sched.requests:
            return
        self._touched = True
        self._settle(rid)
        self.core.abort([rid])
        if rid in self.cancelled:
            self.cancelled.discard(rid)
        else:
            self.outputs.append(RequestOutput(rid, [], "error", error=error))

    def _abort(self, rid: str) -> None:
        if rid in self.sched.incoming:
            self.cancelled.add(rid)  # a write may be on its way: wait for its outcome
        else:
            self.core.abort([rid])

    def _settle(self, rid: str) -> None:
        self.receiver.forget(rid)
        self.deadlines.pop(rid, None)

    def reserve(self) -> None:
        bs = self.core.config.cache.block_size
        for req in self.sched.reserve_pending():
            skip = req.num_cached_tokens // bs
            dst = [b.block_id for b in req.blocks[skip:]]
            deadline = time.time() + self.timeout
            self.receiver.expect(req.request_id, dst)
            self.deadlines[req.request_id] = deadline + _GRACE_S
            dest = KVDestination(self.receiver.endpoint, dst, skip, deadline)
            self.wanted.append(KVWanted(req.request_id, dest))

    def expire(self) -> None:
        now = time.time()
        for rid, limit in list(self.deadlines.items()):
            if now > limit:
                log.warning("KV for %s did not arrive in time; freeing its blocks", rid)
                self._kv_failed(rid, "the prompt's KV did not arrive in time")

    def step(self) -> list[msgspec.Struct]:
        self.expire()
        self.reserve()
        stepped = self.core.has_work or self._touched
        self._touched = False
        outputs = self.outputs + (self.core.step() if self.core.has_work else [])
        self.outputs = []
        events = self.core.kv.pool.drain_events()
        msgs: list[msgspec.Struct] = list(self.wanted)
        self.wanted = []
        if outputs or events or stepped:
            msgs.append(DecodeOutputs(outputs, self.sched.stats(), self.sched.num_transferring,
                                      events, self.draining))  # fmt: skip
        return msgs

    def heartbeat(self) -> DecodeOutputs:
        """Stats for frontends while idle, with the KV events that came in meanwhile (the
        KV tiers' writer finishes files after the last step)."""
        events = self.core.kv.pool.drain_events()
        return DecodeOutputs([], self.sched.stats(), self.sched.num_transferring, events,
                             self.draining)  # fmt: skip

    def close(self) -> None:
        self.receiver.close()


def serve(config: EngineConfig, channel: WorkerChannel, args) -> None:
    """Run a decode worker on ``channel`` until told to shut down."""
    try:
        worker = DecodeWorker(config, args.transport, args.local_prefill_tokens,
                              args.transfer_timeout, args.kv_host)  # fmt: skip
    except Exception as exc:
        log.exception("decode worker failed to start")
        channel.ready(encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        linger(channel)
        return
    core = worker.core
    cfg = core.config
    channel.ready(encode(DecodeReady(cfg.cache.num_blocks, cfg.cache.block_size,
                                     core.max_model_len, core.model_name,
                                     worker.receiver.endpoint, core.hash_extra)))  # fmt: skip
    try:
        _loop(worker, channel, args)
    finally:
        worker.close()


def _loop(worker: DecodeWorker, channel: WorkerChannel, args) -> None:
    check = envs.DEBUG_INTEGRITY.get()
    orphaned = parent_watch(args.exit_with_parent)
    drain = getattr(args, "drain", None)
    while True:
        worker.draining = drain is not None and drain.is_set()
        if worker.draining and not worker.busy and not worker.sched.num_transferring:
            beat = worker.heartbeat()
            channel.broadcast(encode(beat), beat.events)
            return
        if not worker.busy and not channel.poll(_IDLE_POLL_MS):
            if orphaned():
                return
            worker.expire()
            if not worker.outputs and not worker._touched:
                beat = worker.heartbeat()
                channel.broadcast(encode(beat), beat.events)
                continue
        for frontend, msg in channel.pending(decode_input):
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, DecodeRequest):
                channel.claim(msg.request_id, frontend)
            worker.handle(msg)
        for msg in worker.step():
            if isinstance(msg, KVWanted):
                channel.send_for(msg.request_id, encode(msg))
            else:
                _send_outputs(channel, msg)
        if not worker.busy and not worker.sched.incoming:
            channel.owners.clear()
            if check:
                worker.core.check_integrity()


def _send_outputs(channel: WorkerChannel, msg: DecodeOutputs) -> None:
    """Each frontend gets its own requests' outputs, and everyone the stats and events."""
    mine: dict[bytes, list[RequestOutput]] = {f: [] for f in channel.frontends}
    for out in msg.outputs:
        frontend = channel.owners.get(out.request_id)
        if frontend is None:
            continue
        if out.finish_reason is not None:
            del channel.owners[out.request_id]
        mine.setdefault(frontend, []).append(out)
    for frontend, outputs in mine.items():
        part = DecodeOutputs(outputs, msg.stats, msg.num_transferring, msg.events,
                             msg.draining)  # fmt: skip
        channel.send_to(frontend, encode(part))
    channel.publish(msg.events)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode.worker")
    add_worker_args(parser)
    parser.add_argument("--local-prefill-tokens", type=int, default=16)
    parser.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver binds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get().upper(), stream=sys.stderr)
    run_worker_main(args, serve, msgspec.json.decode(args.config, type=EngineConfig))


if __name__ == "__main__":
    main()
