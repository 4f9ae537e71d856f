"""Continuous batching with chunked prefill and preemption by recompute.

The scheduler only decides: ``schedule()`` returns a ``StepPlan``; the runner executes
it; ``update()`` folds the sampled tokens back into request state and says which
requests finished. One token budget per step is shared by every sequence: running
sequences go first (a decode costs one token, an unfinished prefill continues with the
next chunk), then waiting ones in arrival order. When blocks run out, the most recently
admitted running sequence is preempted: its blocks are freed and it re-enters the queue
head, to be recomputed (mostly from the prefix cache) later.

A request that asks for prompt logprobs skips the prefix-cache match until it has its
first token: every prompt position must run through the model for its logprobs (the
runner computes them in the same prefill), so a cached prefix is recomputed for it, and
only for it; its ``num_cached_tokens`` is 0.
"""

from __future__ import annotations

from collections import deque

from engine.config import SchedulerConfig
from engine.kv_cache.manager import NO_MATCH, KVCacheManager, PrefixMatch
from engine.messages import EngineStats, RequestOutput
from engine.plan import NewRequest, ScheduledChunk, StepPlan, StepResult
from engine.request import UNRESOLVED, Request, Status


class Scheduler:
    # whether the next step may be planned before this one's tokens are known (engine.core)
    overlappable = True

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._known_to_runner: set[str] = set()
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # -- intake ---------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- deciding ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, chunks, preempted)
        new_requests = [] if preempted else self._schedule_waiting(budget, chunks)
        finished, self._finished_ids = self._finished_ids, []
        return StepPlan(chunks, new_requests, finished, preempted, self.kv.take_computing())

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_unresolved and self._length_reached(req, req.num_tokens):
                i += 1  # the step in flight gives it its last token
                continue
            n = min(req.num_pending_tokens, budget)
            while not self.kv.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            self.kv.allocate(req, n)
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> list[NewRequest]:
        new_requests = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            match = NO_MATCH if req.computes_whole_prompt else self.kv.match_prefix(req)
            n = min(req.num_tokens - match.num_tokens, budget)
            if not self.kv.can_allocate(req, n, match):
                break
            self.waiting.popleft()
            self._admit(req, match)
            self.kv.allocate(req, n, match)
            chunks.append(self._chunk(req, n))
            budget -= n
            if req.request_id not in self._known_to_runner:
                self._known_to_runner.add(req.request_id)
                new_requests.append(NewRequest.of(req))
        return new_requests

    def _admit(self, req: Request, match: PrefixMatch) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = match.num_tokens
            self.kv.record_lookup(req, match)
        req.status = Status.RUNNING
        self.running.append(req)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        """The next ``n`` tokens after what is computed, once their blocks are allocated."""
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        block_ids = [b.block_id for b in req.blocks]
        return ScheduledChunk(
            req.request_id, req.token_ids(start, end), start, block_ids, end == req.num_tokens
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = Status.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- folding results back ----------------------------------------------------------------

    def assume_sampled(self, plan: StepPlan) -> None:
        """Let ``plan``'s step run on while the next one is planned (overlap scheduling):
        count its tokens as computed and give each sampling request an UNRESOLVED output
        token, which ``update`` replaces once the step's tokens are in. The next plan then
        feeds that token to the model straight from the device."""
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.num_computed_tokens = chunk.end_pos
            if chunk.sample:
                req.output_token_ids.append(UNRESOLVED)
                req.num_unresolved += 1

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        self.kv.commit(plan.computing)  # the blocks this plan filled are computed now
        outputs = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue
            if chunk.sample and req.num_unresolved:  # assumed: fill in its token
                req.resolve(result.sampled[req.request_id])
                token = req.output_token_ids[req.num_resolved_outputs - 1]
            else:
                if req.status is not Status.RUNNING:
                    continue
                req.num_computed_tokens = chunk.end_pos
                if not chunk.sample:
                    continue
                token = result.sampled[req.request_id]
                req.output_token_ids.append(token)
            reason = "stop" if req.request_id in result.ended else self._stop_reason(req, token)
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [token],
                    reason,
                    req.num_cached_tokens,
                    [result.logprobs[req.request_id]]
                    if req.request_id in result.logprobs
                    else None,
                    req.stop_token_id,
                    prompt_logprobs=result.prompt_logprobs.get(req.request_id),
                )
            )
            if reason is not None:
                self._finish(req, reason)
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling
        if req.num_resolved_outputs >= sp.min_tokens and (
            token in sp.stop_token_ids or (not sp.ignore_eos and token in req.eos_token_ids)
        ):
            req.stop_token_id = token
            return "stop"
        if self._length_reached(req, req.num_tokens - req.num_unresolved):
            return "length"
        return None

    def _length_reached(self, req: Request, num_tokens: int) -> bool:
        """Whether ``req`` is at its length limit with ``num_tokens`` tokens."""
        num_outputs = num_tokens - req.num_prompt_tokens
        return num_outputs >= req.sampling.max_tokens or num_tokens >= self.max_model_len

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=pool.num_usable - pool.num_free,
            kv_blocks_total=pool.num_usable,
            prefix_query_tokens=self.kv.query_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
            num_preemptions=self.num_preemptions,
            **self.kv.tier_stats(),
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity([r.blocks for r in self.requests.values()])
