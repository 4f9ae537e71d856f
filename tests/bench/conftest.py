"""Fixtures for the load generator's tests: a fake streaming server and a real ``ferry serve``.

``ferry_url`` starts ``ferry serve --port 0`` (default model) once per session, reads the
address it bound from its log and waits for ``/health`` (up to 120 s); with port 0 the
control plane binds a free port too, where the public port + 1 may be taken.
The fake server runs inside the test's event loop.
"""

from __future__ import annotations

import os
import re
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

from helpers import ferry_command  # noqa: E402

from bench.common import stop_process  # noqa: E402
from bench.load.fake_server import FakeTiming, start  # noqa: E402

STARTUP_TIMEOUT_S = 120.0
_SERVING = re.compile(r"^ferry: serving \S+ on (http://\S+)$", re.MULTILINE)


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


def _wait_healthy(proc: subprocess.Popen, log: Path) -> str:
    """The base URL ``ferry serve`` announced, once its ``/health`` says 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ferry serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        serving = _SERVING.search(log.read_text(errors="replace"))
        try:
            url = serving.group(1) if serving else None
            if url and httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"ferry serve not healthy after {STARTUP_TIMEOUT_S:.0f} s")


@pytest.fixture(scope="session")
def ferry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no ``/v1``) of a ``ferry serve`` subprocess with the default model."""
    log = tmp_path_factory.mktemp("ferry") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*ferry_command(), "serve", "--port", "0"], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        yield _wait_healthy(proc, log)
    finally:
        stop_process(proc)
