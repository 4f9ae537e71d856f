"""Workers and their KV events on Redis, so that several frontends route alike.

Keys (all under ``ferry:``):

- ``ferry:worker:<name>`` — a worker's announcement ``{name, role, address, draining}``
  as JSON, set with a TTL and refreshed every second while the worker lives
  (``WorkerRegistration``, in the worker). A worker that dies simply expires.
- ``ferry:kv-events`` — a Redis Stream; each entry is one batch of a worker's KV events
  (``w``: its name, ``e``: msgpack list of ``KVEvent``), capped at about
  ``STREAM_MAXLEN`` entries.

Each frontend (``router.registry.RedisDirectory``) scans the registry every second,
attaches the workers it does not know yet, and consumes the stream into its own prefix
index, from the stream's start when it starts (an index lives in memory,
so a restarted frontend rebuilds it) and from the last id it has read after a lost
connection. While Redis is down nothing stops: frontends route from their local index
and the workers they know (a worker's health comes from its own channel, not from
Redis); workers keep their events in a bounded buffer and send them when Redis is back;
frontends then read on from their last id, and the index catches up.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque

import msgspec
import redis

from kvstore.events import KVEvent

log = logging.getLogger("ferry.registry")

PREFIX = "ferry:"
STREAM = PREFIX + "kv-events"
STREAM_MAXLEN = 1_000_000
WORKER_TTL_S = 5
HEARTBEAT_S = 1.0
BUFFER_EVENTS = 200_000  # events a worker keeps while Redis is unreachable

_events = msgspec.msgpack.Encoder()
_decode_events = msgspec.msgpack.Decoder(list[KVEvent])


def encode_events(events: list[KVEvent]) -> bytes:
    return _events.encode(events)


def decode_events(data: bytes) -> list[KVEvent]:
    return _decode_events.decode(data)


def worker_key(name: str) -> str:
    return f"{PREFIX}worker:{name}"


class WorkerRegistration:
    """A worker's presence on Redis: its registry key, kept fresh, and its KV events,
    sent from a background thread (``publish`` never blocks the step loop)."""

    def __init__(self, url: str, announcement: dict, draining: threading.Event) -> None:
        self.announcement = announcement
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._draining = draining
        self._buffer: deque[list[KVEvent]] = deque()
        self._buffered = 0
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="redis-registry", daemon=True)
        self._down = False

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        with self._wake:
            self._buffer.append(list(events))
            self._buffered += len(events)
            while self._buffered > BUFFER_EVENTS:  # oldest first: the index self-heals
                self._buffered -= len(self._buffer.popleft())
            self._wake.notify()

    def _run(self) -> None:
        key = worker_key(self.announcement["name"])
        next_beat = 0.0
        while not self._stopped:
            with self._wake:
                if not self._buffer:
                    self._wake.wait(HEARTBEAT_S)
                batches, self._buffer, self._buffered = list(self._buffer), deque(), 0
            try:
                now = time.monotonic()
                if now >= next_beat:
                    value = {**self.announcement, "draining": self._draining.is_set()}
                    self._redis.set(key, json.dumps(value), ex=WORKER_TTL_S)
                    next_beat = now + HEARTBEAT_S
                self._send(batches)
                if self._down:
                    log.warning("Redis is reachable again")
                self._down = False
            except redis.RedisError as exc:
                if not self._down:
                    log.warning("Redis unreachable (%s); keeping KV events until it is back", exc)
                self._down = True
                with self._wake:  # put them back in front, in order
                    self._buffer.extendleft(reversed(batches))
                    self._buffered += sum(len(b) for b in batches)
                next_beat = 0.0
                with self._wake:
                    self._wake.wait(HEARTBEAT_S)

    def _send(self, batches: list[list[KVEvent]]) -> None:
        if not batches:
            return
        pipe = self._redis.pipeline(transaction=False)
        name = self.announcement["name"]
        for batch in batches:
            pipe.xadd(STREAM, {"w": name, "e": encode_events(batch)}, maxlen=STREAM_MAXLEN,
                      approximate=True)  # fmt: skip
        pipe.execute()

    def stop(self) -> None:
        """Flush what is buffered (if Redis is up) and leave the registry."""
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=5)
        try:
            self._send(list(self._buffer))
            self._redis.delete(worker_key(self.announcement["name"]))
        except redis.RedisError:
            pass
        self._redis.close()
