"""A frontend's view of the worker registry and KV event stream on Redis
(``kvstore.registry`` holds the schema and the workers' side)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import msgspec
import redis
import redis.asyncio as aioredis

from kvstore.events import KVEvent
from kvstore.registry import HEARTBEAT_S, STREAM, decode_events, worker_key

log = logging.getLogger("ferry.registry")


class RedisDirectory:
    """A frontend's view of Redis: attaches registered workers and feeds the prefix
    index from the event stream. ``run`` until cancelled."""

    def __init__(
        self, url: str, join: Callable[[str, str, str], object],
        apply: Callable[[str, list[KVEvent]], None], set_draining: Callable[[str, bool], None],
    ) -> None:  # fmt: skip
        self._redis = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._join = join
        self._apply = apply
        self._set_draining = set_draining
        self.last_id = "0-0"
        self.known: dict[str, dict] = {}
        self.connected = False
        self.events_read = 0

    async def run(self) -> None:
        await asyncio.gather(self._watch_registry(), self._consume())

    async def close(self) -> None:
        await self._redis.aclose()

    async def _watch_registry(self) -> None:
        while True:
            try:
                for entry in await self._registered():
                    name = entry["name"]
                    self._set_draining(name, bool(entry.get("draining")))
                    if self.known.get(name, {}).get("address") != entry["address"]:
                        self.known[name] = entry
                        self._join(name, entry["role"], entry["address"])
            except (redis.RedisError, OSError, ValueError, KeyError) as exc:
                log.debug("registry scan failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def _registered(self) -> list[dict]:
        keys = [k async for k in self._redis.scan_iter(match=worker_key("*"), count=500)]
        if not keys:
            return []
        return [json.loads(v) for v in await self._redis.mget(keys) if v is not None]

    async def _consume(self) -> None:
        while True:
            try:
                reply = await self._redis.xread({STREAM: self.last_id}, count=1000, block=1000)
                if not self.connected:
                    log.info("reading KV events from Redis from id %s", self.last_id)
                self.connected = True
            except (redis.RedisError, OSError) as exc:
                if self.connected:
                    log.warning("Redis unreachable (%s); routing from the local index", exc)
                self.connected = False
                await asyncio.sleep(HEARTBEAT_S)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        events = decode_events(fields[b"e"])
                        self._apply(fields[b"w"].decode(), events)
                        self.events_read += len(events)
                    except (KeyError, msgspec.DecodeError) as exc:
                        log.warning("skipping a malformed KV event entry: %s", exc)
