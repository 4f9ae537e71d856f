"""A worker's end of its channel to any number of frontends.

A ROUTER socket the worker binds; each frontend connects a DEALER under its own identity
and opens with the cluster-secret handshake (``HANDSHAKE``, ``kvstore.auth``), after
which it gets the worker's ready message once there is one. Only frontends that proved
the secret are heard or sent anything; other peers' messages are dropped. Replies about
a request go to the frontend that opened it (``claim``, until ``release``); stats go to
every frontend, and their KV events also to the event sink (the Redis stream) when
there is one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import zmq

from engine.messages import Codec, Heartbeat, Outputs, RequestOutput, WorkerStats
from kvstore import auth
from kvstore.events import KVEvent

log = logging.getLogger("ferry.worker")

# The handshake's three frames, each a kind byte then its fields:
#   frontend → worker  HELLO  nonce_f
#   worker → frontend  CHALLENGE  nonce_w + proof_w(nonce_f)
#   frontend → worker  PROOF  proof_f(nonce_w)
# The link the proofs are bound to is the frontend's identity.
HELLO, CHALLENGE, PROOF = b"H", b"C", b"P"
WORKER, FRONTEND = b"worker", b"frontend"
HANDSHAKE = (HELLO, CHALLENGE, PROOF)
_POLL_SLICE_MS = 50


class WorkerChannel:
    def __init__(self, address: str, codec: Codec, secret: str | bytes) -> None:
        self.codec = codec
        self._key = auth.key_of(secret)
        self._nonces: dict[bytes, tuple[bytes, bytes]] = {}  # identity → (theirs, mine)
        self._refused = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not drops
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a token for a slow frontend
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frontends: list[bytes] = []
        self._owners: dict[str, bytes] = {}
        self.event_sink: Callable[[list[KVEvent]], None] | None = None
        self._hello: bytes | None = None
        self.last_stats = 0.0  # monotonic time stats last went to every frontend
        self.last_sent = 0.0  # ... and anything at all
        self._lock = threading.Lock()  # the socket is used by the loop and the heartbeat
        self._closed = threading.Event()

    def ready(self, msg: msgspec.Struct) -> None:
        """The worker's ready (or failure) message: sent to every frontend that said or
        says hello."""
        self._hello = self.codec.encode(msg)
        for frontend in self.frontends:
            self._send(frontend, self._hello)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message waits, within ``timeout_ms`` (in slices, so that the heartbeat
        thread gets the socket in between)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self._lock:
                if self._sock.poll(min(timeout_ms, _POLL_SLICE_MS)):
                    return True
            if time.monotonic() >= deadline:
                return False

    def start_heartbeat(self, interval_s: float) -> None:
        """Send ``Heartbeat`` to every frontend whenever nothing else went out for
        ``interval_s``, from a thread of its own: a frontend hears the worker through a long
        step, and hears nothing from a stopped process (SIGSTOP stops every thread)."""

        def beat() -> None:
            payload = self.codec.encode(Heartbeat())
            while not self._closed.wait(interval_s / 2):
                if time.monotonic() - self.last_sent >= interval_s:
                    for frontend in list(self.frontends):
                        self._send(frontend, payload)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _recv(self) -> tuple[bytes, bytes] | None:
        """The next (frontend, message) from a frontend that proved the secret, or None
        after a handshake frame or a message from anyone else."""
        with self._lock:
            frames = self._sock.recv_multipart()
        if len(frames) != 2:
            return self._refuse(frames[0], "a malformed message")
        peer, payload = frames
        kind = payload[:1]
        if kind == HELLO and len(payload) == 1 + auth.NONCE_BYTES:
            if peer in self.frontends:  # a reconnection: it proves itself again
                self.frontends.remove(peer)
            mine = auth.nonce()
            self._nonces[peer] = (payload[1:], mine)
            answer = auth.proof(self._key, WORKER, peer, mine, payload[1:])
            self._send(peer, CHALLENGE + mine + answer)
            return None
        if peer in self._nonces and kind == PROOF:
            theirs, mine = self._nonces.pop(peer)
            try:
                auth.check(self._key, FRONTEND, peer, theirs, mine, payload[1:])
            except auth.AuthError:
                return self._refuse(peer, "a wrong proof of the cluster secret")
            self.frontends.append(peer)
            if self._hello is not None:
                self._send(peer, self._hello)
            return None
        if peer not in self.frontends:
            return self._refuse(peer, "a message before the handshake")
        return peer, payload

    def _refuse(self, peer: bytes, what: str) -> None:
        self._refused += 1
        if self._refused & (self._refused - 1) == 0:  # the 1st, 2nd, 4th, 8th ...
            log.warning("dropped %s from a peer that has not proved the cluster secret "
                        "(%d so far)", what, self._refused)  # fmt: skip
        return None

    def pending(self) -> Iterator[tuple[bytes, msgspec.Struct]]:
        """Every input waiting now, as (frontend, message); hellos are answered on the way."""
        while self.poll(0):
            got = self._recv()
            if got is not None:
                yield got[0], self.codec.decode_input(got[1])

    def linger(self, seconds: float = 2.0) -> None:
        """Answer the hellos of frontends that connect in the next ``seconds`` (with the
        ready or failure message already set), so that a failure reaches them."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.poll(100):
                self._recv()

    # -- sending --------------------------------------------------------------------------

    def claim(self, request_id: str, frontend: bytes) -> None:
        self._owners[request_id] = frontend

    def release(self, request_id: str) -> None:
        self._owners.pop(request_id, None)

    @property
    def num_claimed(self) -> int:
        return len(self._owners)

    def reply(self, request_id: str, msg: msgspec.Struct, last: bool) -> None:
        """``msg`` to the frontend that opened ``request_id`` (dropped if none did);
        ``last``: nothing more will be said about it."""
        frontend = self._owners.pop(request_id, None) if last else self._owners.get(request_id)
        if frontend is not None:
            self._send(frontend, self.codec.encode(msg))

    def outputs(self, outputs: list[RequestOutput], stats: WorkerStats | None) -> None:
        """Each frontend its own requests' outputs, and all of them ``stats``."""
        mine: dict[bytes, list[RequestOutput]] = {f: [] for f in self.frontends}
        for out in outputs:
            frontend = self._owners.get(out.request_id)
            if frontend is None:
                continue
            if out.finish_reason is not None:
                del self._owners[out.request_id]
            mine.setdefault(frontend, []).append(out)
        for frontend, part in mine.items():
            self._send(frontend, self.codec.encode(Outputs(part, stats)))
        self._published(stats)

    def stats(self, stats: WorkerStats) -> None:
        for frontend in list(self.frontends):
            self._send(frontend, self.codec.encode(stats))
        self._published(stats)

    def _published(self, stats: WorkerStats | None) -> None:
        if stats is None:
            return
        self.last_stats = time.monotonic()
        if stats.events and self.event_sink is not None:
            self.event_sink(stats.events)

    def _send(self, frontend: bytes, payload: bytes) -> None:
        try:
            with self._lock:
                self._sock.send_multipart([frontend, payload], zmq.NOBLOCK)
            self.last_sent = time.monotonic()
        except zmq.ZMQError:  # that frontend is gone (or not keeping up): forget it
            if frontend in self.frontends:
                self.frontends.remove(frontend)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._sock.close(0)
        self._ctx.term()
