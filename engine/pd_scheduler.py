"""The scheduler with what prefill/decode disaggregation adds, one subclass per side.

- ``PrefillScheduler`` (prefill worker): every request is prefill-only. It finishes after
  its first token with reason ``"prefilled"`` but keeps its blocks (``held``) until the
  worker has shipped them and calls ``release``. Blocks shipped while the prompt is still
  being computed are ``pin``-ned for the duration of their send, so that neither a
  preemption nor an abort can hand them to another request mid-send. Its steps never
  overlap: the worker ships a request's blocks as soon as its step ends.
- ``DecodeScheduler`` (decode worker): a request announced with ``expect_kv`` takes its
  KV from elsewhere. On ``add``, when its uncached tail is longer than its threshold, it is
  not queued for compute; it waits in ``reserving`` until ``reserve_pending`` can give it
  blocks for the whole prompt up front (its own prefix-cache hits included, so only the
  rest needs sending), then sits in ``incoming`` until ``admit_transferred`` enters it as
  running with the prompt computed and the first token appended. Reserved blocks are
  published only on admission, so no prefix match finds them before their content has
  landed. A short tail is queued as an ordinary request: the decode worker prefills it.

Everything else — budget, chunked prefill, preemption, stop rules — is ``Scheduler``'s.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from engine.kv_cache.block_pool import Block
from engine.messages import RequestOutput, TokenLogprob
from engine.plan import NewRequest, StepPlan
from engine.request import Request, Status
from engine.scheduler import Scheduler

PREFILLED = "prefilled"


class PrefillScheduler(Scheduler):
    overlappable = False  # a request's blocks are shipped as soon as its step has run
    drafts = False  # every request ends at its first token
    decodes = False  # ... sampled by its last prompt chunk: no decode step ever runs

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, Request] = {}
        self._pinned: list[list[Block]] = []

    def computed_tokens(self, request_id: str) -> int | None:
        """Tokens of a request's prompt computed so far (0 while it waits); None once it
        has ended."""
        req = self.requests.get(request_id)
        return None if req is None else req.num_computed_tokens

    def blocks(self, request_id: str) -> list[Block]:
        """The blocks of a running or held request."""
        req = self.held.get(request_id) or self.requests[request_id]
        return req.blocks

    def pin(self, blocks: list[Block]) -> list[Block]:
        """Take an extra reference on ``blocks`` (a send reads them); ``unpin`` returns it."""
        self.kv.pool.touch(blocks)
        self._pinned.append(blocks)
        return blocks

    def unpin(self, blocks: list[Block]) -> None:
        self._pinned.remove(blocks)
        self.kv.pool.free(list(reversed(blocks)))

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request (full ones stay in the prefix cache)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def stop(self, request_id: str) -> None:
        """No KV will be delivered for it: stop computing it, give its blocks back (those
        pinned by a running send stay so until it ends)."""
        if request_id in self.held:
            self.release(request_id)
        else:
            self.abort([request_id])

    @property
    def num_transferring(self) -> int:
        return len(self.held)

    def _stop_reason(self, req: Request, token: int, outputs: int | None = None) -> str | None:
        return super()._stop_reason(req, token, outputs) or PREFILLED

    def _finish(self, req: Request, reason: str) -> None:
        if reason != PREFILLED:
            super()._finish(req, reason)
            return
        blocks, req.blocks = req.blocks, []  # kept: the worker ships them, then releases
        super()._finish(req, reason)
        req.blocks = blocks
        self.held[req.request_id] = req

    def check_integrity(self) -> None:
        holders = [r.blocks for r in (*self.requests.values(), *self.held.values())]
        self.kv.check_integrity([*holders, *self._pinned])


class DecodeScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kv_expected: dict[str, int] = {}  # request id -> longest tail computed here
        self.reserving: deque[Request] = deque()
        self.incoming: dict[str, Request] = {}
        self._admitted: list[NewRequest] = []

    def expect_kv(self, request_id: str, local_prefill_tokens: int) -> None:
        """The next ``add`` of ``request_id`` takes its KV from a prefill worker, unless its
        uncached tail is at most ``local_prefill_tokens`` long."""
        self._kv_expected[request_id] = local_prefill_tokens

    def unexpect_kv(self, request_id: str) -> None:
        """Undo ``expect_kv`` for a request that was refused before its ``add``."""
        self._kv_expected.pop(request_id, None)

    def add(self, req: Request) -> None:
        threshold = self._kv_expected.pop(req.request_id, None)
        if threshold is None or self._missing_tokens(req) <= threshold:
            super().add(req)
            return
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        req.status = Status.AWAITING_KV
        self.reserving.append(req)

    def _missing_tokens(self, req: Request) -> int:
        """Tokens of ``req`` no cache here holds (all of them when it computes its whole
        prompt: its prompt logprobs are wanted; or when what is missing holds image
        tokens: only a prefill worker gets their embeddings)."""
        if req.computes_whole_prompt:
            return req.num_tokens
        cached = self.kv.match_prefix(req).num_tokens
        return req.num_tokens if cached < req.media_end else req.num_tokens - cached

    def reserve_pending(self) -> list[Request]:
        """Reserve blocks for queued incoming requests, in order, while they fit."""
        reserved = []
        while self.reserving:
            req = self.reserving[0]
            match = self.kv.match_prefix(req)
            n = req.num_tokens - match.num_tokens
            if not self.kv.can_allocate(req, n, match):
                break
            self.reserving.popleft()
            self.kv.reserve(req, n, match)
            req.num_cached_tokens = match.num_tokens
            self.kv.record_lookup(req, match)
            self.incoming[req.request_id] = req
            reserved.append(req)
        return reserved

    def admit_transferred(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None,
        num_cached_tokens: int = 0,
    ) -> RequestOutput:  # fmt: skip
        """The KV of ``request_id``'s prompt has landed (``num_cached_tokens`` of it came
        from the sender's caches): run it from its first token, whose output this is. When
        that token already ends it, the prefill worker has not sent (all of) the KV: the
        blocks are freed unpublished, so no prefix match can ever find what they hold."""
        req = self.incoming.pop(request_id)
        req.num_cached_tokens = max(req.num_cached_tokens, num_cached_tokens)
        num_context = req.num_tokens  # the prompt, and a resumed request's outputs
        req.output_token_ids.append(first_token)
        reason = self._stop_reason(req, first_token)
        out = RequestOutput(
            request_id, [first_token], reason, req.num_cached_tokens,
            None if logprob is None else [logprob], req.stop_token_id,
        )  # fmt: skip
        if reason is not None:
            self._finish(req, reason)
            return out
        req.num_computed_tokens = num_context
        self.kv.publish(req, num_context)
        req.status = Status.RUNNING
        self.running.append(req)
        self._known_to_runner.add(request_id)
        self._admitted.append(NewRequest.of(req))
        return out

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        if self._admitted:
            plan = dataclasses.replace(plan, new_requests=self._admitted + plan.new_requests)
            self._admitted = []
        return plan

    def _finish(self, req: Request, reason: str) -> None:
        self.incoming.pop(req.request_id, None)
        if req.status is Status.AWAITING_KV and req in self.reserving:
            self.reserving.remove(req)
        self._admitted = [n for n in self._admitted if n.request_id != req.request_id]
        super()._finish(req, reason)

    @property
    def num_transferring(self) -> int:
        return len(self.incoming) + len(self.reserving)
