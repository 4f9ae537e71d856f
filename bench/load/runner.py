"""Drives sessions against a server: closed loop (fixed concurrency) or open loop (rate).

Closed loop: ``concurrency`` users, each taking the next session from a shared queue and
running its turns back to back (with the turns' think times). Open loop: sessions arrive
as a Poisson process of ``rate`` sessions per second (exponential gaps from a seeded
``random.Random``), however many are in flight.

HTTP: one ``httpx.AsyncClient`` per ``streams_per_client`` concurrent streams, not one
shared client: a single client's pool serialises its bookkeeping and collapsed under 64
concurrent streams on this project's machines (FACTS.md). Closed-loop user ``i`` uses
client ``i // streams_per_client``; open-loop session ``k`` uses client ``k % n``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from bench.load.client import RequestResult, stream_chat
from bench.load.workloads import ENDPOINTS, Session, count_requests

OPEN_LOOP_CLIENTS = 8


@dataclass(frozen=True)
class LoadConfig:
    """Where and how hard to send. Exactly one of ``concurrency`` and ``rate`` is set.

    ``endpoint``: ``chat`` posts to ``chat_url``; ``responses`` posts the same
    conversations to the server's ``/v1/responses`` (beside ``chat_url``'s
    ``/chat/completions``) as message input."""

    chat_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    streams_per_client: int = 16
    ignore_eos: bool = True
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("set exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")

    @property
    def url(self) -> str:
        if self.endpoint == "chat":
            return self.chat_url
        return self.chat_url.removesuffix("/chat/completions") + "/responses"


@dataclass(frozen=True)
class RunResult:
    results: list[RequestResult]
    duration_s: float


def request_body(cfg: LoadConfig, messages: list, turn_max: int | None, extra) -> dict:
    """The request body: streaming with usage, output length pinned unless overridden (a
    Responses API body carries the messages as ``input`` and ``max_output_tokens``)."""
    body: dict[str, Any] = {"model": cfg.model, "stream": True}
    if cfg.endpoint == "chat":
        body.update(messages=messages, stream_options={"include_usage": True})
    else:
        body["input"] = messages
    if turn_max is not None:
        body["max_tokens" if cfg.endpoint == "chat" else "max_output_tokens"] = turn_max
        body["ignore_eos"] = cfg.ignore_eos
    body.update(cfg.extra_body)
    body.update(extra)
    return body


def run_load(sessions: list[Session], cfg: LoadConfig) -> RunResult:
    """Run every session to completion; blocking wrapper around :func:`run_load_async`."""
    return asyncio.run(run_load_async(sessions, cfg))


async def run_load_async(sessions: list[Session], cfg: LoadConfig) -> RunResult:
    results: list[RequestResult] = []
    bar = tqdm(total=count_requests(sessions), disable=not cfg.progress, unit="req")

    def sink(r: RequestResult) -> None:
        results.append(r)
        bar.update(1)
        if not r.ok:
            bar.set_postfix(errors=sum(not x.ok for x in results), refresh=False)

    clients = _make_clients(cfg)
    try:
        t0 = time.perf_counter()
        runner = _closed_loop if cfg.concurrency is not None else _open_loop
        await runner(sessions, cfg, clients, sink, t0)
        duration = max((r.start_s + r.e2e_s for r in results), default=0.0)
    finally:
        bar.close()
        await asyncio.gather(*(c.aclose() for c in clients))
    first = min((r.start_s for r in results), default=0.0)
    return RunResult(results, duration - first)


def _make_clients(cfg: LoadConfig) -> list[httpx.AsyncClient]:
    per = cfg.streams_per_client
    if cfg.concurrency is not None:
        n, limit = math.ceil(cfg.concurrency / per), per
    else:
        n, limit = OPEN_LOOP_CLIENTS, None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    return [
        httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, trust_env=False)
        for _ in range(n)
    ]


Sink = Callable[[RequestResult], None]


async def _run_session(
    session: Session, cfg: LoadConfig, client: httpx.AsyncClient, sink: Sink, t0: float
) -> None:
    """Send the session's turns in order, carrying the conversation between them."""
    history: list = []
    for turn in session.turns:
        if turn.think_time_s:
            await asyncio.sleep(turn.think_time_s)
        history.extend(turn.messages)
        body = request_body(cfg, list(history), turn.max_tokens, turn.extra)
        result = await stream_chat(client, cfg.url, body, t0, cfg.endpoint == "responses")
        sink(result)
        if len(session.turns) > 1:
            history.append({"role": "assistant", "content": result.text or "(no answer)"})


async def _closed_loop(sessions, cfg: LoadConfig, clients, sink: Sink, t0: float) -> None:
    queue = list(reversed(sessions))

    async def user(i: int) -> None:
        client = clients[i // cfg.streams_per_client]
        while queue:
            await _run_session(queue.pop(), cfg, client, sink, t0)

    await asyncio.gather(*(user(i) for i in range(cfg.concurrency)))


async def _open_loop(sessions, cfg: LoadConfig, clients, sink: Sink, t0: float) -> None:
    rng = random.Random(cfg.seed)
    tasks, due = [], t0
    for k, session in enumerate(sessions):
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        client = clients[k % len(clients)]
        tasks.append(asyncio.create_task(_run_session(session, cfg, client, sink, t0)))
        due += rng.expovariate(cfg.rate)
    await asyncio.gather(*tasks)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """The open loop's session arrival times (seconds from start), for tests and reports."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
