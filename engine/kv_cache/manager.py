"""Per-request block bookkeeping on top of the BlockPool."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import Block, BlockPool
from engine.request import Request


@dataclass(frozen=True)
class PrefixMatch:
    """Blocks already holding a request's leading tokens."""

    blocks: list[Block]
    num_tokens: int


NO_MATCH = PrefixMatch([], 0)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.query_tokens = 0  # cumulative prompt tokens looked up
        self.hit_tokens = 0  # cumulative tokens found

    def match_prefix(self, req: Request) -> PrefixMatch:
        """Longest cached prefix of ``req``, leaving at least its last token to compute
        (something must run through the model to sample from)."""
        if not self.pool.enable_caching:
            return NO_MATCH
        limit = req.num_tokens - 1
        hashes = req.full_block_hashes(self.block_size, limit)
        blocks = self.pool.lookup(hashes)
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def record_lookup(self, req: Request, match: PrefixMatch) -> None:
        self.query_tokens += req.num_tokens
        self.hit_tokens += match.num_tokens

    def blocks_needed(
        self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH
    ) -> int:
        total = req.num_computed_tokens + match.num_tokens + num_new_tokens
        have = len(req.blocks) + len(match.blocks)
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(
        self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH
    ) -> bool:
        evictable_hits = sum(1 for b in match.blocks if b.ref_count == 0)
        need = self.blocks_needed(req, num_new_tokens, match)
        return need + evictable_hits <= self.pool.num_free

    def allocate(self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> None:
        """Give ``req`` the prefix blocks and enough fresh blocks for ``num_new_tokens``
        more tokens, then publish every block those tokens fill. Check ``can_allocate``
        first; this raises MemoryError when the pool is short."""
        self.reserve(req, num_new_tokens, match)
        self.publish(req, req.num_computed_tokens + num_new_tokens)

    def reserve(self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> None:
        """``allocate`` without publishing: for blocks whose content arrives later (a KV
        transfer), which must not be found by a prefix match before it has landed."""
        need = self.blocks_needed(req, num_new_tokens, match)
        self.pool.touch(match.blocks)
        req.blocks.extend(match.blocks)
        req.num_computed_tokens += match.num_tokens
        req.blocks.extend(self.pool.allocate(need))

    def publish(self, req: Request, num_tokens: int) -> None:
        """Publish the full blocks among ``req``'s first ``num_tokens`` tokens."""
        self._publish_full_blocks(req, num_tokens)

    def free(self, req: Request) -> None:
        self.pool.free(list(reversed(req.blocks)))
        req.blocks = []
        req.num_computed_tokens = 0

    def _publish_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        for block, h in zip(req.blocks, req.full_block_hashes(self.block_size, num_tokens)):
            self.pool.cache(block, h)

    def check_integrity(self, requests: list[Request]) -> None:
        """Every block is held exactly by the requests that list it; all others are free."""
        holders: dict[int, int] = {}
        for req in requests:
            for block in req.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        self.pool.check_integrity(holders)
