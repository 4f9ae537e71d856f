"""Clients that go away mid-request: every engine request is aborted and its KV blocks freed.

The server runs with ``FERRY_DEBUG_INTEGRITY=1``: the engine checks its block bookkeeping
each time it goes idle and dies on a mismatch, so ``/ready`` staying 200 with no worker
restarted at the end means every check passed. ``ferry_kv_blocks_used`` counts blocks
referenced by requests; cached-but-unreferenced prefix blocks count as free, so it must
return to 0.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from conftest import assert_sound

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a long story about a lighthouse keeper.",
    "List every prime number you know.",
    "Explain how a bicycle works, step by step.",
]


def scrape(server) -> dict[str, float]:
    """Unlabelled samples of ``/metrics`` by name."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def count_status(server, status: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ferry_requests_total{") and f'status="{status}"' in line
    )


async def wait_until_idle(server, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        busy = samples["ferry_num_requests_running"] + samples["ferry_num_requests_waiting"]
        if (busy == 0 and samples["ferry_kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.2)


def assert_engine_clean(server, samples: dict[str, float]) -> None:
    assert samples["ferry_num_requests_running"] == 0
    assert samples["ferry_num_requests_waiting"] == 0
    assert samples["ferry_kv_blocks_used"] == 0
    assert samples["ferry_kv_blocks_total"] > 0
    assert_sound(server)


def _body(i: int, rng: random.Random) -> dict:
    return {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": 32,
        "temperature": 1.0,
        "seed": i,
        "n": rng.choice([1, 1, 1, 2]),
        "stream": True,
        "ignore_eos": True,
    }


async def test_cancelling_50_streams_at_random_points_frees_every_block(server):
    rng = random.Random(20261130)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.headers, timeout=120, limits=limits
    ) as http:

        async def one(i: int, leave_after: int) -> int:
            seen = 0
            async with http.stream("POST", "/v1/chat/completions", json=_body(i, rng)) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen > leave_after:
                        break  # leaving the block closes the connection mid-stream
            return seen

        leave = [rng.randint(0, 6) for _ in range(50)]
        seen = await asyncio.gather(*(one(i, k) for i, k in enumerate(leave)))
    assert all(s > k for s, k in zip(seen, leave, strict=True))
    assert_engine_clean(server, await wait_until_idle(server))


async def test_leaving_an_n3_stream_aborts_all_siblings(server):
    body = {**_body(0, random.Random(1)), "n": 3, "max_tokens": 400}
    http = httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120)
    async with http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # first generated text: all three are running
    started = time.monotonic()
    samples = await wait_until_idle(server, timeout=30)
    assert_engine_clean(server, samples)
    assert time.monotonic() - started < 30  # 3 x 400 tokens would take far longer here


async def test_non_streaming_client_that_times_out_is_aborted(server):
    before = count_status(server, "499")
    body = {
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0,
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=2.0)
    assert_engine_clean(server, await wait_until_idle(server, timeout=30))
    deadline = time.monotonic() + 10
    while count_status(server, "499") == before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert count_status(server, "499") == before + 1
