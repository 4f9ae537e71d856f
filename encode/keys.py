"""The keys of an image's embeddings, as encode workers' caches publish them and the
frontend's prefix index looks them up. Free of torch: the frontend imports it."""

from __future__ import annotations

from kvstore.hashing import ROOT_HASH, BlockHash, block_hash, extra_keys


def embedding_keys(
    extra: bytes, content_hash: bytes, num_tokens: int, block_size: int
) -> list[BlockHash]:
    """The chain of block keys of an image's embeddings (``extra``: the cache's own, which
    an encode worker's ready message carries as its ``hash_extra``): block ``j`` under
    ``block_hash(block j-1, [j, num_tokens], extra + the content hash)``."""
    extra = extra + extra_keys(content_hash)
    keys, parent = [], ROOT_HASH
    for j in range(-(-num_tokens // block_size)):
        parent = block_hash(parent, [j, num_tokens], extra)
        keys.append(parent)
    return keys
