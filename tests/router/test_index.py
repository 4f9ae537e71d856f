"""The router's prefix index against a brute-force model of what each worker holds."""

from __future__ import annotations

import random

import pytest

from kvstore.events import KVEvent
from kvstore.hashing import hash_chain
from router.index import PrefixIndex

WORKERS = ["p0", "p1", "d0", "d1"]
TIERS = ["device", "host", "file"]


def brute_force(held: set[tuple[str, str, bytes]], hashes: list[bytes], worker: str) -> int:
    n = 0
    for h in hashes:
        mine = any((worker, t, h) in held for t in ("device", "host"))
        shared = any((w, "file", h) in held for w in WORKERS)
        if not (mine or shared):
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", range(20))
def test_random_event_streams_match_a_brute_force_model(seed):
    rng = random.Random(seed)
    # a few prompts sharing prefixes, so that chains overlap
    base = [rng.randrange(1000) for _ in range(64)]
    prompts = [base[: rng.randrange(8, 64)] + [rng.randrange(1000) for _ in range(16)]
               for _ in range(6)]  # fmt: skip
    chains = [hash_chain(p, 4) for p in prompts]
    universe = sorted({h for c in chains for h in c})
    index = PrefixIndex()
    held: set[tuple[str, str, bytes]] = set()
    for _ in range(400):
        worker, tier = rng.choice(WORKERS), rng.choice(TIERS)
        if rng.random() < 0.5:  # store a prefix of some chain, as a worker would
            chain = rng.choice(chains)
            events = [KVEvent("stored", h, tier) for h in chain[: rng.randrange(1, len(chain))]]
            held |= {(worker, tier, e.block_hash) for e in events}
        else:
            h = rng.choice(universe)
            events = [KVEvent("removed", h, tier)]
            if tier == "file":  # any worker may evict a shared file
                held -= {(w, "file", h) for w in WORKERS}
            else:
                held.discard((worker, tier, h))
        index.apply(worker, events)
        if rng.random() < 0.05:
            gone = rng.choice(WORKERS)
            index.remove_worker(gone)
            held -= {x for x in held if x[0] == gone and x[1] != "file"}
        chain = rng.choice(chains)
        got = index.match(chain, WORKERS)
        assert got == {w: brute_force(held, chain, w) for w in WORKERS}


def test_eviction_on_a_worker_removes_its_entries_only():
    chain = hash_chain(list(range(40)), 4)
    index = PrefixIndex()
    index.apply("a", [KVEvent("stored", h) for h in chain])
    index.apply("b", [KVEvent("stored", h) for h in chain[:5]])
    assert index.match(chain, ["a", "b", "c"]) == {"a": 10, "b": 5, "c": 0}
    index.apply("a", [KVEvent("removed", chain[3])])
    assert index.match(chain, ["a", "b"]) == {"a": 3, "b": 5}
    index.remove_worker("b")
    assert index.match(chain, ["a", "b"]) == {"a": 3, "b": 0}
    assert index.num_blocks("b") == 0 and index.num_blocks("a") == 9


def test_a_block_moved_to_host_memory_still_counts_for_its_worker():
    chain = hash_chain(list(range(16)), 4)
    index = PrefixIndex()
    index.apply("a", [KVEvent("stored", h) for h in chain])
    index.apply("a", [KVEvent("stored", chain[0], "host"), KVEvent("removed", chain[0])])
    assert index.match(chain, ["a"]) == {"a": 4}
    assert index.tiers("a", chain[0]) == {"host"}


def test_shared_file_tier_counts_for_every_worker_until_its_ttl():
    now = [1000.0]
    chain = hash_chain(list(range(16)), 4)
    index = PrefixIndex(shared_ttl_s=60, clock=lambda: now[0])
    index.apply("a", [KVEvent("stored", h, "file") for h in chain[:3]])
    assert index.match(chain, ["a", "b"]) == {"a": 3, "b": 3}
    now[0] += 61
    assert index.match(chain, ["a", "b"]) == {"a": 0, "b": 0}
    assert index.num_blocks() == 0
