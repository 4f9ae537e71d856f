"""Stored Responses API responses, for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``.

Bounded both ways: at most ``max_size`` responses (the oldest stored goes first) and
each for at most ``ttl_s`` seconds after it was stored. A response created with
``store: false`` is never put here. The store lives in the frontend's memory: it does not
survive a restart and is not shared between frontends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.responses_protocol import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the conversation that continues from it: the chat
    messages of its input (after any earlier responses' and without its instructions,
    which do not carry over) and of its output."""

    response: ResponseObject
    messages: tuple[dict[str, Any], ...]


class ResponseStore:
    def __init__(
        self, max_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        self._expire()
        self._items[stored.response.id] = (self._clock() + self.ttl_s, stored)
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._items.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop what outlived its TTL (the oldest stored expire first)."""
        now = self._clock()
        while self._items:
            response_id, (deadline, _) = next(iter(self._items.items()))
            if deadline > now:
                return
            del self._items[response_id]
