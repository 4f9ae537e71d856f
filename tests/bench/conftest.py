"""Fixtures for the load generator's tests: a fake streaming server and a real ``ferry serve``.

``ferry_url`` starts ``ferry serve`` (default model) once per session on a free port and
waits for ``/health`` (up to 120 s). The fake server runs inside the test's event loop.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # until `bench` is installed with the project
    sys.path.insert(0, str(ROOT))

from bench.common import stop_process  # noqa: E402
from bench.load.fake_server import FakeTiming, start  # noqa: E402

STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_timing() -> FakeTiming:
    """Override in a test module (or parametrize) to change the fake server's pace."""
    return FakeTiming(ttft_ms=0.0, itl_ms=0.0)


@pytest.fixture
async def fake_url(fake_timing: FakeTiming) -> AsyncIterator[str]:
    """Base URL (``.../v1``) of a fake OpenAI streaming server in this event loop."""
    server = await start("127.0.0.1", 0, fake_timing)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1"
        server.close()


def _ferry_command(port: int) -> list[str]:
    exe = Path(sys.executable).with_name("ferry")
    if exe.exists():
        return [str(exe), "serve", "--port", str(port)]
    return [sys.executable, "-m", "server.cli", "serve", "--port", str(port)]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ferry serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"ferry serve not healthy after {STARTUP_TIMEOUT_S:.0f} s")


@pytest.fixture(scope="session")
def ferry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no ``/v1``) of a ``ferry serve`` subprocess with the default model."""
    port = _free_port()
    log = tmp_path_factory.mktemp("ferry") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _ferry_command(port), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        stop_process(proc)
