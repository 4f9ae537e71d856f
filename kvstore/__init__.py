"""KV store: the block hash every process shares; tiers, index and transports come later."""

from kvstore.hashing import ROOT_HASH, BlockHash, block_hash, extra_keys, hash_chain

__all__ = ["ROOT_HASH", "BlockHash", "block_hash", "extra_keys", "hash_chain"]
