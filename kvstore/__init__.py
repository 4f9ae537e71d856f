"""The KV store, the ground floor every package stands on: the block hash every process
shares (``hashing``), the cache layout (``layout``), KV events (``events``), transports
(``transport``), tiers (``tiers``) and the Redis schema (``registry``). It imports no other
package of ferry."""

from kvstore.hashing import ROOT_HASH, BlockHash, block_hash, extra_keys, hash_chain

__all__ = ["ROOT_HASH", "BlockHash", "block_hash", "extra_keys", "hash_chain"]
