"""The control plane is closed: a client of the public port cannot register a worker or
reach a worker's channel, with or without ``--api-key``; a worker or a frontend that does
not prove the cluster secret is refused; a refused or dead worker changes nothing the
frontend serves."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
import zmq
from conftest import API_KEY, CLUSTER_SECRET, run_server, run_worker

from engine.messages import ENGINE, Shutdown
from engine.worker.channel import CHALLENGE, HELLO, PROOF
from kvstore import auth

pytestmark = pytest.mark.slow

TINY = ["--model", "dummy:tiny", "--threads", "1", "--kv-tiers", "none", "--kv-transport", "tcp"]
ANNOUNCE = {"name": "intruder", "role": "decode", "address": "tcp://127.0.0.1:9"}


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    log = tmp_path_factory.mktemp("control") / "serve.log"
    with run_server(log, *TINY) as server:
        yield server


def _workers(server) -> dict[str, dict]:
    return {w["name"]: w for w in server.health()["workers"]}


def _context(server) -> int:
    return httpx.get(f"{server.v1}/models", headers=server.headers).json()["data"][0][
        "max_model_len"
    ]


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {API_KEY}"}])
def test_a_client_of_the_public_port_cannot_register_a_worker(frontend, headers):
    public = httpx.post(f"{frontend.base_url}/internal/workers", json=ANNOUNCE, headers=headers)
    assert public.status_code in (401, 404)  # no such route there (401 first with a key)
    control = httpx.post(f"{frontend.control_url}/internal/workers", json=ANNOUNCE,
                         headers=headers)  # fmt: skip
    assert control.status_code == 401 and "cluster secret" in control.json()["error"]["message"]
    assert "intruder" not in _workers(frontend)
    schema = httpx.get(f"{frontend.base_url}/openapi.json").json()
    assert not [p for p in schema["paths"] if p.startswith("/internal")]


def test_a_worker_without_the_secret_is_refused_even_when_its_address_is_announced(
    frontend, tmp_path
):
    before = _context(frontend)
    flags = ["--role", "decode", "--name", "stranger", "--max-model-len", "64", *TINY]
    with run_worker(tmp_path / "w.log", *flags, env={"FERRY_CLUSTER_SECRET": "not ours"}) as w:
        log = (tmp_path / "w.log").read_text()
        address = re.search(r"listening on (\S+)", log).group(1)
        token = auth.bearer_token(CLUSTER_SECRET)  # a replayed announcement, say
        accepted = httpx.post(f"{frontend.control_url}/internal/workers", headers={
            "Authorization": f"Bearer {token}"}, json={**ANNOUNCE, "name": "stranger",
                                                       "address": address})  # fmt: skip
        assert accepted.status_code == 202  # the announcement is fine; the worker is not
        time.sleep(3)
        assert "stranger" not in _workers(frontend) or not _workers(frontend)["stranger"][
            "healthy"
        ]
        assert _context(frontend) == before  # its 64-token context changed nothing
        assert w.poll() is None  # the frontend's attempt did not hurt it either


def test_a_peer_without_the_secret_reaches_nothing_on_a_worker_channel(tmp_path):
    flags = ["--role", "prefill", "--name", "target", *TINY]
    with run_worker(tmp_path / "w.log", *flags) as worker:
        address = re.search(r"listening on (\S+)", (tmp_path / "w.log").read_text()).group(1)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(ENGINE.encode(Shutdown()))  # a bare Shutdown, no handshake
        sock.send(HELLO + auth.nonce())
        assert sock.poll(30_000), "the worker never answered the hello"
        assert sock.recv()[:1] == CHALLENGE
        sock.send(PROOF + b"\0" * auth.PROOF_BYTES)  # a wrong proof
        sock.send(ENGINE.encode(Shutdown()))
        assert not sock.poll(3000), "a peer without the secret was sent something"
        assert worker.poll() is None, "the worker obeyed a peer without the secret"
        sock.close()
        ctx.term()


def test_a_dead_worker_leaves_the_context_length_as_the_live_ones_make_it(frontend, tmp_path):
    before = _context(frontend)
    flags = ["--role", "decode", "--name", "short", "--max-model-len", "64",
             "--frontend", frontend.control_url, *TINY]  # fmt: skip
    with run_worker(tmp_path / "w.log", *flags) as worker:
        deadline = time.monotonic() + 60
        while not _workers(frontend).get("short", {}).get("healthy"):
            assert time.monotonic() < deadline, "the worker never joined"
            time.sleep(0.2)
        assert _context(frontend) == 64  # a live worker with less room lowers it
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _context(frontend) != before:
            assert time.monotonic() < deadline, "the dead worker still caps the context"
            time.sleep(0.2)
