"""The prefill worker process: ``python -m prefill.worker``.

Runs an ``EngineCore`` (with ``PDScheduler``) on prompts only: each request is
prefill-only, so it finishes after its first token and keeps its blocks. Those blocks
are then shipped to the decode worker's reserved blocks (``PrefillRequest.dest``) by a
background thread through the KV transport, after which they are released — full ones
stay in this worker's prefix cache — and ``PrefillDone`` (first token, transfer figures)
goes to the frontend, which tells the decode worker. Every request ends in exactly one
``PrefillDone`` or ``PrefillFailed``: the decode worker frees its reservation on either.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from engine import envs
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.ipc import worker_sockets
from engine.messages import EngineRequest, RequestOutput
from engine.pd_scheduler import PREFILLED, PDScheduler
from kvstore.events import from_block_events
from kvstore.transport import TransferStats, get_transport
from prefill.messages import (
    AbortPrefill,
    KVDestination,
    PrefillDone,
    PrefillFailed,
    PrefillReady,
    PrefillRequest,
    PrefillStats,
    Shutdown,
    WorkerFailed,
    decode_input,
    encode,
)

log = logging.getLogger("ferry.prefill")

_IDLE_POLL_MS = 1000
_BUSY_POLL_MS = 1  # only transfers in flight: wait this long for messages


class PrefillWorker:
    def __init__(self, core: EngineCore, transport: str, transfer_timeout_s: float) -> None:
        self.core = core
        self.sched: PDScheduler = core.scheduler  # type: ignore[assignment]
        self.sender = get_transport(transport).sender(core.kv_cache)
        self.timeout = transfer_timeout_s
        self.dests: dict[str, KVDestination] = {}
        self.sending: dict[str, tuple[Future[TransferStats], RequestOutput]] = {}
        self.aborted: set[str] = set()
        self.out: list[msgspec.Struct] = []
        self._stepped = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-send")

    @property
    def busy(self) -> bool:
        return self.core.has_work or bool(self.sending)

    def handle(self, msg: PrefillRequest | AbortPrefill) -> None:
        self._stepped = True  # the stats may have changed: report them
        if isinstance(msg, PrefillRequest):
            self._add(msg)
        else:
            for rid in msg.request_ids:
                self._abort(rid)

    def _add(self, msg: PrefillRequest) -> None:
        rid = msg.request_id
        self.sched.prefill_only.add(rid)
        engine_msg = EngineRequest(rid, msg.prompt_token_ids, msg.sampling, msg.arrival_time,
                                   msg.cache_salt)  # fmt: skip
        err = self.core.add_request(engine_msg)
        if err is not None:
            self.sched.prefill_only.discard(rid)
            self.out.append(PrefillFailed(rid, err.error or "invalid request"))
            return
        self.dests[rid] = msg.dest

    def _abort(self, rid: str) -> None:
        if rid in self.sending:
            self.aborted.add(rid)  # it completes; the decode worker frees on PrefillDone
            return
        if rid in self.sched.held:
            self.sched.release(rid)
        elif rid in self.sched.requests:
            self.core.abort([rid])
        else:
            return
        self.dests.pop(rid, None)
        self.out.append(PrefillFailed(rid, "aborted", aborted=True))

    def step(self) -> None:
        self._stepped |= self.core.has_work
        for out in self.core.step() if self.core.has_work else []:
            if out.finish_reason is not None:
                self._prefilled(out)
        self._collect()

    def _prefilled(self, out: RequestOutput) -> None:
        rid = out.request_id
        dest = self.dests.pop(rid, None)
        if out.finish_reason in ("error", "abort") or dest is None:
            self.sched.release(rid)
            self.out.append(PrefillFailed(rid, out.error or f"prefill ended: {out.finish_reason}"))
            return
        if out.finish_reason != PREFILLED:  # the first token ends it: no KV needed
            self.out.append(self._done(out, TransferStats(0, 0, 0.0)))
            return
        req = self.sched.held[rid]
        bs = self.core.config.cache.block_size
        src = [b.block_id for b in req.blocks[dest.skip_blocks : -(-req.num_prompt_tokens // bs)]]
        if len(src) != len(dest.block_ids):
            self._fail(rid, f"{len(src)} blocks to send, {len(dest.block_ids)} reserved")
        elif time.time() > dest.deadline:
            self._fail(rid, "the decode worker's reservation expired before the prefill ended")
        else:
            job = self._pool.submit(
                self.sender.send, dest.endpoint, rid, src, dest.block_ids, self.timeout
            )
            self.sending[rid] = (job, out)

    def _collect(self) -> None:
        for rid, (job, out) in list(self.sending.items()):
            if not job.done():
                continue
            del self.sending[rid]
            self.aborted.discard(rid)
            try:
                stats = job.result()
            except Exception as exc:  # TransferError, or anything the backend raised
                log.warning("KV transfer of %s failed: %s", rid, exc)
                self._fail(rid, f"KV transfer failed: {exc}")
                continue
            self.sched.release(rid)
            self.out.append(self._done(out, stats))

    def _done(self, out: RequestOutput, stats: TransferStats) -> PrefillDone:
        logprob = out.logprobs[0] if out.logprobs else None
        return PrefillDone(out.request_id, out.new_token_ids[0], logprob, out.num_cached_tokens,
                           stats.num_blocks, stats.num_bytes, stats.seconds)  # fmt: skip

    def _fail(self, rid: str, error: str) -> None:
        self.sched.release(rid)
        self.out.append(PrefillFailed(rid, error))

    def drain(self) -> list[msgspec.Struct]:
        """Messages for the frontend; stats only when something moved."""
        events = from_block_events(self.core.kv.pool.drain_events())
        out, self.out = self.out, []
        if out or events or self._stepped:
            out.append(PrefillStats(self.sched.stats(), self.sched.num_transferring, events))
        self._stepped = False
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sender.close()


def serve(config: EngineConfig, input_addr: str, output_addr: str, args) -> None:
    inbox, outbox = worker_sockets(input_addr, output_addr)
    try:
        core = EngineCore(config, progress=False, scheduler_cls=PDScheduler)
        worker = PrefillWorker(core, args.transport, args.transfer_timeout)
    except Exception as exc:
        log.exception("prefill worker failed to start")
        outbox.send(encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    cfg = core.config
    outbox.send(encode(PrefillReady(cfg.cache.num_blocks, cfg.cache.block_size,
                                    core.max_model_len, core.model_name)))  # fmt: skip
    try:
        _loop(worker, inbox, outbox)
    finally:
        worker.close()


def _loop(worker: PrefillWorker, inbox, outbox) -> None:
    check = envs.DEBUG_INTEGRITY.get()
    parent = os.getppid()
    while True:
        wait = _BUSY_POLL_MS if worker.sending and not worker.core.has_work else _IDLE_POLL_MS
        if not worker.core.has_work and not inbox.poll(wait):
            if os.getppid() != parent:
                return
            if not worker.sending:
                continue
        while inbox.poll(0):
            msg = decode_input(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            worker.handle(msg)
        worker.step()
        for msg in worker.drain():
            outbox.send(encode(msg))
        if check and not worker.busy and not worker.sched.held:
            worker.core.check_integrity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill.worker")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--transfer-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get().upper(), stream=sys.stderr)
    serve(msgspec.json.decode(args.config, type=EngineConfig), args.input, args.output, args)


if __name__ == "__main__":
    main()
