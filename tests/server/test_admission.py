"""Admission control and timeouts over real HTTP: past the queue bound new requests get
429 with Retry-After and the admitted ones complete, the frontend's memory stays
bounded; a request past --request-timeout ends with a clear error and frees its KV."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_server

pytestmark = pytest.mark.slow

QUEUE_BOUND = 64
FLAGS = ["--model", "dummy:tiny", "--threads", "1", "--kv-tiers", "none", "--aggregated",
         "--max-queued-requests", str(QUEUE_BOUND)]  # fmt: skip
# No machine computes 2,000 tokens of the tiny model in this long: the request must time out.
TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("admission") / "serve.log", *FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("admission_timeout") / "serve.log"
    with run_server(log, *FLAGS, "--request-timeout", str(TIMEOUT_S)) as s:
        yield s


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))  # fmt: skip


def test_past_the_queue_bound_requests_get_429_and_the_admitted_ones_complete(server):
    before = _rss_mb(server.process.pid)
    body = {"model": server.model, "prompt": "count " * 40, "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=600)
        async with httpx.AsyncClient(headers=server.headers, timeout=300, limits=limits) as c:
            return await asyncio.gather(
                *(c.post(f"{server.v1}/completions", json=body) for _ in range(500))
            )

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, {c: codes.count(c) for c in set(codes)}
    assert codes.count(200) >= QUEUE_BOUND
    busy = [r for r in replies if r.status_code == 429]
    assert busy, "500 requests at once never met the bound of 64"
    assert all(int(r.headers["retry-after"]) >= 1 for r in busy)
    assert busy[0].json()["error"]["code"] == "server_busy"
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies if r.is_success)
    assert _rss_mb(server.process.pid) - before < 300  # the frontend held only the admitted
    assert _metric(server, 'ferry_requests_rejected_total{reason="queue_full"}') == len(busy)
    assert _metric(server, "ferry_queued_requests") == 0


def test_a_request_past_the_timeout_ends_with_a_clear_error_and_frees_its_kv(strict_server):
    server = strict_server
    body = {"model": server.model, "prompt": "go " * 10, "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    started = time.monotonic()
    reply = httpx.post(f"{server.v1}/completions", json=body, headers=server.headers,
                       timeout=60)  # fmt: skip
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while _metric(server, "ferry_kv_blocks_used") > 0:
        assert time.monotonic() < deadline, "the timed-out request kept its KV blocks"
        time.sleep(0.1)
    assert _metric(server, "ferry_request_timeouts_total") >= 1
