"""Continuous batching with chunked prefill and preemption by recompute.

The scheduler only decides: ``schedule()`` returns a ``StepPlan``; the runner executes
it; ``update()`` folds the sampled tokens back into request state and says which
requests finished. One token budget per step is shared by every sequence: running
sequences go first (a decode costs one token, an unfinished prefill continues with the
next chunk), then waiting ones in arrival order. When blocks run out, the most recently
admitted running sequence is preempted: its blocks are freed and it re-enters the queue
head, to be recomputed (mostly from the prefix cache) later.

Speculative decoding adds one step after those (``_add_drafts``): each sampling chunk whose
request holds fresh drafts (``engine.spec.manager.SpecDecoding``) may verify some of
them after its last token, as many as the verify policy chooses within the token budget
and the free blocks (drafts never preempt anyone). ``update`` then keeps the tokens the
runner accepted, applying the stop rules token by token, and gives back the blocks that
held only rejected drafts (``KVCacheManager.truncate``). A model drafter writes its own
KV a few positions past a step's tokens: a sampling chunk's blocks cover that lookahead.
Under overlap a verify step may be assumed at its longest (``assume_sampled``) while the
next is planned; ``update`` then drops what it did not yield and moves the request back.

A request that asks for prompt logprobs skips the prefix-cache match until it has its
first token: every prompt position must run through the model for its logprobs (the
runner computes them in the same prefill), so a cached prefix is recomputed for it, and
only for it; its ``num_cached_tokens`` is 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.manager import NO_MATCH, KVCacheManager, PrefixMatch
from engine.messages import EngineStats, RequestOutput
from engine.plan import NewRequest, ScheduledChunk, StepPlan, StepResult
from engine.request import UNRESOLVED, Request, Status
from engine.spec.manager import SpecDecoding


class Scheduler:
    # whether the next step may be planned before this one's tokens are known (engine.core)
    overlappable = True
    drafts = True  # whether its requests decode here, so that speculation can help them
    decodes = True  # whether decode steps run here (their CUDA graphs or CPU programs pay)

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        spec: SpecDecoding | None = None,
    ) -> None:
        """``spec``: speculative decoding's drafts and verify policy (default: none)."""
        self.config = config
        self.spec = spec if spec is not None else SpecDecoding(SpeculativeConfig())
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
        self._add_drafts(chunks, self.config.max_num_batched_tokens - sum(c.num_tokens
                                                                          for c in chunks))
        finished, self._finished_ids = self._finished_ids, []
        return StepPlan(chunks, new_requests, finished, preempted, self.kv.take_computing(),
                        propose=self.spec.proposes)  # fmt: skip

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
            need = self._kv_tokens(req, req.num_computed_tokens, n)
            while not self.kv.can_allocate(req, need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            self.kv.allocate(req, need)
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
            need = self._kv_tokens(req, match.num_tokens, n)
            if not self.kv.can_allocate(req, need, match):
                break
            self.waiting.popleft()
            self._admit(req, match)
            self.kv.allocate(req, need, match)
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

    def _kv_tokens(self, req: Request, start: int, n: int) -> int:
        """Tokens to hold KV room for when ``n`` tokens from ``start`` run: a chunk that
        ends at the request's last token also keeps the drafter's lookahead (within the
        context length)."""
        if start + n < req.num_tokens or not self.spec.kv_lookahead:
            return n
        return max(n, min(n + self.spec.kv_lookahead, self.max_model_len - start))

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Let sampling chunks verify drafts after their last token: as many as the verify
        policy chooses, within ``budget`` tokens and the free blocks."""
        if not self.spec.enabled or budget <= 0:
            return
        where, candidates = [], []
        # none fresh, and none made on the device: nothing to look up
        for i, chunk in enumerate(chunks if self.spec.fresh or self.spec.drafting else ()):
            if chunk.sample:
                req = self.requests[chunk.request_id]
                candidate = self.spec.drafts_for(req, self._draft_room(req))
                if candidate is not None:
                    where.append(i)
                    candidates.append(candidate)
        base_tokens = self.config.max_num_batched_tokens - budget
        sampling = sum(1 for c in chunks if c.sample)
        decode = base_tokens == sampling == len(chunks)  # every chunk one token, sampled
        lengths = self.spec.lengths(candidates, base_tokens, sampling, decode=decode,
                                    limit=budget)  # fmt: skip
        for i, candidate, k in zip(where, candidates, lengths):
            req, chunk = candidate.request, chunks[i]
            n, k, need = chunk.num_tokens, min(k, budget), 0
            while k:  # as many as the free blocks allow
                tokens = self._kv_tokens(req, chunk.start_pos, n + k)
                need = self.kv.blocks_needed(req, tokens)
                if not need or self.kv.can_allocate(req, tokens):
                    break
                k -= 1
            if not k:
                continue
            block_ids = chunk.block_ids
            if need:  # (else the chunk's blocks hold them, and no real token is left to
                self.kv.allocate(req, tokens)  # publish)
                block_ids = [b.block_id for b in req.blocks]
            chunks[i] = ScheduledChunk(req.request_id, chunk.token_ids + candidate.token_ids[:k],
                                       chunk.start_pos, block_ids, True, k)  # fmt: skip
            self.spec.verifying(req.request_id, candidate.curve[:k])
            budget -= k

    def _draft_room(self, req: Request) -> int:
        """Most drafts ``req`` may verify: all kept plus one more token stay within its
        max_tokens and the context length."""
        left = req.sampling.max_tokens - len(req.output_token_ids) - 1
        return min(self.spec.max_draft, left, self.max_model_len - req.num_tokens - 1)

    def _chunk(self, req: Request, n: int, drafts: Sequence[int] = ()) -> ScheduledChunk:
        """The next ``n`` tokens after what is computed, then ``drafts`` to verify after
        them, once their blocks are allocated."""
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        req.moved_back = 0  # this chunk is placed where its tokens are
        block_ids = [b.block_id for b in req.blocks]
        return ScheduledChunk(
            req.request_id, req.token_ids(start, end) + list(drafts), start, block_ids,
            end == req.num_tokens, len(drafts),
        )  # fmt: skip

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = Status.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- folding results back ----------------------------------------------------------------

    def assume_sampled(self, plan: StepPlan) -> None:
        """Let ``plan``'s step run on while the next one is planned (overlap scheduling):
        count its tokens as computed and give each sampling request UNRESOLVED output
        tokens, which ``update`` replaces once the step's tokens are in: one, or for a
        chunk that verifies drafts as many as it yields at its longest (every draft kept,
        then the token after them). The next plan then feeds the last of them to the
        model straight from the device, which places it after the tokens really kept
        (``engine.runner``); ``update`` drops the ones the step did not yield."""
        self.spec.running(plan)
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.num_computed_tokens = chunk.end_pos - req.moved_back  # (Scheduler.update)
            req.moved_back = 0
            if chunk.sample:
                req.output_token_ids += [UNRESOLVED] * (chunk.num_draft + 1)
                req.num_unresolved += chunk.num_draft + 1

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        self.kv.commit(plan.computing)  # the blocks this plan filled are computed now
        self.spec.observe(plan, result)
        outputs = []
        for chunk in plan.chunks:
            rid = chunk.request_id
            req = self.requests.get(rid)
            if req is None:
                continue
            if chunk.sample and req.num_unresolved:  # assumed: fill in its tokens
                tokens = result.tokens(rid)
                req.resolve(tokens, chunk.num_draft + 1)
                req.moved_back = chunk.num_draft + 1 - len(tokens)
                if req.status is Status.RUNNING:
                    req.num_computed_tokens -= req.moved_back
                # (no truncation: the step after, planned before this outcome, may run
                # over the blocks past it; its own update gives them back)
                tokens, reason = self._resolved(req, tokens, result)
            else:
                if req.status is not Status.RUNNING:
                    continue
                kept = len(result.accepted.get(rid, ()))
                end = chunk.end_pos - req.moved_back  # planned before the step before was in
                req.num_computed_tokens = end - chunk.num_draft + kept
                if not chunk.sample:
                    continue
                tokens, reason = self._append(req, result.tokens(rid), result)
                if reason is None and (chunk.num_draft or self.spec.kv_lookahead):
                    self.kv.truncate(req, req.num_computed_tokens + max(1, self.spec.kv_lookahead))
            logprobs = result.logprobs.get(rid)
            outputs.append(
                RequestOutput(
                    rid,
                    tokens,
                    reason,
                    req.num_cached_tokens,
                    None if logprobs is None else logprobs[: len(tokens)],
                    req.stop_token_id,
                    prompt_logprobs=result.prompt_logprobs.get(rid),
                )
            )
            if reason is not None:
                self._finish(req, reason)
        if not self.has_work:
            self.spec.idle()  # the time until the next step is no step's
        return outputs

    def _append(
        self, req: Request, tokens: list[int], result: StepResult
    ) -> tuple[list[int], str | None]:
        """Append ``tokens`` up to the first that ends the request; returns those appended
        and the finish reason (None: it goes on)."""
        req.output_token_ids += tokens
        kept, reason = self._resolved(req, tokens, result)
        del req.output_token_ids[len(req.output_token_ids) - len(tokens) + len(kept) :]
        return kept, reason

    def _resolved(
        self, req: Request, tokens: list[int], result: StepResult
    ) -> tuple[list[int], str | None]:
        """The stop rules over ``tokens``, just resolved in place (``Request.resolve``):
        those up to the first that ends the request, and the finish reason (None: it goes
        on)."""
        before = req.num_resolved_outputs - len(tokens)
        for i, token in enumerate(tokens):
            outputs = before + i + 1
            if i == len(tokens) - 1:
                reason = self._last_reason(req, token, result, outputs)
            else:
                reason = self._stop_reason(req, token, outputs)
            if reason is not None:
                return tokens[: i + 1], reason
        return tokens, None

    def _last_reason(
        self, req: Request, token: int, result: StepResult, outputs: int | None = None
    ) -> str | None:
        """The stop rules for a step's last token of ``req``, whose grammar may end there."""
        if req.request_id in result.ended:
            return "stop"
        return self._stop_reason(req, token, outputs)

    def _stop_reason(self, req: Request, token: int, outputs: int | None = None) -> str | None:
        """The stop rules for ``token``, the ``outputs``-th resolved output (default: the
        last one)."""
        sp = req.sampling
        if outputs is None:
            outputs = req.num_resolved_outputs
        if outputs >= sp.min_tokens and (
            token in sp.stop_token_ids or (not sp.ignore_eos and token in req.eos_token_ids)
        ):
            req.stop_token_id = token
            return "stop"
        if self._length_reached(req, req.num_prompt_tokens + outputs):
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
        self.spec.forget(req.request_id)
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
            **self.spec.stats(),
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity([r.blocks for r in self.requests.values()])
