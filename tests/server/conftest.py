"""A real ``ferry serve`` for the end-to-end tests: one process per session.

The server runs the default model (SmolLM2-135M GGUF) on a free loopback port with an
API key (every test sends it; the auth tests leave it out) and with
``FERRY_DEBUG_INTEGRITY=1``, so the engine checks its KV block bookkeeping whenever it
goes idle and dies loudly on a mismatch; tests that stress it finish by asserting
``/ready`` is still 200 (``assert_sound``).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ferry_command

from bench.common import stop_process

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-ferry"
CLUSTER_SECRET = "test-cluster-secret-ferry"  # every test frontend and worker shares it
START_TIMEOUT_S = 180.0
_READY = re.compile(r"^ferry: serving (\S+) on (http://\S+)\nferry: control plane on "
                    r"(http://\S+)$", re.MULTILINE)  # fmt: skip


@dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT
    control_url: str  # where workers announce themselves (ferry worker --frontend)
    model: str
    api_key: str
    log_path: Path
    process: subprocess.Popen

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def openai(self) -> Any:
        """The official client for this server (no retries: a failure shows at once)."""
        import openai

        return openai.OpenAI(base_url=self.v1, api_key=self.api_key, timeout=120, max_retries=0)

    def health(self) -> dict:
        """``/health`` as a caller with the API key reads it: every worker, its state."""
        return httpx.get(f"{self.base_url}/health", headers=self.headers, timeout=30).json()

    def http(self) -> httpx.Client:
        """An HTTP client on ``/v1`` with the API key; close it (``with``) when done."""
        return httpx.Client(base_url=self.v1, headers=self.headers, timeout=120)

    def engine_pids(self) -> list[int]:
        """The engine processes ``ferry serve`` started (its children)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def _wait_ready(proc: subprocess.Popen, log_path: Path) -> tuple[str, str, str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = _READY.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1), match.group(2), match.group(3)
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    proc.kill()
    tail = log_path.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"ferry serve did not become ready (exit {proc.poll()}):\n{tail}")


def _wait_healthy(base_url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError("ferry serve announced itself but /ready never returned 200")


def assert_sound(server: Server) -> None:
    """The server is ready and no worker of it died and was restarted (with
    ``FERRY_DEBUG_INTEGRITY`` a worker dies on a bookkeeping mismatch)."""
    ready = httpx.get(f"{server.base_url}/ready", timeout=30)
    assert ready.status_code == 200, server.log_tail()
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    restarts = [line for line in metrics.splitlines()
                if line.startswith("ferry_worker_restarts_total")]  # fmt: skip
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in restarts), restarts


@contextlib.contextmanager
def _process(
    command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Run ``command`` (output to ``log_path``, ``env`` over the test's environment and the
    shared cluster secret) until the block exits, then stop it."""
    env = {**os.environ, "FERRY_DEBUG_INTEGRITY": "1", "FERRY_CLUSTER_SECRET": CLUSTER_SECRET,
           **(env or {})}  # fmt: skip
    env.pop("FERRY_API_KEY", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def run_server(
    log_path: Path, *flags: str, healthy: bool = True, prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Server]:  # fmt: skip
    """``ferry serve --port 0 --api-key ... <flags>`` until the block exits; ``healthy``:
    wait for /ready to say 200 (not with workers still to join); ``prefix``: a command
    that runs it (such as ``setpriv ...``); ``env``: more environment."""
    command = [*prefix, *ferry_command(), "serve", "--port", "0", "--api-key", API_KEY, *flags]
    with _process(command, log_path, env) as proc:
        model, base_url, control_url = _wait_ready(proc, log_path)
        if healthy:
            _wait_healthy(base_url)
        yield Server(base_url, control_url, model, API_KEY, log_path, proc)


_WORKER_READY = re.compile(r"^ferry: (\w+) worker (\S+) listening on (\S+)$", re.MULTILINE)


@contextlib.contextmanager
def run_worker(
    log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """``ferry worker <flags>`` until the block exits (SIGTERM: it drains)."""
    command = [*ferry_command(), "worker", *flags]
    with _process(command, log_path, env) as proc:
        deadline = time.monotonic() + 30
        while not _WORKER_READY.search(log_path.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ferry worker did not start:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield proc


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model. One torch thread: the test client and the HTTP server need the
    other core, and OpenMP threads that spin on a busy 2-core machine cost 4x."""
    with run_server(tmp_path_factory.mktemp("ferry-serve") / "serve.log", "--threads", "1") as s:
        yield s


@pytest.fixture(scope="module")
def api_server(server: Server) -> Server:
    """The server ``client`` and ``http`` talk to; a module that starts its own overrides
    this fixture."""
    return server


@pytest.fixture(scope="module")
def client(api_server: Server) -> Any:
    """The official ``openai`` client on ``api_server``."""
    return api_server.openai()


@pytest.fixture(scope="module")
def http(api_server: Server) -> Iterator[httpx.Client]:
    """An HTTP client on ``api_server``'s ``/v1``, with the API key."""
    with api_server.http() as c:
        yield c


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own, with the random-weight ``dummy:tiny`` model, for tests that
    kill its engine."""
    log_path = tmp_path_factory.mktemp("ferry-doomed") / "serve.log"
    with run_server(log_path, "--model", "dummy:tiny", "--threads", "1") as s:
        yield s


@pytest.fixture(scope="session")
def serve() -> Callable[..., contextlib.AbstractContextManager[Server]]:
    """``run_server`` itself, for tests and fixtures that start (and restart) servers of
    their own."""
    return run_server
