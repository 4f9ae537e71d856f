"""Client timing and error kinds, and the runner's loops, against the fake SSE server."""

from __future__ import annotations

import time

import httpx
import pytest

from bench.load.client import stream_chat
from bench.load.fake_server import FakeTiming
from bench.load.runner import LoadConfig, arrival_offsets, run_load_async
from bench.load.workloads import WorkloadSpec, build_sessions


def _body(text: str = "hello there", max_tokens: int = 5) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True}  # fmt: skip


async def _send(url: str, body: dict, timeout: float = 10.0):
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        return await stream_chat(client, f"{url}/chat/completions", body, time.perf_counter())


@pytest.mark.parametrize("fake_timing", [FakeTiming(ttft_ms=60, itl_ms=25)])
async def test_ttft_and_every_inter_token_gap_are_timed(fake_url):
    r = await _send(fake_url, _body(max_tokens=5))
    assert r.ok, r.error_detail
    assert 0.060 <= r.ttft_s < 0.5
    assert len(r.itl_s) == 4 and all(0.025 <= g < 0.5 for g in r.itl_s)
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (5, 2, 1)
    assert r.text == " w0 w1 w2 w3 w4"


@pytest.mark.parametrize(
    ("text", "kind"), [("FAIL500", "http_500"), ("BADJSON", "stream"), ("DROP", "connection")]
)
async def test_failures_are_recorded_by_kind(fake_url, text, kind):
    r = await _send(fake_url, _body(text))
    assert r.error == kind and not r.ok


async def test_refused_connection_and_timeout_are_recorded():
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = await _send(f"http://127.0.0.1:{port}/v1", _body())
    assert r.error == "connection"


@pytest.mark.parametrize("fake_timing", [FakeTiming(ttft_ms=2000)])
async def test_slow_first_token_times_out(fake_url):
    r = await _send(fake_url, _body(), timeout=0.2)
    assert r.error == "timeout"


async def test_multiturn_carries_the_conversation(fake_url):
    spec = WorkloadSpec("multiturn", num_requests=3, input_len=10, output_len=4, turns=3,
                        think_time_s=0.01)  # fmt: skip
    cfg = LoadConfig(chat_url=f"{fake_url}/chat/completions", model="m", concurrency=1,
                     progress=False)  # fmt: skip
    run = await run_load_async(build_sessions(spec), cfg)
    # the fake counts prompt words: each turn adds the 4-word answer and 10 new words
    assert [r.prompt_tokens for r in run.results] == [10, 24, 38]


async def test_closed_loop_runs_every_request_on_several_clients(fake_url):
    spec = WorkloadSpec("random", num_requests=24, input_len=8, output_len=3)
    cfg = LoadConfig(chat_url=f"{fake_url}/chat/completions", model="m", concurrency=6,
                     streams_per_client=4, progress=False)  # fmt: skip
    run = await run_load_async(build_sessions(spec), cfg)
    assert len(run.results) == 24 and all(r.ok for r in run.results)
    assert run.duration_s > 0


async def test_open_loop_follows_seeded_poisson_arrivals(fake_url):
    offsets = arrival_offsets(200, rate=50.0, seed=1)
    assert offsets == arrival_offsets(200, rate=50.0, seed=1)
    assert offsets[-1] / 199 == pytest.approx(1 / 50, rel=0.25)
    spec = WorkloadSpec("random", num_requests=10, input_len=8, output_len=2)
    cfg = LoadConfig(chat_url=f"{fake_url}/chat/completions", model="m", rate=200.0,
                     progress=False)  # fmt: skip
    run = await run_load_async(build_sessions(spec), cfg)
    starts = sorted(r.start_s for r in run.results)
    assert all(r.ok for r in run.results)
    assert starts[-1] >= arrival_offsets(10, 200.0, 0)[-1] - 0.005


@pytest.mark.parametrize("fake_timing", [FakeTiming(ttft_ms=40, itl_ms=20)])
async def test_responses_endpoint_is_timed_from_its_text_deltas(fake_url):
    spec = WorkloadSpec("multiturn", num_requests=2, input_len=6, output_len=4, turns=2,
                        think_time_s=0.0)  # fmt: skip
    cfg = LoadConfig(chat_url=f"{fake_url}/chat/completions", model="m", concurrency=1,
                     endpoint="responses", progress=False)  # fmt: skip
    assert cfg.url == f"{fake_url}/responses"
    run = await run_load_async(build_sessions(spec), cfg)
    assert all(r.ok for r in run.results), [r.error_detail for r in run.results]
    first = run.results[0]
    assert first.ttft_s >= 0.040 and len(first.itl_s) == 3 and min(first.itl_s) >= 0.020
    assert (first.output_tokens, first.prompt_tokens, first.cached_tokens) == (4, 6, 3)
    assert first.text == " w0 w1 w2 w3"
    assert run.results[1].prompt_tokens == 6 + 4 + 6  # the answer went back as input
    with pytest.raises(ValueError, match="endpoint"):
        LoadConfig(chat_url="http://x/v1/chat/completions", model="m", concurrency=1,
                   endpoint="embeddings")  # fmt: skip
