"""An encode worker's embedding cache: an image's embeddings by its content hash.

The embeddings of an image are ``ceil(tokens / block_size)`` blocks of an
``engine.media.embedding_layout`` cache, so that everything below is the KV cache's own
machinery, unchanged:

- **memory**: a ``BlockPool`` with prefix caching. Block ``j`` of an image is published
  under ``block_hash(block j-1, [j, tokens], fingerprint + content hash)``; a lookup
  walks that chain, so an image whose blocks were partly evicted is found only as far as
  they are still there. Blocks being sent are referenced (never evicted); the others wait
  in the pool's LRU queue. Publishing emits the pool's ``stored`` / ``removed`` events,
  which the frontend's prefix index takes in, so its policy knows which worker holds an
  image.
- **files**: the KV file tier (``KVTiers`` with files only): the same format, checksum,
  TTL, capacity and fault handling as KV blocks, in a namespace of its own (the layout
  and the tower's fingerprint differ from any KV's), shared by every worker of the
  machine: an image encoded on one encode worker is not encoded again on another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encode.keys import embedding_keys
from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.tiered import KVTiers
from engine.media import blocks_for, read_rows, write_rows
from kvstore.events import KVEvent
from kvstore.hashing import BlockHash, extra_keys
from kvstore.layout import KVCache
from kvstore.tiers.fileio import DEFAULT_FILE_MODE


@dataclass(frozen=True)
class FileTierConfig:
    """Where the file tier lives ("": none) and its bounds (``CacheConfig``'s)."""

    directory: str = ""
    capacity_bytes: int = 20 << 30
    ttl_s: float = 72 * 3600.0
    mode: int = DEFAULT_FILE_MODE


@dataclass(frozen=True)
class Hit:
    """An image's blocks (referenced: ``release`` them) and where they were found."""

    blocks: list[Block]
    tier: str  # "memory" | "file"


class EmbeddingCache:
    def __init__(self, cache: KVCache, fingerprint: str, files: FileTierConfig) -> None:
        """``cache``: the embedding blocks (``embedding_layout``), allocated by the caller
        (where its KV transport needs them); ``fingerprint``: identifies what computed
        them (the model and its image processor)."""
        self.kv = cache
        self.block_size = cache.layout.block_size
        self.pool = BlockPool(cache.num_blocks, enable_caching=True)
        self.extra = extra_keys("embeddings", fingerprint)
        self.tiers = KVTiers.build(cache, fingerprint, 0, files.directory, files.capacity_bytes,
                                   files.ttl_s, files.mode)  # fmt: skip
        if self.tiers is not None:
            self.pool.add_event_source(self.tiers.drain_events)
        self.hits = {"memory": 0, "file": 0}

    def keys(self, content_hash: bytes, num_tokens: int) -> list[BlockHash]:
        return embedding_keys(self.extra, content_hash, num_tokens, self.block_size)

    def lookup(self, content_hash: bytes, num_tokens: int) -> Hit | None:
        """The image's blocks when the whole of it is held in memory or in files (file
        blocks are loaded into fresh memory blocks); None otherwise, or when there is no
        room to load them."""
        keys = self.keys(content_hash, num_tokens)
        found = self.pool.lookup(keys)
        if len(found) == len(keys):
            self.pool.touch(found)
            self.hits["memory"] += 1
            return Hit(found, "memory")
        if self.tiers is None:
            return None
        loads = self.tiers.match(keys[len(found) :])
        if len(found) + len(loads) < len(keys) or len(loads) > self.pool.num_free:
            return None
        self.pool.touch(found)
        fresh = self.pool.allocate(len(loads))
        self.tiers.load(tuple(loads), [b.block_id for b in fresh])
        for block, key in zip(fresh, keys[len(found) :]):
            self.pool.cache(block, key)
        self.hits["file"] += 1
        return Hit(found + fresh, "file")

    def can_store(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.pool.num_free

    def store(self, content_hash: bytes, rows: torch.Tensor) -> list[Block]:
        """Keep the image's embedding rows [tokens, hidden]: returns its blocks, referenced
        (``release`` them), published in memory and written through to the files."""
        keys = self.keys(content_hash, rows.shape[0])
        blocks = self.pool.allocate(len(keys))
        write_rows(self.kv, [b.block_id for b in blocks], rows.to(self.kv.layout.dtype))
        published = [(b.block_id, k) for b, k in zip(blocks, keys) if self.pool.cache(b, k)]
        if self.tiers is not None:
            self.tiers.write_through(published)
        return blocks

    def read(self, blocks: list[Block], num_tokens: int) -> torch.Tensor:
        return read_rows(self.kv, [b.block_id for b in blocks], num_tokens)

    def release(self, blocks: list[Block]) -> None:
        self.pool.free(list(reversed(blocks)))

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def check_integrity(self, held: list[list[Block]]) -> None:
        refs: dict[int, int] = {}
        for blocks in held:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
