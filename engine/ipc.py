"""The worker side of frontend channels: ``worker_sockets`` for the engine process (one
frontend: requests in over PULL, results out over PUSH), ``WorkerChannel`` for prefill
and decode workers (any number of frontends over ROUTER/DEALER)."""

from __future__ import annotations

import os
import time

import zmq


def worker_sockets(input_addr: str, output_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Connect to the frontend's bound sockets; returns (inbox, outbox)."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    return inbox, outbox


class WorkerChannel:
    """A worker's end of its channel to any number of frontends (prefill and decode
    workers): a ROUTER socket the worker binds; each frontend connects a DEALER under its
    own identity and opens with an empty message (its hello), answered with the worker's
    ready message once there is one. Replies about a request go to the frontend that sent
    it (``claim``); stats and heartbeats go to every frontend.
    """

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not drops
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a token for a slow frontend
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frontends: list[bytes] = []
        self.owners: dict[str, bytes] = {}
        self.event_sink = None  # where KV events also go (the Redis stream), if anywhere
        self._hello: bytes | None = None

    def ready(self, payload: bytes) -> None:
        """The worker's ready message: sent to every frontend that said or says hello."""
        self._hello = payload
        for frontend in self.frontends:
            self._send(frontend, payload)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._sock.poll(timeout_ms))

    def recv(self) -> tuple[bytes, bytes] | None:
        """The next (frontend, message), or None after handling a hello."""
        frontend, payload = self._sock.recv_multipart()
        if payload:
            return frontend, payload
        if frontend not in self.frontends:
            self.frontends.append(frontend)
        if self._hello is not None:
            self._send(frontend, self._hello)
        return None

    def pending(self, decode):
        """Every message waiting now, as (frontend, ``decode(payload)``); hellos are
        answered on the way."""
        while self.poll(0):
            got = self.recv()
            if got is not None:
                yield got[0], decode(got[1])

    def claim(self, request_id: str, frontend: bytes) -> None:
        self.owners[request_id] = frontend

    def send_for(self, request_id: str, payload: bytes, release: bool = False) -> None:
        """To the frontend that sent ``request_id`` (dropped if unknown)."""
        frontend = self.owners.pop(request_id, None) if release else self.owners.get(request_id)
        if frontend is not None:
            self._send(frontend, payload)

    def broadcast(self, payload: bytes, events: list = ()) -> None:
        """``payload`` to every frontend; the KV ``events`` it carries also to the sink."""
        for frontend in list(self.frontends):
            self._send(frontend, payload)
        self.publish(events)

    def publish(self, events: list) -> None:
        if events and self.event_sink is not None:
            self.event_sink(events)

    def send_to(self, frontend: bytes, payload: bytes) -> None:
        self._send(frontend, payload)

    def _send(self, frontend: bytes, payload: bytes) -> None:
        try:
            self._sock.send_multipart([frontend, payload], zmq.NOBLOCK)
        except zmq.ZMQError:  # that frontend is gone (or not keeping up): forget it
            if frontend in self.frontends:
                self.frontends.remove(frontend)

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def add_worker_args(parser) -> None:
    """The command line every prefill and decode worker process takes."""
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--listen", required=True,
                        help="ZMQ address the worker binds for frontends (ipc:// or tcp://)")
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--transfer-timeout", type=float, default=60.0)
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the process that started this one is gone")
    parser.add_argument("--redis", help="register there and publish KV events there")
    parser.add_argument("--name", help="the worker's name in the registry")
    parser.add_argument("--role", default="", help="prefill or decode (for the registry)")


def run_worker_main(args, serve, config) -> None:
    """What a worker module's ``main`` does: bind the channel, serve until shut down."""
    channel = WorkerChannel(args.listen)
    run_on_channel(serve, config, channel, args, args.redis, args.name, args.role)


def run_on_channel(serve, config, channel, args, redis_url, name, role, drain=None) -> None:
    """Serve a worker on ``channel`` (``serve(config, channel, args)``), registered on
    Redis as ``name`` when ``redis_url`` is given (its KV events go there too); ``drain``:
    an event that, once set, makes the worker finish what it has and return."""
    import threading

    drain = drain or threading.Event()
    registration = None
    if redis_url:
        from kvstore.registry import WorkerRegistration

        announcement = {"name": name, "role": role, "address": channel.address}
        registration = WorkerRegistration(redis_url, announcement, drain)
        registration.start()
    args.drain = drain
    channel.event_sink = registration.publish if registration else None
    try:
        serve(config, channel, args)
    finally:
        if registration is not None:
            registration.stop()
        channel.close()


def parent_watch(enabled: bool):
    """A check that says whether the parent process (the frontend that spawned this
    worker) has gone, when ``enabled``."""
    parent = os.getppid()
    return lambda: enabled and os.getppid() != parent


def linger(channel: WorkerChannel, seconds: float = 2.0) -> None:
    """Answer the hellos of frontends that connect in the next ``seconds`` (with the
    ready or failure message already set), so that a failure reaches them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if channel.poll(100):
            channel.recv()
