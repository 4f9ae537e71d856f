"""The KV cache manager over its tiers, driven through the schedulers with a stand-in
runner that writes each block's expected content (derived from its hash) when the step
computes it: evicted blocks reach host memory, computed ones reach files after their step,
and prefix hits from either come back into fresh blocks with the right bytes."""

from __future__ import annotations

import pytest
import torch

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiered import KVTiers, block_meta
from engine.pd_scheduler import DecodeScheduler
from engine.plan import StepResult
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kvstore.layout import KVCache, KVCacheLayout
from kvstore.tiers import FileTier, HostTier, TierEvents

BS = 4
LAYOUT = KVCacheLayout.for_attention(2, 1, 2, BS, torch.float32)


def value(h: bytes) -> float:
    return float(int.from_bytes(h[:2], "little"))


class Engine:
    """A scheduler over a real KV cache and tiers; ``step`` plays the runner."""

    def __init__(
        self, num_blocks, tmp_path=None, host_slots=0, cls=Scheduler, budget=64, device="cpu"
    ):
        self.cache = KVCache(LAYOUT, num_blocks, device)
        events = TierEvents()
        meta = block_meta(self.cache, "fake:llama:2x1x2")
        pin = device.startswith("cuda")
        host = (
            HostTier(host_slots, meta.block_shape, meta.dtype, events, pin_memory=pin)
            if host_slots
            else None
        )
        self.file = FileTier(tmp_path, meta, 1 << 30, 3600.0, events) if tmp_path else None
        tiers = KVTiers(self.cache, host, self.file, events)
        self.kv = KVCacheManager(BlockPool(num_blocks), BS, tiers)
        self.sched = cls(SchedulerConfig(max_num_batched_tokens=budget), self.kv, 4096)

    def step(self):
        plan = self.sched.schedule()
        for chunk in plan.chunks:
            req = self.sched.requests[chunk.request_id]
            for i, h in enumerate(req.full_block_hashes(BS, chunk.end_pos)):
                if (i + 1) * BS > chunk.start_pos:  # this chunk computes (part of) block i
                    self.cache.storage[:, chunk.block_ids[i]] = value(h)
        sampled = {c.request_id: 7 for c in plan.chunks if c.sample}
        return plan, self.sched.update(plan, StepResult(sampled))

    def run(self, rid, prompt, max_tokens=1):
        self.sched.add(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens)))
        outs = []
        while self.sched.has_work:
            outs += self.step()[1]
            self.sched.check_integrity()
        return outs

    def close(self):
        if self.file is not None:
            self.file.close()


def assert_blocks_hold_their_content(engine, req, n):
    for block, h in zip(req.blocks[:n], req.full_block_hashes(BS, n * BS), strict=True):
        assert torch.all(engine.cache.storage[:, block.block_id] == value(h))


PROMPT_A = list(range(100, 117))  # 4 full blocks + 1 token
PROMPT_B = list(range(200, 217))


def test_evicted_blocks_go_to_host_memory_and_come_back():
    e = Engine(num_blocks=7, host_slots=8)  # 6 usable blocks: B evicts A's
    e.run("a", PROMPT_A)
    e.run("b", PROMPT_B)
    assert len(e.kv.tiers.host) == 3  # A's first block is still on the device (LRU: tail first)
    req = Request("a2", PROMPT_A, SamplingParams(max_tokens=2))
    match = e.kv.match_prefix(req)
    assert match.num_tokens == 16 and len(match.blocks) == 1
    assert [hit.tier for hit in match.loads] == ["host"] * 3
    e.sched.add(req)
    e.step()
    assert_blocks_hold_their_content(e, req, 4)
    while e.sched.has_work:
        e.step()
    assert e.kv.hit_tokens_by_tier["host"] > 0 and req.num_cached_tokens == 16
    e.sched.check_integrity()
    events = e.kv.pool.drain_events()
    assert {(ev.kind, ev.tier) for ev in events} >= {("stored", "host"), ("removed", "device")}


def test_host_hits_being_loaded_are_not_evicted_by_the_same_allocation():
    e = Engine(num_blocks=7, host_slots=3)
    e.run("a", PROMPT_A)
    e.run("b", PROMPT_B)  # A's last three full blocks fill the host; B's stay on the device
    host = e.kv.tiers.host
    req = Request("a2", PROMPT_A, SamplingParams(max_tokens=2))
    e.sched.add(req)  # evicts B's blocks, whose offload finds every host slot pinned
    e.step()
    assert_blocks_hold_their_content(e, req, 4)
    assert host.dropped > 0
    while e.sched.has_work:
        e.step()
    e.sched.check_integrity()


def test_computed_blocks_are_written_through_only_after_their_step(tmp_path):
    e = Engine(num_blocks=32, tmp_path=tmp_path)
    e.sched.add(Request("a", PROMPT_A, SamplingParams(max_tokens=1)))
    plan = e.sched.schedule()  # publishes A's blocks before they are computed
    assert len(e.file) == 0
    for i, h in enumerate(e.sched.requests["a"].full_block_hashes(BS, 16)):
        e.cache.storage[:, plan.chunks[0].block_ids[i]] = value(h)
    e.sched.update(plan, StepResult({"a": 7}))
    e.file.flush()
    hashes = Request("x", PROMPT_A, SamplingParams()).full_block_hashes(BS, 16)
    for h in hashes:
        assert torch.all(e.file.load(h) == value(h))  # the computed bytes, not zeros
    e.close()


def test_a_restarted_engine_takes_the_prefix_from_files(tmp_path):
    first = Engine(num_blocks=32, tmp_path=tmp_path)
    first.run("a", PROMPT_A)
    first.close()
    e = Engine(num_blocks=32, tmp_path=tmp_path)
    outs = e.run("a", PROMPT_A)
    assert outs[0].num_cached_tokens == 16  # whole blocks; the last token is recomputed
    assert e.kv.hit_tokens_by_tier == {"device": 0, "host": 0, "file": 16}
    e.close()


def test_a_corrupt_file_shortens_the_match_and_is_recomputed(tmp_path):
    first = Engine(num_blocks=32, tmp_path=tmp_path)
    first.run("a", PROMPT_A)
    first.close()
    hashes = Request("x", PROMPT_A, SamplingParams()).full_block_hashes(BS, 16)
    path = first.file.path(hashes[2])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(data)
    e = Engine(num_blocks=32, tmp_path=tmp_path)
    req = Request("a", PROMPT_A, SamplingParams(max_tokens=2))
    e.sched.add(req)
    plan, _ = e.step()
    assert_blocks_hold_their_content(e, req, 4)
    assert req.num_cached_tokens == 8 and plan.chunks[0].start_pos == 8
    assert e.file.stats()["checksum_failures"] == 1
    e.file.flush()
    assert torch.all(e.file.load(hashes[2]) == value(hashes[2]))  # rewritten, sound
    e.close()


def test_decode_side_reservation_counts_and_loads_file_hits(tmp_path):
    first = Engine(num_blocks=32, tmp_path=tmp_path)
    first.run("a", PROMPT_A)
    first.close()
    d = Engine(num_blocks=32, tmp_path=tmp_path, cls=DecodeScheduler)
    long_prompt = PROMPT_A + list(range(300, 340))  # 16 tokens on file, 41 to receive
    d.sched.expect_kv("r", local_prefill_tokens=16)
    req = Request("r", long_prompt, SamplingParams(max_tokens=4))
    d.sched.add(req)
    (reserved,) = d.sched.reserve_pending()
    assert reserved.num_cached_tokens == 16 and len(reserved.blocks) == -(-len(long_prompt) // BS)
    assert_blocks_hold_their_content(d, reserved, 4)
    d.sched.abort(["r"])
    d.sched.check_integrity()
    assert d.kv.pool.num_free == d.kv.pool.num_usable
    d.close()


@pytest.mark.parametrize("tiers", ["host", "file"])
def test_nothing_is_held_after_many_requests(tmp_path, tiers):
    e = Engine(num_blocks=12, tmp_path=tmp_path if tiers == "file" else None,
               host_slots=6 if tiers == "host" else 0, budget=8)  # fmt: skip
    for i in range(12):
        base = (i % 4) * 100
        e.sched.add(
            Request(f"r{i}", list(range(base, base + 10 + i)), SamplingParams(max_tokens=3))
        )
    while e.sched.has_work:
        e.step()
        e.sched.check_integrity()
    assert e.kv.pool.num_free == e.kv.pool.num_usable
    assert sum(e.kv.hit_tokens_by_tier.values()) == e.kv.hit_tokens > 0
    e.close()
