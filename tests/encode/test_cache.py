"""The encode worker's embedding cache: an image's rows by content hash, in a block pool
and in the KV file tier below it (no processes, CPU)."""

from __future__ import annotations

import torch

from encode.cache import EmbeddingCache, FileTierConfig
from encode.keys import embedding_keys
from engine.media import embedding_layout
from kvstore.layout import KVCache

HIDDEN, BLOCK = 8, 4


def _cache(num_blocks: int, directory: str = "", fingerprint: str = "tower-a") -> EmbeddingCache:
    layout = embedding_layout(HIDDEN, torch.float32, block_size=BLOCK)
    return EmbeddingCache(KVCache(layout, num_blocks, "cpu"), fingerprint,
                          FileTierConfig(directory))  # fmt: skip


def _rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_a_stored_image_is_found_whole_in_memory_and_reads_back_exactly():
    cache = _cache(16)
    rows = _rows(0, 10)  # 3 blocks, the last one partly filled
    blocks = cache.store(b"image-a", rows)
    assert len(blocks) == 3
    cache.release(blocks)
    hit = cache.lookup(b"image-a", 10)
    assert hit is not None and hit.tier == "memory"
    assert torch.equal(cache.read(hit.blocks, 10), rows)
    cache.check_integrity([hit.blocks])
    cache.release(hit.blocks)
    assert cache.lookup(b"image-b", 10) is None  # another content hash
    assert cache.lookup(b"image-a", 9) is None  # another length: another chain
    cache.check_integrity([])
    assert cache.hits == {"memory": 1, "file": 0}


def test_an_image_partly_evicted_from_memory_is_not_found_there():
    cache = _cache(4)  # 3 usable blocks (block 0 is the null block)
    cache.release(cache.store(b"image-a", _rows(0, 8)))  # 2 blocks, then evictable
    cache.release(cache.store(b"image-b", _rows(1, 8)))  # takes one of image-a's blocks
    assert cache.lookup(b"image-a", 8) is None
    hit = cache.lookup(b"image-b", 8)
    assert hit is not None
    cache.release(hit.blocks)
    cache.check_integrity([])


def test_the_file_tier_serves_another_worker_and_keys_follow_the_tower(tmp_path):
    rows = _rows(2, 6)
    first = _cache(8, str(tmp_path))
    first.release(first.store(b"image-a", rows))
    first.close()
    other = _cache(8, str(tmp_path))  # a second encode worker on the same files
    hit = other.lookup(b"image-a", 6)
    assert hit is not None and hit.tier == "file"
    assert torch.equal(other.read(hit.blocks, 6), rows)
    other.release(hit.blocks)
    assert other.lookup(b"image-a", 6).tier == "memory"  # loaded: in memory from now on
    other.close()
    retrained = _cache(8, str(tmp_path), fingerprint="tower-b")
    assert retrained.lookup(b"image-a", 6) is None  # another tower's embeddings never mix
    retrained.close()


def test_the_frontend_computes_the_same_keys_as_the_worker():
    cache = _cache(8)
    assert embedding_keys(cache.extra, b"image-a", 10, BLOCK) == cache.keys(b"image-a", 10)
    cache.release(cache.store(b"image-a", _rows(0, 10)))
    events = cache.drain_events()
    stored = [e.block_hash for e in events if e.kind == "stored" and e.tier == "device"]
    assert stored == cache.keys(b"image-a", 10)  # what the prefix index learns
