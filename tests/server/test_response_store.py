"""The Responses API's store: bounded in count (oldest out first) and in time (TTL)."""

from __future__ import annotations

from server.response_store import ResponseStore, StoredResponse
from server.responses_protocol import ResponseObject


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(response_id: str) -> StoredResponse:
    response = ResponseObject(id=response_id, status="completed", model="m")
    return StoredResponse(response, ({"role": "user", "content": response_id},))


def test_the_oldest_goes_first_when_full():
    store = ResponseStore(max_size=2, ttl_s=100, clock=Clock())
    for name in ("a", "b", "c"):
        store.put(stored(name))
    assert store.get("a") is None
    assert [store.get(n).messages[0]["content"] for n in ("b", "c")] == ["b", "c"]
    assert len(store) == 2


def test_responses_expire_after_the_ttl_and_can_be_deleted():
    clock = Clock()
    store = ResponseStore(max_size=10, ttl_s=60, clock=clock)
    store.put(stored("a"))
    clock.now = 30
    store.put(stored("b"))
    clock.now = 61
    assert store.get("a") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")
    assert len(store) == 0


def test_size_zero_stores_nothing():
    store = ResponseStore(max_size=0, ttl_s=60)
    store.put(stored("a"))
    assert store.get("a") is None
