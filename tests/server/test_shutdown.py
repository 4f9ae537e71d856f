"""Ctrl-C in a terminal (SIGINT to the whole process group) and SIGTERM, to the frontend or
to the whole group (systemd's KillMode=control-group, ``timeout``), stop the whole
topology cleanly: readiness turns 503 at once, a stream in flight finishes or ends with a
clean error within the drain timeout, every process exits with one line and no
traceback, and no worker is taken for dead or restarted meanwhile. Ctrl-C again while it
drains ends the requests in flight at once, as cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import API_KEY, CLUSTER_SECRET, ROOT, _wait_ready
from helpers import ferry_command

pytestmark = pytest.mark.slow

DRAIN_S = 3


def start(tmp_path, drain_s: float) -> tuple[subprocess.Popen, str, object]:
    """``ferry serve`` of the tiny model in its own process group, ready; its log path."""
    log_path = tmp_path / "serve.log"
    command = [*ferry_command(), "serve", "--port", "0", "--api-key", API_KEY, "--model",
               "dummy:tiny", "--threads", "1", "--kv-tiers", "none", "--drain-timeout",
               str(drain_s)]  # fmt: skip
    env = {**os.environ, "FERRY_CLUSTER_SECRET": CLUSTER_SECRET}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env, start_new_session=True)  # its own process group
    _, base_url, _ = _wait_ready(proc, log_path)
    return proc, base_url, log_path


def stream_in_background(base_url: str, lines: list[str], tokens: int = 1000) -> threading.Thread:
    """A long stream read on a thread into ``lines``, under way when this returns."""

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                          headers=headers, timeout=60) as response:  # fmt: skip
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(1.0)  # the stream is under way
    return reader


def assert_ended_cleanly(log: str, lines: list[str]) -> None:
    assert "Traceback" not in log, log
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    if "error" in last:
        assert "shutting down" in last["error"]["message"]
    assert "ferry: shutting down" in log
    assert log.count("worker") >= 2 and "stopped" in log
    # the workers leave the signal to the frontend, which stops them: none died of it
    assert "exited with code" not in log and "restarting" not in log, log


@pytest.mark.parametrize("sig, group", [
    (signal.SIGINT, True),  # what a terminal's Ctrl-C does
    (signal.SIGTERM, False),  # kill, a container runtime
    (signal.SIGTERM, True),  # systemd's KillMode=control-group, timeout
], ids=["ctrl-c", "sigterm", "sigterm-to-the-group"])  # fmt: skip
def test_a_signal_stops_the_topology_cleanly(tmp_path, sig, group):
    proc, base_url, log_path = start(tmp_path, DRAIN_S)
    try:
        lines: list[str] = []
        reader = stream_in_background(base_url, lines)
        started = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=DRAIN_S + 30) == 0
        took = time.monotonic() - started
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < DRAIN_S + 20
    assert_ended_cleanly(log_path.read_text(errors="replace"), lines)


def test_ctrl_c_again_while_draining_ends_the_requests_in_flight_now_and_cleanly(tmp_path):
    long_drain = 120
    proc, base_url, log_path = start(tmp_path, long_drain)
    try:
        lines: list[str] = []
        reader = stream_in_background(base_url, lines, tokens=2000)  # most of the context
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while "shutting down" not in log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C again
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - started
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert took < 20 < long_drain
    assert "stopping now" in log
    assert_ended_cleanly(log, lines)
    assert "error" in json.loads(lines[-2][6:])  # ended, not finished
