"""A prefill worker's requests whose image embeddings come from encode workers.

``EmbeddingWaits`` holds such a request until every image's embeddings have landed in
this worker's inbox (``engine.media.EmbeddingInbox``), then hands it over with them; the
request enters the engine only then. In order:

1. ``add``: the request waits for inbox blocks (in arrival order; an image needs
   ``ceil(tokens / block_size)`` of them).
2. ``reserve``: blocks for all its images at once, the receiver told which transfer may
   write which (``expect``), and an ``EmbeddingsWanted`` for the frontend. The
   destinations' deadline is the request's own KV deadline or the transfer timeout from
   now, whichever is sooner.
3. ``ready`` / ``failed``: the frontend's answer for one image (a ready image whose
   blocks the receiver did not see written counts as failed).
4. ``take``: requests whose every image is answered: with all of them ready and the
   request not cancelled, its embeddings (copied out) and the request; otherwise its
   failure. Blocks go back to the inbox then — never before every image is answered (a
   write may still be coming), except ``GRACE_S`` past the deadline, when none can.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv_cache.block_pool import Block
from engine.media import EmbeddingInbox, blocks_for
from kvstore.transport.base import KVDestination
from prefill.messages import EmbeddingsWanted, PrefillRequest

GRACE_S = 10.0  # past a destination's deadline: time for a send already started


@dataclass
class _Waiting:
    request: PrefillRequest
    blocks: list[list[Block]] = field(default_factory=list)  # per image, once reserved
    transfer_ids: list[str] = field(default_factory=list)
    answers: dict[int, str | None] = field(default_factory=dict)  # image → None (ready) | error
    deadline: float = 0.0
    cancelled: str | None = None

    @property
    def num_images(self) -> int:
        return len(self.request.request.media)

    @property
    def settled(self) -> bool:
        return bool(self.blocks) and len(self.answers) == self.num_images


@dataclass(frozen=True)
class Failure:
    request_id: str
    error: str
    aborted: bool


class EmbeddingWaits:
    def __init__(self, inbox: EmbeddingInbox, timeout_s: float, name: str) -> None:
        self.inbox = inbox
        self.timeout_s = timeout_s
        self.name = name  # in the transfer ids, so that a retry elsewhere never shares one
        self._queue: deque[str] = deque()
        self._waiting: dict[str, _Waiting] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def add(self, request: PrefillRequest) -> None:
        self._waiting[request.request_id] = _Waiting(request)
        self._queue.append(request.request_id)

    def reserve(self) -> list[EmbeddingsWanted]:
        """Reserve inbox blocks for waiting requests, in order, while they fit."""
        wanted = []
        while self._queue:
            wait = self._waiting.get(self._queue[0])
            if wait is None or wait.cancelled is not None:  # gone before it got blocks
                self._queue.popleft()
                continue
            media = wait.request.request.media
            need = sum(blocks_for(m.length, self.inbox.block_size) for m in media)
            if need > self.inbox.pool.num_free:
                break
            self._queue.popleft()
            wanted.append(self._reserve(wait))
        return wanted

    def _reserve(self, wait: _Waiting) -> EmbeddingsWanted:
        rid = wait.request.request_id
        wait.deadline = min(wait.request.destination.deadline, time.time() + self.timeout_s)
        destinations = []
        for i, item in enumerate(wait.request.request.media):
            blocks = self.inbox.reserve(item.length)
            assert blocks is not None  # counted above
            tid = f"{rid}#{i}@{self.name}"
            ids = [b.block_id for b in blocks]
            self.inbox.receiver.expect(tid, ids)
            wait.blocks.append(blocks)
            wait.transfer_ids.append(tid)
            destinations.append(KVDestination(self.inbox.receiver.endpoint, ids, 0, wait.deadline))
        return EmbeddingsWanted(rid, destinations, wait.transfer_ids)

    def ready(self, request_id: str, index: int) -> None:
        wait = self._waiting.get(request_id)
        if wait is None or not wait.blocks or index in wait.answers:
            return
        landed = self.inbox.receiver.landed(wait.transfer_ids[index])
        wait.answers[index] = None if landed else "told the embeddings were ready, not landed"

    def failed(self, request_id: str, index: int, error: str) -> None:
        wait = self._waiting.get(request_id)
        if wait is not None and wait.blocks and index not in wait.answers:
            wait.answers[index] = error

    def cancel(self, request_id: str, why: str = "aborted") -> None:
        """No prefill for it: its blocks go back once every image is answered."""
        wait = self._waiting.get(request_id)
        if wait is None:
            return
        wait.cancelled = why
        if not wait.blocks:  # nothing was asked for: it ends at once
            wait.answers = dict.fromkeys(range(wait.num_images), why)

    def take(self) -> tuple[list[tuple[PrefillRequest, list[torch.Tensor]]], list[Failure]]:
        """Requests that are settled (see the module docstring), and those past their
        deadline and the grace period, which fail."""
        ready, failures = [], []
        now = time.time()
        for rid, wait in list(self._waiting.items()):
            if wait.blocks:
                expired = now > wait.deadline + GRACE_S
            else:  # still waiting for inbox blocks: its KV's own deadline bounds that
                expired = now > wait.request.destination.deadline
            if not (wait.settled or (not wait.blocks and wait.cancelled) or expired):
                continue
            del self._waiting[rid]
            errors = [e for e in wait.answers.values() if e is not None]
            if wait.settled and not errors and wait.cancelled is None:
                media = wait.request.request.media
                rows = [self.inbox.read(b, m.length) for b, m in zip(wait.blocks, media)]
                ready.append((wait.request, rows))
            elif wait.cancelled is not None:
                failures.append(Failure(rid, wait.cancelled, aborted=True))
            elif errors:
                failures.append(Failure(rid, f"image embeddings: {errors[0]}", aborted=False))
            else:
                failures.append(Failure(rid, "the image embeddings did not arrive in time",
                                        aborted=False))  # fmt: skip
            self._free(wait)
        return ready, failures

    def _free(self, wait: _Waiting) -> None:
        for tid in wait.transfer_ids:
            self.inbox.receiver.forget(tid)
        for blocks in wait.blocks:
            self.inbox.free(blocks)

    def check_integrity(self) -> None:
        held = {b.block_id: 1 for w in self._waiting.values() for bs in w.blocks for b in bs}
        self.inbox.pool.check_integrity(held)

    def close(self) -> None:
        self.inbox.close()
