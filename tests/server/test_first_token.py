"""The first token of a disaggregated request reaches the client from the prefill worker:
the decode worker is stopped (SIGSTOP) once it has reserved the request's blocks, so it
can run no step at all, and the first content chunk still arrives. The server is its own,
with a worker silence timeout longer than the stop: a stopped worker sends no heartbeat,
and with the default 5 s it would be killed as hung while the prompt is computed."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest
from conftest import assert_sound

_TRANSFERRING = re.compile(r'^ferry_worker_requests_transferring\{role="decode",[^}]*\} (\S+)$',
                           re.MULTILINE)  # fmt: skip


def _decode_pid(server) -> int:
    health = server.health()
    (pid,) = [w["pid"] for w in health["workers"] if w["role"] == "decode"]
    return pid


def _decode_transferring(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(v) for v in _TRANSFERRING.findall(text))


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("ferry-first-token") / "serve.log"
    with serve(log_path, "--threads", "1", "--worker-silence-timeout", "600") as s:
        yield s


def test_first_content_chunk_arrives_before_the_decode_worker_runs_a_step(server):
    pid = _decode_pid(server)
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(150))  # never cached
    body = {"model": server.model, "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Repeat: {words}"}]}  # fmt: skip
    first = threading.Event()
    chunks: list[dict] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.v1}/chat/completions", json=body,
                          headers=server.headers, timeout=120) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    chunks.append(chunk)
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while _decode_transferring(server) < 1:  # its blocks are reserved; KVWanted is out
        assert time.monotonic() < deadline, "the decode worker never reserved the blocks"
        assert not first.is_set(), "the prompt was computed before the test could stop D"
        time.sleep(0.005)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert first.wait(180), "no content reached the client while the decode worker slept"
    finally:
        os.kill(pid, signal.SIGCONT)
    reader.join(60)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert_sound(server)
