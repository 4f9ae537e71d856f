"""Admission control: how much may wait for its first token before new requests are
turned away.

A request is *queued* from when it is admitted until each of its sequences has its first
token (or it ends). Past ``max_queued_requests`` sequences, or past ``max_queued_tokens``
prompt tokens, waiting, a new request gets 429 with ``Retry-After`` (OpenAI's shape)
before anything is sent anywhere, so memory and latency stay bounded however many
clients come at once. ``Retry-After`` is the queued prompt tokens over the rate they
have recently been leaving the queue (at least a second).
"""

from __future__ import annotations

import math
import time

from prometheus_client import Counter, Gauge

from server.errors import APIError


class Ticket:
    """One admitted request's place in the queue."""

    def __init__(self, admission: Admission, sequences: int, tokens_each: list[int]) -> None:
        self._admission = admission
        self._waiting = list(tokens_each)  # prompt tokens of each sequence still waiting
        self._sequences = sequences

    def started(self, index: int) -> None:
        """Sequence ``index`` has its first token: it leaves the queue."""
        tokens, self._waiting[index] = self._waiting[index], 0
        if tokens:
            self._admission._leave(1, tokens)

    def close(self) -> None:
        """The request is over: whatever still waits leaves."""
        left = [t for t in self._waiting if t]
        self._waiting = [0] * len(self._waiting)
        if left:
            self._admission._leave(len(left), sum(left), served=False)


class Admission:
    def __init__(self, max_requests: int, max_tokens: int, registry) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0
        self._rate = 0.0  # prompt tokens leaving the queue per second (moving average)
        self._last = time.monotonic()
        self.rejected = Counter("ferry_requests_rejected", "Requests turned away, by reason",
                                ["reason"], registry=registry)  # fmt: skip
        Gauge("ferry_queued_requests", "Sequences admitted and waiting for their first token",
              registry=registry).set_function(lambda: self.requests)  # fmt: skip
        Gauge("ferry_queued_prompt_tokens", "Prompt tokens of the sequences waiting",
              registry=registry).set_function(lambda: self.tokens)  # fmt: skip

    def admit(self, tokens_each: list[int]) -> Ticket:
        """A ticket for a request of these sequences (their prompt lengths), or a 429."""
        n, tokens = len(tokens_each), sum(tokens_each)
        if self.requests + n > self.max_requests:
            self._refuse("queue_full", f"{self.requests} requests are waiting (at most "
                         f"{self.max_requests})")  # fmt: skip
        if self.tokens and self.tokens + tokens > self.max_tokens:
            self._refuse("tokens_full", f"{self.tokens} prompt tokens are waiting (at most "
                         f"{self.max_tokens})")  # fmt: skip
        self.requests += n
        self.tokens += tokens
        return Ticket(self, n, tokens_each)

    def _refuse(self, reason: str, why: str) -> None:
        self.rejected.labels(reason).inc()
        wait = self.retry_after()
        raise APIError(f"The server is busy: {why}. Retry in {wait} s.", 429,
                       code="server_busy", headers={"Retry-After": str(wait)})  # fmt: skip

    def retry_after(self) -> int:
        if self._rate <= 0:
            return 1
        return max(1, math.ceil(self.tokens / self._rate))

    def _leave(self, sequences: int, tokens: int, served: bool = True) -> None:
        self.requests -= sequences
        self.tokens -= tokens
        if served:
            now = time.monotonic()
            rate = tokens / max(now - self._last, 1e-3)
            self._rate = 0.9 * self._rate + 0.1 * rate if self._rate else rate
            self._last = now
