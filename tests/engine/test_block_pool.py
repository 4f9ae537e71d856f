import pytest

from engine.kv_cache.block_pool import BlockPool
from kvstore.hashing import hash_chain


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    ids = {b.block_id for b in pool.allocate(3)}
    assert ids == {1, 2, 3}
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check_integrity()


def test_lookup_finds_longest_cached_chain_only():
    pool = BlockPool(8)
    hashes = hash_chain(list(range(48)), 16)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.cache(b, h)
    assert [b.block_id for b in pool.lookup(hashes)] == [b.block_id for b in blocks]
    other = hash_chain([7] + list(range(1, 48)), 16)
    assert pool.lookup(other) == []
    pool.check_integrity({b.block_id: 1 for b in blocks})


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"a" * 16)
    pool.cache(b, b"b" * 16)
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.num_free == 3
    assert pool.lookup([b"a" * 16])[0] is a
    fresh = pool.allocate(2)  # the untouched block 3, then b (LRU)
    assert [x.block_id for x in fresh] == [3, b.block_id]
    assert pool.lookup([b"b" * 16]) == []
    assert pool.lookup([b"a" * 16]) == [a]
    kinds = [(e.kind, e.block_hash[:1]) for e in pool.drain_events()]
    assert kinds == [("stored", b"a"), ("stored", b"b"), ("removed", b"b")]
    pool.check_integrity({x.block_id: 1 for x in fresh})


def test_touch_takes_a_cached_block_off_the_free_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h" * 16)
    pool.free([a])
    pool.touch(pool.lookup([b"h" * 16]))
    assert a.ref_count == 1 and pool.num_free == 1
    pool.check_integrity({a.block_id: 1})


def test_double_free_is_caught():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])
