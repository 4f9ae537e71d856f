"""Workers started on their own (``ferry worker``) joining frontends: over HTTP, and
through Redis, where two frontends share workers and KV events and keep serving while
Redis is down."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from conftest import API_KEY, run_server, run_worker

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WORKER = ["--kv-transport", "tcp", "--threads", "1", "--kv-tiers", "none"]
FRONTEND = ["--prefill", "0", "--decode", "0", "--kv-transport", "tcp", "--kv-tiers", "none"]


def wait_health(base_url: str, status: int, timeout: float = 120.0) -> dict:
    """Wait for /ready to answer ``status``; return /health's account of the workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{base_url}/ready", timeout=5)
        if r.status_code == status:
            return httpx.get(f"{base_url}/health", headers=HEADERS, timeout=5).json()
        time.sleep(0.2)
    raise AssertionError(f"/ready never returned {status}: {r.status_code} {r.text}")


def complete(server, prompt: str) -> dict:
    r = httpx.post(f"{server.v1}/completions", headers=HEADERS, timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_worker_started_on_its_own_joins_over_http_serves_and_drains(tmp_path):
    with run_server(tmp_path / "serve.log", *FRONTEND, healthy=False) as server:
        assert httpx.get(f"{server.base_url}/ready").status_code == 503  # nobody yet
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # but it is alive
        join = ["--frontend", server.control_url, *WORKER]
        with (
            run_worker(tmp_path / "p.log", "--role", "prefill", "--name", "p-x", *join),
            run_worker(tmp_path / "d.log", "--role", "decode", "--name", "d-x", *join) as d,
        ):
            health = wait_health(server.base_url, 200)
            assert {w["name"] for w in health["workers"]} == {"p-x", "d-x"}
            out = complete(server, "The capital of France is " * 8)
            assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 4
            d.send_signal(signal.SIGTERM)  # drain: nothing in flight, so it leaves at once
            assert d.wait(30) == 0
            health = wait_health(server.base_url, 503, timeout=30)
            assert [w["healthy"] for w in health["workers"] if w["name"] == "d-x"] == [False]
            r = httpx.post(f"{server.v1}/completions", headers=HEADERS, json={
                "model": server.model, "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert r.status_code == 503 and r.json()["error"]["message"]


def test_two_frontends_on_one_redis_route_alike_and_survive_an_outage(tmp_path, redis_server):
    url = redis_server.url
    prompts = [f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 6
               for i in range(12)]  # fmt: skip
    local = ["--local-prefill-tokens", "100000"]  # D computes prompts: its cache is the hit
    with (
        run_worker(tmp_path / "p.log", "--role", "prefill", "--name", "p0", "--redis", url,
                   *WORKER),
        run_worker(tmp_path / "d0.log", "--role", "decode", "--name", "d0", "--redis", url,
                   *WORKER, *local),
        run_worker(tmp_path / "d1.log", "--role", "decode", "--name", "d1", "--redis", url,
                   *WORKER, *local),
        run_server(tmp_path / "a.log", *FRONTEND, "--redis", url, healthy=False) as a,
        run_server(tmp_path / "b.log", *FRONTEND, "--redis", url, healthy=False) as b,
    ):  # fmt: skip
        for server in (a, b):
            health = wait_health(server.base_url, 200)
            deadline = time.monotonic() + 60
            while len(health["workers"]) < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
                health = server.health()
            assert {w["name"] for w in health["workers"]} == {"p0", "d0", "d1"}
        # what A computed, B finds: it routes each prompt to the worker that holds it
        for prompt in prompts[:6]:
            first = complete(a, prompt)
            time.sleep(0.3)  # the events travel through Redis
            assert cached(complete(b, prompt)) > 0, prompt
            assert cached(first) == 0
        redis_server.stop()
        for prompt in prompts[6:]:  # both keep serving from their own index
            complete(a, prompt)
            complete(b, prompt)
        for server in (a, b):
            assert server.health()["redis"]["connected"] is False
        redis_server.start()
        for server in (a, b):
            deadline = time.monotonic() + 30
            while not server.health()["redis"]["connected"]:
                assert time.monotonic() < deadline, "did not reconnect to Redis"
                time.sleep(0.2)
        time.sleep(3)  # the workers send what they kept, the frontends read on
        for prompt in prompts[6:]:  # B now knows where A's outage-time prompts went
            assert cached(complete(b, prompt)) > 0, prompt
        fresh = "A fresh start after the outage " * 8
        complete(a, fresh)
        time.sleep(0.3)
        assert cached(complete(b, fresh)) > 0


def test_a_second_frontend_finds_the_workers_another_one_started_through_redis(
    tmp_path, redis_server
):
    shared = ["--redis", redis_server.url, "--kv-tiers", "none", "--threads", "1"]
    with run_server(tmp_path / "a.log", "--model", "dummy:tiny", *shared) as a:
        names = {w["name"] for w in a.health()["workers"]}
        assert len(names) == 2 and all("/" in n for n in names)  # unique across frontends
        with run_server(tmp_path / "b.log", "--model", "dummy:tiny", "--prefill", "0",
                        "--decode", "0", *shared, healthy=False) as b:  # fmt: skip
            health = wait_health(b.base_url, 200)
            assert {w["name"] for w in health["workers"]} == names
            assert complete(b, "hello " * 20)["usage"]["completion_tokens"] == 4


def test_frontends_and_workers_share_a_redis_behind_a_password_and_tls(
    tmp_path, secure_redis_server
):
    url = secure_redis_server.url
    assert url.startswith("rediss://:redis-test-password@")
    tiny = ["--model", "dummy:tiny", "--kv-tiers", "none", "--threads", "1", "--redis", url]
    with (
        run_worker(tmp_path / "p.log", "--role", "prefill", "--name", "sp", *tiny),
        run_worker(tmp_path / "d.log", "--role", "decode", "--name", "sd", *tiny),
        run_server(tmp_path / "a.log", "--prefill", "0", "--decode", "0", *tiny,
                   healthy=False) as a,
    ):  # fmt: skip
        health = wait_health(a.base_url, 200)
        deadline = time.monotonic() + 30
        while len(health["workers"]) < 2 or not health["redis"]["connected"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
            health = a.health()
        assert {w["name"] for w in health["workers"]} == {"sp", "sd"}
        assert complete(a, "hello " * 20)["usage"]["completion_tokens"] == 4
