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
import os
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
from engine.ipc import worker_sockets
from engine.messages import EngineRequest, RequestOutput
from engine.pd_scheduler import PDScheduler
from kvstore.events import from_block_events
from kvstore.transport import get_transport
from prefill.messages import KVDestination

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
        events = from_block_events(self.core.kv.pool.drain_events())
        msgs: list[msgspec.Struct] = list(self.wanted)
        self.wanted = []
        if outputs or events or stepped:
            msgs.append(DecodeOutputs(outputs, self.sched.stats(), self.sched.num_transferring,
                                      events))  # fmt: skip
        return msgs

    def close(self) -> None:
        self.receiver.close()


def serve(config: EngineConfig, input_addr: str, output_addr: str, args) -> None:
    inbox, outbox = worker_sockets(input_addr, output_addr)
    try:
        worker = DecodeWorker(config, args.transport, args.local_prefill_tokens,
                              args.transfer_timeout, args.kv_host)  # fmt: skip
    except Exception as exc:
        log.exception("decode worker failed to start")
        outbox.send(encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    core = worker.core
    cfg = core.config
    outbox.send(encode(DecodeReady(cfg.cache.num_blocks, cfg.cache.block_size,
                                   core.max_model_len, core.model_name,
                                   worker.receiver.endpoint, core.hash_extra)))  # fmt: skip
    try:
        _loop(worker, inbox, outbox)
    finally:
        worker.close()


def _loop(worker: DecodeWorker, inbox, outbox) -> None:
    check = envs.DEBUG_INTEGRITY.get()
    parent = os.getppid()
    while True:
        if not worker.busy and not inbox.poll(_IDLE_POLL_MS):
            if os.getppid() != parent:
                return
            worker.expire()
            if not worker.outputs and not worker._touched:
                continue
        while inbox.poll(0):
            msg = decode_input(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            worker.handle(msg)
        for msg in worker.step():
            outbox.send(encode(msg))
        if check and not worker.busy:
            worker.core.check_integrity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode.worker")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--local-prefill-tokens", type=int, default=16)
    parser.add_argument("--transfer-timeout", type=float, default=60.0)
    parser.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver binds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get().upper(), stream=sys.stderr)
    serve(msgspec.json.decode(args.config, type=EngineConfig), args.input, args.output, args)


if __name__ == "__main__":
    main()
