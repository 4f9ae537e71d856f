"""The prefill worker process: ``python -m prefill.worker``.

Runs an ``EngineCore`` (with ``PDScheduler``) on prompts only: each request is
prefill-only, so it finishes after its first token and keeps its blocks. Its KV goes to
the decode worker's reserved blocks (``PrefillRequest.dest``) through the KV transport,
on a background thread, *while the prompt is still being computed*: after every step the
blocks that chunked prefill has filled are sent, each send pinning its source blocks
(``PDScheduler.pin``) so that a preemption or an abort cannot recycle them mid-send.
When the prompt is done, the rest (the last, partial block included) follows. Once every
send has landed the request's blocks are released — full ones stay in this worker's
prefix cache — and ``PrefillDone`` (first token, transfer figures) goes to the frontend,
which tells the decode worker. Every request ends in exactly one ``PrefillDone`` or
``PrefillFailed``, and only when none of its sends is still running: the decode worker
frees its reservation on either.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from engine import envs
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.ipc import WorkerChannel, add_worker_args, linger, parent_watch, run_worker_main
from engine.kv_cache.block_pool import Block
from engine.messages import EngineRequest, RequestOutput
from engine.pd_scheduler import PREFILLED, PDScheduler
from engine.request import Status
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
    outcome: RequestOutput | None = None  # the prefill's end, once it has ended
    failure: PrefillFailed | None = None  # set when no KV will be delivered

    @property
    def settled(self) -> bool:
        return not self.jobs and (self.failure is not None or self.outcome is not None)


class PrefillWorker:
    def __init__(self, core: EngineCore, transport: str, transfer_timeout_s: float) -> None:
        self.core = core
        self.sched: PDScheduler = core.scheduler  # type: ignore[assignment]
        self.block_size = core.config.cache.block_size
        self.sender = get_transport(transport).sender(core.kv_cache)
        self.timeout = transfer_timeout_s
        self.shipments: dict[str, _Shipment] = {}
        self.out: list[msgspec.Struct] = []
        self.tokens_per_s = 0.0
        self.draining = False  # finishing what it has (reported to frontends)
        self._stepped = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-send")

    @property
    def sending(self) -> bool:
        return any(s.jobs for s in self.shipments.values())

    @property
    def busy(self) -> bool:
        return self.core.has_work or self.sending

    def handle(self, msg: PrefillRequest | AbortPrefill) -> None:
        self._stepped = True  # the stats may have changed: report them
        if isinstance(msg, PrefillRequest):
            self._add(msg)
        else:
            for rid in msg.request_ids:
                self._abort(rid)
        self._collect()

    def _add(self, msg: PrefillRequest) -> None:
        rid = msg.request_id
        self.sched.prefill_only.add(rid)
        engine_msg = EngineRequest(rid, msg.prompt_token_ids, msg.sampling, msg.arrival_time,
                                   msg.cache_salt, msg.output_token_ids)  # fmt: skip
        err = self.core.add_request(engine_msg)
        if err is not None:
            self.sched.prefill_only.discard(rid)
            self.out.append(PrefillFailed(rid, err.error or "invalid request"))
            return
        num_tokens = len(msg.prompt_token_ids) + len(msg.output_token_ids)
        self.shipments[rid] = _Shipment(msg.dest, num_tokens)

    def _abort(self, rid: str) -> None:
        ship = self.shipments.get(rid)
        if ship is None or ship.failure is not None:
            return
        self._stop(rid, ship, PrefillFailed(rid, "aborted", aborted=True))

    def _stop(self, rid: str, ship: _Shipment, failure: PrefillFailed) -> None:
        """No KV will be delivered: stop computing, give the blocks back (those still being
        sent stay pinned until their send ends), report once the sends have drained."""
        ship.failure = failure
        if rid in self.sched.held:
            self.sched.release(rid)
        elif rid in self.sched.requests:
            self.core.abort([rid])

    def step(self) -> None:
        self._stepped |= self.core.has_work
        before = {rid: r.num_computed_tokens for rid, r in self.sched.requests.items()}
        started = time.perf_counter()
        for out in self.core.step() if self.core.has_work else []:
            if out.finish_reason is not None:
                self._prefilled(out)
        self._measure(before, time.perf_counter() - started)
        for rid, ship in self.shipments.items():
            req = self.sched.requests.get(rid)
            if ship.failure is None and req is not None and req.status is Status.RUNNING:
                self._ship(rid, ship, min(req.num_computed_tokens, ship.num_tokens))
        self._collect()

    def _measure(self, before: dict[str, int], seconds: float) -> None:
        """Fold this step's prompt tokens per second into the moving average."""
        computed = 0
        for rid, was in before.items():
            req = self.sched.requests.get(rid)
            ship = self.shipments.get(rid)
            now = req.num_computed_tokens if req else ship.num_tokens if ship else was
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
        req = self.sched.held[rid] if final else self.sched.requests[rid]
        dest = ship.dest
        end = -(-num_tokens // self.block_size) if final else num_tokens // self.block_size
        begin = dest.skip_blocks + ship.sent
        if end - dest.skip_blocks > len(dest.block_ids):
            self._stop(rid, ship, PrefillFailed(
                rid, f"{end - dest.skip_blocks} blocks to send, {len(dest.block_ids)} reserved"
            ))  # fmt: skip
            return
        if end <= begin:
            return
        if time.time() > dest.deadline:
            self._stop(rid, ship, PrefillFailed(
                rid, "the decode worker's reservation expired before the prefill ended"
            ))  # fmt: skip
            return
        blocks = self.sched.pin(req.blocks[begin:end])
        src = [b.block_id for b in blocks]
        dst = dest.block_ids[ship.sent : ship.sent + len(src)]
        job = self._pool.submit(self.sender.send, dest.endpoint, rid, src, dst, self.timeout)
        ship.jobs.append((job, blocks))
        ship.sent += len(src)
        if not final:
            ship.streamed += len(src)

    def _collect(self) -> None:
        for rid, ship in list(self.shipments.items()):
            while ship.jobs and ship.jobs[0][0].done():
                job, blocks = ship.jobs.pop(0)
                self.sched.unpin(blocks)
                try:
                    stats = job.result()
                except Exception as exc:  # TransferError, or anything the backend raised
                    if ship.failure is None:
                        log.warning("KV transfer of %s failed: %s", rid, exc)
                        failure = PrefillFailed(rid, f"KV transfer failed: {exc}", retry=True)
                        self._stop(rid, ship, failure)
                    continue
                ship.num_blocks += stats.num_blocks
                ship.num_bytes += stats.num_bytes
                ship.seconds += stats.seconds
            if ship.settled:
                del self.shipments[rid]
                self.out.append(ship.failure or self._done(rid, ship))

    def _done(self, rid: str, ship: _Shipment) -> PrefillDone:
        self.sched.release(rid)
        out = ship.outcome
        logprob = out.logprobs[0] if out.logprobs else None
        return PrefillDone(rid, out.new_token_ids[0], logprob, out.num_cached_tokens,
                           ship.num_blocks, ship.num_bytes, ship.seconds,
                           ship.streamed)  # fmt: skip

    def heartbeat(self) -> PrefillStats:
        """Stats for frontends while idle, with the KV events that came in meanwhile (the
        KV tiers' writer finishes files after the last step)."""
        events = self.core.kv.pool.drain_events()
        return PrefillStats(self.sched.stats(), self.sched.num_transferring, events,
                            self.tokens_per_s, self.draining)  # fmt: skip

    def drain(self) -> list[msgspec.Struct]:
        """Messages for the frontend; stats only when something moved."""
        events = self.core.kv.pool.drain_events()
        out, self.out = self.out, []
        if out or events or self._stepped:
            out.append(PrefillStats(self.sched.stats(), self.sched.num_transferring, events,
                                    self.tokens_per_s, self.draining))  # fmt: skip
        self._stepped = False
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sender.close()


def serve(config: EngineConfig, channel: WorkerChannel, args) -> None:
    """Run a prefill worker on ``channel`` until told to shut down."""
    try:
        core = EngineCore(config, progress=False, scheduler_cls=PDScheduler)
        worker = PrefillWorker(core, args.transport, args.transfer_timeout)
    except Exception as exc:
        log.exception("prefill worker failed to start")
        channel.ready(encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        linger(channel)
        return
    cfg = core.config
    channel.ready(encode(PrefillReady(cfg.cache.num_blocks, cfg.cache.block_size,
                                      core.max_model_len, core.model_name,
                                      core.hash_extra)))  # fmt: skip
    try:
        _loop(worker, channel, args)
    finally:
        worker.close()


def _loop(worker: PrefillWorker, channel: WorkerChannel, args) -> None:
    check = envs.DEBUG_INTEGRITY.get()
    orphaned = parent_watch(args.exit_with_parent)
    drain = getattr(args, "drain", None)
    while True:
        worker.draining = drain is not None and drain.is_set()
        if worker.draining and not worker.busy and not worker.sched.held:
            beat = worker.heartbeat()
            channel.broadcast(encode(beat), beat.events)
            return
        wait = _BUSY_POLL_MS if worker.sending and not worker.core.has_work else _IDLE_POLL_MS
        if not worker.core.has_work and not channel.poll(wait):
            if orphaned():
                return
            if not worker.sending:
                beat = worker.heartbeat()
                channel.broadcast(encode(beat), beat.events)
                continue
        for frontend, msg in channel.pending(decode_input):
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, PrefillRequest):
                channel.claim(msg.request_id, frontend)
            worker.handle(msg)
        worker.step()
        for msg in worker.drain():
            if isinstance(msg, PrefillStats):
                channel.broadcast(encode(msg), msg.events)
            else:
                channel.send_for(msg.request_id, encode(msg), release=True)
        if not worker.busy:
            channel.owners.clear()
            if check and not worker.sched.held:
                worker.core.check_integrity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill.worker")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get().upper(), stream=sys.stderr)
    run_worker_main(args, serve, msgspec.json.decode(args.config, type=EngineConfig))


if __name__ == "__main__":
    main()
