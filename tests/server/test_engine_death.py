"""When the engine processes die: streams end with an error event, readiness and requests
are 503 while the frontend restarts them, and then it serves again.

Uses its own server (``doomed_server``: the random-weight ``dummy:tiny`` model, quick
to load), since the test kills that server's engine.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_dead_workers_end_their_streams_with_an_error_and_are_restarted(doomed_server):
    server = doomed_server
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    for pid in server.engine_pids():
                        os.kill(pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "engine" in error["message"]

        deadline = time.monotonic() + 10
        while http.get("/ready").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.get("/ready").status_code == 503
        assert http.get("/health").status_code == 200  # the frontend itself lives on
        after = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert after.status_code == 503
        assert after.json()["error"]["code"] == "engine_unavailable"

        deadline = time.monotonic() + 120
        while http.get("/ready").status_code != 200:  # restarted, after a back-off
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        again = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
        restarts = [line for line in http.get("/metrics").text.splitlines()
                    if line.startswith("ferry_worker_restarts_total")]  # fmt: skip
        assert sum(float(line.rsplit(" ", 1)[1]) for line in restarts) == 2
        assert "restarting" in server.log_tail(20000)
