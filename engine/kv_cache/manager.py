"""Per-request block bookkeeping on top of the BlockPool, and the tiers below it.

A request's prefix comes from the best tier that holds it: the device cache (blocks are
shared), then host memory and files (``KVTiers``; their content is copied into fresh
blocks when the request gets them). Hits count in whole blocks, and the prompt's last
token is always left to compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.tiered import KVTiers, TierHit
from engine.request import Request
from kvstore.hashing import BlockHash

TIERS = ("device", "host", "file")


@dataclass(frozen=True)
class PrefixMatch:
    """A request's leading tokens already held somewhere: ``blocks`` in the device cache,
    then ``loads`` from the tiers below (copied into fresh blocks by ``reserve``)."""

    blocks: list[Block]
    num_tokens: int
    loads: tuple[TierHit, ...] = ()


NO_MATCH = PrefixMatch([], 0)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, tiers: KVTiers | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tiers = tiers
        self.query_tokens = 0  # cumulative prompt tokens looked up
        self.hit_tokens = 0  # cumulative tokens found, in any tier
        self.hit_tokens_by_tier = dict.fromkeys(TIERS, 0)
        self._computing: list[tuple[Block, BlockHash]] = []  # published, filled by this step
        if tiers is not None:
            pool.on_evict = tiers.offload
            pool.add_event_source(tiers.drain_events)

    def match_prefix(self, req: Request) -> PrefixMatch:
        """Longest cached prefix of ``req`` over all tiers, leaving at least its last token
        to compute (something must run through the model to sample from)."""
        if not self.pool.enable_caching:
            return NO_MATCH
        limit = req.num_tokens - 1
        hashes = req.full_block_hashes(self.block_size, limit)
        blocks = self.pool.lookup(hashes)
        loads = () if self.tiers is None else tuple(self.tiers.match(hashes[len(blocks) :]))
        return PrefixMatch(blocks, (len(blocks) + len(loads)) * self.block_size, loads)

    def record_lookup(self, req: Request, match: PrefixMatch) -> None:
        self.query_tokens += req.num_tokens
        self.hit_tokens += match.num_tokens
        self.hit_tokens_by_tier["device"] += len(match.blocks) * self.block_size
        for hit in match.loads:
            self.hit_tokens_by_tier[hit.tier] += self.block_size

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
        more tokens, then publish every block those tokens fill (the step computes them;
        ``commit`` after it writes them through to the file tier). Check ``can_allocate``
        first; this raises MemoryError when the pool is short."""
        self.reserve(req, num_new_tokens, match)
        self._computing += self._publish_full_blocks(req, req.num_computed_tokens + num_new_tokens)

    def reserve(self, req: Request, num_new_tokens: int, match: PrefixMatch = NO_MATCH) -> None:
        """``allocate`` without publishing: for blocks whose content arrives later (a KV
        transfer), which must not be found by a prefix match before it has landed. Tier
        hits are loaded into their fresh blocks here."""
        need = self.blocks_needed(req, num_new_tokens, match)
        self.pool.touch(match.blocks)
        req.blocks.extend(match.blocks)
        if match.loads:
            assert self.tiers is not None
            with self.tiers.pinned(match.loads):  # evictions below must not drop them
                fresh = self.pool.allocate(need)
                self.tiers.load(match.loads, [b.block_id for b in fresh])
        else:
            fresh = self.pool.allocate(need)
        req.blocks.extend(fresh)
        req.num_computed_tokens += match.num_tokens

    def publish(self, req: Request, num_tokens: int) -> None:
        """Publish the full blocks among ``req``'s first ``num_tokens`` tokens, whose content
        is in place (a KV transfer landed; the worker that computed it wrote it through)."""
        self._publish_full_blocks(req, num_tokens)

    def take_computing(self) -> list[tuple[Block, BlockHash]]:
        """The blocks ``allocate`` published since the last call: the next step computes
        them (pass them to ``commit`` once it has run)."""
        blocks, self._computing = self._computing, []
        return blocks

    def commit(self, done: list[tuple[Block, BlockHash]] | None = None) -> None:
        """The step that computes ``done`` (default: every block ``allocate`` published
        since the last ``take_computing``) has run: write them through to the file tier."""
        if done is None:
            done = self.take_computing()
        if self.tiers is not None and done:
            self.tiers.write_through([(b.block_id, h) for b, h in done if b.block_hash == h])

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Give back ``req``'s blocks past those its first ``num_tokens`` tokens need, tail
        first: they held only rejected drafts or a drafter's unused lookahead, so none of
        them is published (a block is published only once real tokens fill it)."""
        keep = -(-num_tokens // self.block_size)
        extra = req.blocks[keep:]
        if not extra:
            return
        if any(b.block_hash is not None for b in extra):
            raise RuntimeError(f"request {req.request_id}: truncating a published block")
        del req.blocks[keep:]
        self.pool.free(list(reversed(extra)))

    def free(self, req: Request) -> None:
        self.pool.free(list(reversed(req.blocks)))
        req.blocks = []
        req.num_computed_tokens = 0

    def _publish_full_blocks(self, req: Request, num_tokens: int) -> list[tuple[Block, BlockHash]]:
        if not self.pool.enable_caching:
            return []
        hashes = req.full_block_hashes(self.block_size, num_tokens)
        return [(b, h) for b, h in zip(req.blocks, hashes) if self.pool.cache(b, h)]

    def tier_stats(self) -> dict[str, int]:
        """Hits by tier and the tiers' counters, as ``EngineStats`` fields."""
        stats = {f"prefix_hit_tokens_{t}": n for t, n in self.hit_tokens_by_tier.items()}
        if self.tiers is not None:
            stats.update(self.tiers.stats())
        return stats

    def check_integrity(self, holders_blocks: list[list[Block]]) -> None:
        """Every block is held exactly by the holders that list it (a request's blocks, a
        running send's); all others are free."""
        holders: dict[int, int] = {}
        for blocks in holders_blocks:
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        self.pool.check_integrity(holders)
        if self.tiers is not None:
            self.tiers.check_integrity()
