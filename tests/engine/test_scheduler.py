"""Scheduler decisions, driven step by step with synthetic sampled tokens (no model)."""

import random

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.plan import StepResult
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

EOS = 2


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=1024, caching=True):
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, kv, max_len)


def req(rid, prompt, max_tokens=4, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), (EOS,))


def run_step(s, token=lambda rid: 100):
    plan = s.schedule()
    sampled = {c.request_id: token(c.request_id) for c in plan.chunks if c.sample}
    return plan, s.update(plan, StepResult(sampled))


def run_to_end(s, token=lambda rid: 100, limit=1000):
    finished = {}
    for _ in range(limit):
        if not s.has_work:
            break
        _, outs = run_step(s, token)
        for o in outs:
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        s.check_integrity()
    return finished


def test_long_prompt_is_chunked_under_the_token_budget():
    s = make(budget=8)
    s.add(req("a", range(10, 30)))
    plan, outs = run_step(s)
    assert [(c.start_pos, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 8, False)]
    assert outs == []
    plan, _ = run_step(s)
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(8, 8)]
    plan, outs = run_step(s)
    assert [(c.start_pos, c.num_tokens, c.sample) for c in plan.chunks] == [(16, 4, True)]
    assert outs[0].new_token_ids == [100]


def test_decodes_and_new_prefill_share_a_step():
    s = make(budget=16)
    s.add(req("a", range(10, 14), max_tokens=8))
    run_step(s)
    s.add(req("b", range(20, 40)))
    plan, _ = run_step(s)
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 15)]
    assert plan.num_tokens <= 16


def test_stop_conditions():
    s = make()
    s.add(req("len", range(10, 14), max_tokens=3))
    s.add(req("eos", range(10, 14), max_tokens=10))
    s.add(req("ign", range(10, 14), max_tokens=3, ignore_eos=True))
    s.add(req("tok", range(10, 14), max_tokens=10, stop_token_ids=(77,)))
    s.add(req("min", range(10, 14), max_tokens=10, min_tokens=2))
    counts = {}

    def token(rid):
        counts[rid] = counts.get(rid, 0) + 1
        return {"eos": EOS, "ign": EOS, "tok": 77, "min": EOS}.get(rid, 100)

    finished = run_to_end(s, token)
    assert finished == {
        "len": "length",
        "eos": "stop",
        "ign": "length",
        "tok": "stop",
        "min": "stop",
    }
    assert counts == {"len": 3, "eos": 1, "ign": 3, "tok": 1, "min": 2}


def test_context_limit_finishes_with_length():
    s = make(max_len=8)
    s.add(req("a", range(10, 16), max_tokens=100))
    assert run_to_end(s) == {"a": "length"}


def test_second_request_reuses_the_first_ones_full_blocks():
    s = make(block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    s.add(req("a", prompt))
    run_to_end(s)
    s.add(req("b", prompt))
    plan, outs = run_step(s)
    assert plan.chunks[0].start_pos == 12 and plan.chunks[0].num_tokens == 1
    assert outs[0].num_cached_tokens == 12


def test_identical_prompts_in_one_step_share_blocks():
    s = make(block_size=4)
    prompt = list(range(10, 23))
    s.add(req("a", prompt))
    s.add(req("b", prompt))
    plan, outs = run_step(s)
    a, b = plan.chunks
    assert (a.start_pos, b.start_pos) == (0, 12)
    assert a.block_ids[:3] == b.block_ids[:3]
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 12}
    s.check_integrity()


def test_a_whole_prompt_hit_still_computes_the_last_token():
    s = make(block_size=4)
    prompt = list(range(10, 22))  # exactly 3 blocks
    s.add(req("a", prompt))
    run_to_end(s)
    s.add(req("b", prompt))
    plan, _ = run_step(s)
    assert (plan.chunks[0].start_pos, plan.chunks[0].num_tokens) == (8, 4)


def test_out_of_blocks_preempts_the_newest_and_recomputes_it():
    s = make(num_blocks=9, block_size=4, budget=64)  # 8 usable blocks
    s.add(req("old", range(10, 22), max_tokens=12))  # 3 blocks, grows to 6
    s.add(req("new", range(30, 38), max_tokens=12))  # 2 blocks, grows to 5
    finished = run_to_end(s)
    assert finished == {"old": "length", "new": "length"}
    assert s.num_preemptions >= 1
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_abort_frees_blocks_in_any_state():
    s = make(budget=4)
    s.add(req("run", range(10, 30)))
    s.add(req("wait", range(40, 60)))
    run_step(s)
    s.abort(["run", "wait", "unknown"])
    assert not s.has_work
    s.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_usable
    plan = s.schedule()
    assert plan.finished_ids == ["run"]  # the runner only knew "run"


def test_random_workload_with_aborts_keeps_bookkeeping_exact():
    rng = random.Random(0)
    s = make(num_blocks=40, block_size=4, budget=24, max_seqs=6)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    next_id = 0
    for _ in range(300):
        if rng.random() < 0.3:
            prompt = shared[: rng.randrange(1, 9)] + [
                rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))
            ]
            s.add(req(str(next_id), prompt, max_tokens=rng.randrange(1, 12)))
            next_id += 1
        if s.requests and rng.random() < 0.1:
            s.abort([rng.choice(list(s.requests))])
        if s.has_work:
            run_step(s, lambda rid: rng.choice([EOS, 100, 101, 102, 103]))
        s.check_integrity()
    run_to_end(s)
    assert s.kv.pool.num_free == s.kv.pool.num_usable
