"""Ctrl-C in a terminal (SIGINT to the whole process group) and SIGTERM stop the whole
topology cleanly: readiness turns 503 at once, a stream in flight finishes or ends with a
clean error within the drain timeout, every process exits with one line and no
traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import API_KEY, CLUSTER_SECRET, ROOT, _ferry_command, _wait_ready

pytestmark = pytest.mark.slow

DRAIN_S = 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_topology_cleanly(tmp_path, sig):
    log_path = tmp_path / "serve.log"
    command = [*_ferry_command(), "serve", "--port", "0", "--api-key", API_KEY, "--model",
               "dummy:tiny", "--threads", "1", "--kv-tiers", "none", "--drain-timeout",
               str(DRAIN_S)]  # fmt: skip
    env = {**os.environ, "FERRY_CLUSTER_SECRET": CLUSTER_SECRET}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env, start_new_session=True)  # its own process group
    try:
        _, base_url, _ = _wait_ready(proc, log_path)
        lines: list[str] = []

        def stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 100000 // 100, "ignore_eos": True,
                    "stream": True, "temperature": 0}  # fmt: skip
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                              headers=headers, timeout=60) as response:  # fmt: skip
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.0)  # the stream is under way
        started = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DRAIN_S + 30) == 0
        took = time.monotonic() - started
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log, log
    assert took < DRAIN_S + 20
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    if "error" in last:
        assert "shutting down" in last["error"]["message"]
    assert "ferry: shutting down" in log
    assert log.count("worker") >= 2 and "stopped" in log
