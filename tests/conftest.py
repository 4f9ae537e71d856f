"""Shared fixtures: the default model and its tokenizer, loaded once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.loader import LoadedModel, default_model_path, load_model, load_tokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's torch work on one thread (restored after), unless OpenMP threads
    sleep when idle (``OMP_WAIT_POLICY=PASSIVE``).

    On a small machine shared with other processes, spinning OpenMP threads make torch
    several times slower with two threads than with one."""
    previous = torch.get_num_threads()
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _own_kv_dir(request: pytest.FixtureRequest, factory: pytest.TempPathFactory):
    """Point ``FERRY_KV_DIR`` (the default of ``ferry serve --kv-dir``) at a fresh
    directory while the fixture's scope lasts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_KV_DIR", str(factory.mktemp(f"kv-{request.scope}")))
        yield


# A server started in a test, a module fixture or a session fixture gets a KV file tier of
# its own (autouse fixtures run first in their scope): no test sees blocks that another
# test's server wrote, and nothing lands in the user's cache directory.
@pytest.fixture(scope="session", autouse=True)
def _session_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _module_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


@pytest.fixture(autouse=True)
def _test_kv_dir(request, tmp_path_factory):
    yield from _own_kv_dir(request, tmp_path_factory)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(default_gguf_path: Path) -> LoadedModel:
    """SmolLM2-135M-Instruct from the default GGUF, CPU float32."""
    return load_model("default", device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_moe_dir(kind)``: the folder of a tiny random checkpoint written by transformers
    (``hf_models.CONFIGS``), made once per session."""
    from hf_models import write_tiny_model

    made: dict[str, Path] = {}

    def folder(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return made[kind]

    return folder


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_gguf_path: Path) -> Tokenizer:
    return load_tokenizer("default")


class RedisServer:
    """A real ``redis-server`` on a free loopback port, without persistence; ``stop`` and
    ``start`` again (same port, empty) play an outage. ``password``: it requires one;
    ``tls``: it speaks only TLS, with a self-signed certificate made here (the URL names
    it as the CA to trust)."""

    def __init__(self, workdir: Path, password: str | None = None, tls: bool = False) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = workdir
        self.proc = None
        self.args = ["--requirepass", password] if password else []
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        if tls:
            cert, key = self._certificate()
            self.args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                          "--tls-key-file", key, "--tls-ca-cert-file", cert,
                          "--tls-auth-clients", "no"]  # fmt: skip
            self.url = f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={cert}"

    def _certificate(self) -> tuple[str, str]:
        import subprocess

        cert, key = str(self.workdir / "redis.crt"), str(self.workdir / "redis.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)  # fmt: skip
        return cert, key

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    """A running ``redis-server`` (installed by ``setup.sh --test``)."""
    yield from _redis(RedisServer(tmp_path))


@pytest.fixture
def secure_redis_server(tmp_path):
    """A running ``redis-server`` that wants a password and speaks TLS."""
    yield from _redis(RedisServer(tmp_path, password="redis-test-password", tls=True))


def _redis(server: RedisServer):
    import shutil

    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed: setup.sh --test installs it")
        pytest.skip("redis-server is not installed (setup.sh --test installs it)")
    server.start()
    yield server
    server.stop()
