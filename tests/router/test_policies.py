"""Routing policies on hand-made candidates: each decides as documented."""

from __future__ import annotations

from collections import Counter

import pytest

from router.policies import POLICIES, Candidate, get_policy


def test_every_policy_is_reachable_by_name_and_refuses_unknown_names():
    assert set(POLICIES) == {"cache_aware", "load_aware", "round_robin", "random"}
    for name in POLICIES:
        for role in ("prefill", "decode", "encode"):
            assert get_policy(name, role, seed=0).select([Candidate("w")], 10) == 0
    with pytest.raises(ValueError, match="cache_aware"):
        get_policy("psychic", "prefill")
    with pytest.raises(ValueError, match="one of the pools"):
        get_policy("random", "vision")


def test_cache_aware_sends_an_image_where_its_embeddings_are_unless_the_queue_costs_more():
    policy = get_policy("cache_aware", "encode")
    holder = Candidate("holder", hit_tokens=256, tokens_per_s=1000.0)
    other = Candidate("other", tokens_per_s=1000.0)
    assert policy.select([other, holder], 256) == 1  # nothing to compute there
    busy = Candidate("holder", hit_tokens=256, queued_tokens=4096, tokens_per_s=1000.0)
    assert policy.select([other, busy], 256) == 0  # 4 s of queue against 0.26 s of work


def test_round_robin_walks_the_pool():
    policy = get_policy("round_robin", "decode")
    pool = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [policy.select(pool, 5) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_random_covers_the_pool_evenly():
    policy = get_policy("random", "prefill", seed=1)
    picks = Counter(policy.select([Candidate("a"), Candidate("b")], 5) for _ in range(2000))
    assert 900 < picks[0] < 1100


def test_load_aware_never_picks_the_busiest_of_two():
    policy = get_policy("load_aware", "prefill", seed=3)
    pool = [Candidate("idle"), Candidate("busy", queued_tokens=5000, inflight=3)]
    assert all(policy.select(pool, 100) == 0 for _ in range(50))
    decode = get_policy("load_aware", "decode", seed=3)
    pool = [Candidate("a", inflight=9), Candidate("b", inflight=2), Candidate("c", inflight=5)]
    picks = Counter(decode.select(pool, 100) for _ in range(300))
    assert picks[0] == 0 and picks[1] > picks[2]  # the busiest never wins a pair


def test_cache_aware_prefill_prefers_the_cached_prefix_until_the_queue_outweighs_it():
    policy = get_policy("cache_aware", "prefill")
    cold, warm = Candidate("cold"), Candidate("warm", hit_tokens=900)
    assert policy.select([cold, warm], 1000) == 1
    busy_warm = Candidate("warm", hit_tokens=900, queued_tokens=950)
    assert policy.select([cold, busy_warm], 1000) == 0  # 1000 uncached < 100 + 950 queued


def test_cache_aware_prefill_weighs_the_measured_rate():
    policy = get_policy("cache_aware", "prefill")
    slow = Candidate("slow", hit_tokens=500, tokens_per_s=100.0)  # 5 s for the rest
    fast = Candidate("fast", tokens_per_s=1000.0)  # 1 s for all of it
    assert policy.select([slow, fast], 1000) == 1


def test_cache_aware_spreads_a_prefix_every_worker_holds():
    policy = get_policy("cache_aware", "prefill")
    pool = [Candidate("a", hit_tokens=512), Candidate("b", hit_tokens=512)]
    assert Counter(policy.select(pool, 600) for _ in range(10)) == {0: 5, 1: 5}


def test_cache_aware_decode_prefers_the_worker_holding_the_conversation_unless_overloaded():
    policy = get_policy("cache_aware", "decode")
    holder = Candidate("holder", hit_tokens=800, inflight=3)
    other = Candidate("other", inflight=2)
    assert policy.select([holder, other], 900) == 0
    overloaded = Candidate("holder", hit_tokens=800, inflight=12)
    assert policy.select([overloaded, other], 900) == 1
