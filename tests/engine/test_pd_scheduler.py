"""The P/D schedulers: a prefill worker's requests keep their blocks until released; a
decode worker's requests whose KV arrives from elsewhere reserve blocks up front and run
from their first token."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.pd_scheduler import PREFILLED, DecodeScheduler, PrefillScheduler
from engine.plan import StepResult
from engine.request import Request, Status
from engine.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 32, budget: int = 64, cls=DecodeScheduler):
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return cls(SchedulerConfig(max_num_batched_tokens=budget), kv, 1000)


def req(rid: str, n: int, max_tokens: int = 8, base: int = 0) -> Request:
    prompt = [base + i + 1 for i in range(n)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def step(s, token: int = 7):
    plan = s.schedule()
    sampled = {c.request_id: token for c in plan.chunks if c.sample}
    return plan, s.update(plan, StepResult(sampled))


def test_prefill_only_finishes_after_first_token_and_holds_blocks():
    s = make(budget=8, cls=PrefillScheduler)
    s.add(req("a", 10))
    outs = []
    while s.has_work:
        outs += step(s)[1]
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([7], PREFILLED)]
    assert len(s.blocks("a")) == 3  # 10 tokens
    s.check_integrity()
    assert s.kv.pool.num_free == 31 - 3
    s.release("a")
    s.check_integrity()
    assert s.kv.pool.num_free == 31
    # its two full blocks stay in the prefix cache
    assert len(s.kv.pool.lookup(req("b", 10).full_block_hashes(BS, 9))) == 2


def test_aborting_a_prefill_only_request_mid_prefill_frees_it():
    s = make(budget=4, cls=PrefillScheduler)
    s.add(req("a", 10))
    step(s)
    s.abort(["a"])
    assert not s.held
    s.check_integrity()
    assert s.kv.pool.num_free == 31


def test_incoming_request_reserves_then_runs_from_its_first_token():
    s = make()
    s.expect_kv("d", local_prefill_tokens=0)
    r = req("d", 10, max_tokens=3)
    s.add(r)
    assert r.status is Status.AWAITING_KV and not s.has_work
    assert s.reserve_pending() == [r]
    assert len(r.blocks) == 3 and r.num_computed_tokens == 0
    assert not s.kv.pool.lookup(r.full_block_hashes(BS, 9))  # not published before landing
    s.check_integrity()
    out = s.admit_transferred("d", 11)
    assert out.new_token_ids == [11] and out.finish_reason is None
    assert len(s.kv.pool.lookup(r.full_block_hashes(BS, 9))) == 2
    plan, outs = step(s)
    assert plan.new_requests[0].request_id == "d"
    assert plan.chunks[0].start_pos == 10 and plan.chunks[0].token_ids == [11]
    _, outs2 = step(s)
    assert outs2[0].finish_reason == "length"
    s.check_integrity()
    assert s.kv.pool.num_free == 31


def test_first_token_that_stops_finishes_on_admission():
    s = make()
    s.expect_kv("d", 0)
    s.add(req("d", 6, max_tokens=1))
    s.reserve_pending()
    out = s.admit_transferred("d", 5)
    assert out.finish_reason == "length" and not s.has_work
    s.check_integrity()
    assert s.kv.pool.num_free == 31


def test_short_uncached_tail_is_prefilled_locally():
    s = make()
    s.expect_kv("d", local_prefill_tokens=16)
    s.add(req("d", 10))
    assert not s.incoming and not s.reserving and s.waiting


def test_reservation_waits_for_blocks_and_abort_frees_everything():
    s = make(num_blocks=6)  # 5 usable
    s.expect_kv("a", 0)
    s.add(req("a", 16))  # 4 blocks
    s.expect_kv("b", 0)
    s.add(req("b", 16, base=100))
    assert [r.request_id for r in s.reserve_pending()] == ["a"]
    assert [r.request_id for r in s.reserve_pending()] == []
    s.abort(["a"])
    assert [r.request_id for r in s.reserve_pending()] == ["b"]
    s.abort(["b"])
    s.check_integrity()
    assert s.kv.pool.num_free == 5 and s.num_transferring == 0


def test_prefix_hits_on_the_decode_side_are_not_reserved_again():
    s = make()
    s.add(req("warm", 9))
    while s.has_work:
        step(s)
    s.expect_kv("d", 0)
    r = req("d", 13)
    s.add(r)
    s.reserve_pending()
    assert r.num_cached_tokens == 8  # two cached blocks; two more reserved for the rest
    assert len(r.blocks) == 4
    s.abort(["d"])
    s.check_integrity()
