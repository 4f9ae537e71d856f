"""The encode pool with more than one worker, and under faults: ``ferry serve`` with two
encode workers (plus 1 prefill + 1 decode) of ``dummy:qwen2.5-vl-tiny``, the KV file
tier below their embedding caches, and an encode worker that joins at runtime
(``ferry worker --role encode``).

- An image encoded on an encode worker that then dies (SIGKILL) is not encoded again:
  the next request for it is served from the file tier, and the dead worker comes back.
- An encode worker killed while a burst of image chats is in flight loses no request:
  every one ends complete, and once the pool is back the same chats (their embeddings
  now from the caches) answer with the same tokens.

Which encode worker encoded an image is read from the server's log (each worker's
``ended (Encoded)`` line names the HTTP request's ``x-request-id``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import time

import httpx
import pytest
from conftest import run_server, run_worker

from bench.load.workloads import random_png

MODEL = ["--model", "dummy:qwen2.5-vl-tiny", "--threads", "1"]
FLAGS = [*MODEL, "--encode", "2", "--local-prefill-tokens", "0", "--max-model-len", "1024"]
BOUND_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("encode-pool") / "serve.log"
    with run_server(log, *FLAGS) as s:
        yield s


def _body(server, seed: str, words: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(random_png(120, 90, seed)).decode()
    content = [{"type": "text", "text": words}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip


def _chat(server, seed: str, words: str) -> tuple[str, str]:
    """The answer to one image chat and the request's id."""
    r = httpx.post(f"{server.v1}/chat/completions", json=_body(server, seed, words),
                   headers=server.headers, timeout=BOUND_S)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers["x-request-id"]


def _encoder_of(server, request_id: str) -> str:
    """The encode worker whose log says it encoded the request's image."""
    pattern = rf"INFO (\S+) ferry\.worker: \[{re.escape(request_id)}\] \S+ ended \(Encoded\)"
    deadline = time.monotonic() + 10
    while not (found := re.findall(pattern, server.log_tail(10**7))):
        assert time.monotonic() < deadline, f"no encode worker logged {request_id}"
        time.sleep(0.2)
    return found[-1]


def _counter(server, name: str, **labels: str) -> float:
    """One series of /metrics; 0 while it has not appeared."""
    body = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(re.escape(name + (f"{{{sel}}}" if sel else "")) + r" ([0-9.e+]+)", body)
    return float(match.group(1)) if match else 0.0


def _workers(server, role: str) -> list[dict]:
    workers = server.health()["workers"]
    return [w for w in workers if w["role"] == role]


def _kill(server, name: str) -> int:
    pid = next(w["pid"] for w in _workers(server, "encode") if w["name"] == name)
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_encoders(server, count: int, gone: int) -> None:
    """Until ``count`` healthy encode workers are listed, none of them process ``gone``."""
    deadline = time.monotonic() + BOUND_S
    while True:
        live = [w for w in _workers(server, "encode") if w["healthy"]]
        if len(live) == count and all(w["pid"] != gone for w in live):
            return
        assert time.monotonic() < deadline, _workers(server, "encode")
        time.sleep(0.5)


def test_an_image_encoded_by_a_worker_that_died_is_read_from_the_file_tier(server):
    encoded = _counter(server, "ferry_encode_images_total", cache="none")
    from_files = _counter(server, "ferry_encode_cache_hits_total", tier="file")
    first, rid = _chat(server, "kept", "Look at this one.")
    assert _counter(server, "ferry_encode_images_total", cache="none") == encoded + 1
    pid = _kill(server, _encoder_of(server, rid))
    # other words first: no prompt prefix to reuse, the image's embeddings are needed
    again, _ = _chat(server, "kept", "And now, once more, this one.")
    assert again
    assert _counter(server, "ferry_encode_images_total", cache="none") == encoded + 1
    assert _counter(server, "ferry_encode_cache_hits_total", tier="file") == from_files + 1
    _wait_encoders(server, 2, pid)  # the dead one was started again
    assert _counter(server, "ferry_worker_restarts_total", role="encode") >= 1
    assert first


async def _burst(server, seeds: list[str]) -> list[tuple[int, str]]:
    async with httpx.AsyncClient(headers=server.headers, timeout=BOUND_S) as client:
        async def one(seed: str) -> tuple[int, str]:
            r = await client.post(f"{server.v1}/chat/completions",
                                  json=_body(server, seed, f"Picture {seed}."))  # fmt: skip
            return r.status_code, r.text if r.status_code != 200 else (
                r.json()["choices"][0]["message"]["content"])  # fmt: skip

        return await asyncio.gather(*(one(s) for s in seeds))


def test_an_encode_worker_killed_under_a_burst_of_image_chats_loses_no_request(server):
    seeds = [f"burst-{i}" for i in range(8)]
    victim = _workers(server, "encode")[0]

    async def run() -> list[tuple[int, str]]:
        burst = asyncio.create_task(_burst(server, seeds))
        await asyncio.sleep(0.3)  # the images are on their way to the encode workers
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.wait_for(burst, BOUND_S)

    started = time.monotonic()
    got = asyncio.run(run())
    assert time.monotonic() - started < BOUND_S
    assert all(status == 200 for status, _ in got), got
    _wait_encoders(server, 2, victim["pid"])
    again = asyncio.run(_burst(server, seeds))  # embeddings from the caches now
    assert again == got
    assert httpx.get(f"{server.base_url}/ready", timeout=30).status_code == 200


def test_an_encode_worker_joins_at_runtime_and_takes_images(server, tmp_path):
    join = ["--frontend", server.control_url, *MODEL]
    log = tmp_path / "e.log"
    with run_worker(log, "--role", "encode", "--name", "e-x", *join):
        deadline = time.monotonic() + BOUND_S
        while not any(w["name"] == "e-x" and w["healthy"] for w in _workers(server, "encode")):
            assert time.monotonic() < deadline, _workers(server, "encode")
            time.sleep(0.5)
        spawned = [w for w in _workers(server, "encode") if w["name"] != "e-x"]
        for w in spawned:  # hung: out of rotation once silent, then restarted
            os.kill(w["pid"], signal.SIGSTOP)
        try:
            while any(w["healthy"] for w in _workers(server, "encode") if w["name"] != "e-x"):
                assert time.monotonic() < deadline, _workers(server, "encode")
                time.sleep(0.5)
            text, rid = _chat(server, "for-the-new-one", "Seen by the newcomer.")
            assert text
            assert re.search(rf"\[{re.escape(rid)}\] \S+ ended \(Encoded\)", log.read_text())
        finally:
            for w in spawned:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w["pid"], signal.SIGCONT)
