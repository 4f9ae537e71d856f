"""The expert-parallel load balancer alone (``engine.ep.eplb``): a pure function of counts.

Counts follow Zipf's law (the k-th hottest expert gets a share proportional to k^-s),
s = 1.0 and 1.5, over 64 and 256 experts, for groups of 8 and 32 ranks with one
redundant slot per rank: 4 layers of 2M routed pairs each, every layer its own ranking
of the experts. Where the slots make an even spread possible (``packing_bound`` <= 1.05:
no packing of the replicas can do better than that bound) the largest rank load is within
5% of the mean; elsewhere within 5% of the bound. Beside it, the same counts without
redundant slots: always worse, and at s = 1.5 many times the mean.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.ep import eplb

LAYERS = 4


def zipf_counts(num_experts: int, s: float, seed: int = 0, pairs: int = 2_000_000) -> np.ndarray:
    """[LAYERS, num_experts] sampled counts, each layer with its own hottest experts."""
    rng = np.random.default_rng(seed)
    share = 1.0 / np.arange(1, num_experts + 1) ** s
    share /= share.sum()
    return np.stack([rng.multinomial(pairs, rng.permutation(share)) for _ in range(LAYERS)])


@pytest.mark.parametrize(("s", "experts", "ranks"),
                         list(itertools.product((1.0, 1.5), (64, 256), (8, 32))))  # fmt: skip
def test_one_redundant_slot_per_rank_evens_out_zipf_load(s, experts, ranks):
    load = zipf_counts(experts, s)
    slots = experts + ranks
    placed = eplb.rebalance(load, ranks, slots)
    balance = eplb.imbalance(load, placed, ranks)
    bound = eplb.packing_bound(load, ranks, slots)
    plain = eplb.imbalance(load, eplb.rebalance(load, ranks, experts), ranks)
    report = (f"s={s} E={experts} N={ranks}: max/mean {np.round(balance, 3)}, bound "
              f"{np.round(bound, 3)}, without redundancy {np.round(plain, 3)}")  # fmt: skip
    for layer in range(LAYERS):
        limit = 1.05 if bound[layer] <= 1.05 else 1.05 * bound[layer]
        assert balance[layer] <= limit, report
        assert balance[layer] < plain[layer], report
    if s == 1.5:
        assert (plain > 3).all(), report  # what the redundant slots are for


@pytest.mark.parametrize(("experts", "ranks", "slots"), [(16, 4, 20), (64, 8, 72), (8, 2, 8)])
def test_a_placement_holds_every_expert_and_fills_every_rank(experts, ranks, slots):
    load = zipf_counts(experts, 1.2, seed=3)
    placed = eplb.rebalance(load, ranks, slots)
    assert placed.shape == (LAYERS, slots)
    per_rank = slots // ranks
    for row, counts in zip(placed, load):
        assert set(row.tolist()) == set(range(experts))
        for r in range(ranks):  # no rank holds two replicas of one expert
            mine = row[r * per_rank : (r + 1) * per_rank]
            assert len(set(mine.tolist())) == per_rank
        assert eplb.rank_loads(counts[None], row[None], ranks).sum() == pytest.approx(counts.sum())


def test_the_hottest_experts_get_the_replicas():
    load = np.array([100, 1, 1, 1, 50, 1, 1, 1], dtype=float)
    counts = eplb.replicate(load, 12)
    assert counts.tolist() == [4, 1, 1, 1, 2, 1, 1, 1]
    assert (load / counts).max() == pytest.approx(min(
        max(100 / a, 50 / (6 - a)) for a in range(1, 6)
    ))  # greedy is optimal for the largest load per replica


def test_replication_minimises_the_largest_load_per_replica():
    rng = np.random.default_rng(7)
    for _ in range(20):
        load = rng.integers(1, 100, 5).astype(float)
        counts = eplb.replicate(load, 9)
        best = min((load / np.array(c)).max()
                   for c in itertools.product(range(1, 6), repeat=5) if sum(c) == 9)  # fmt: skip
        assert (load / counts).max() == pytest.approx(best)


def test_the_policy_is_deterministic():
    load = zipf_counts(64, 1.0, seed=5)
    assert np.array_equal(eplb.rebalance(load, 8, 72), eplb.rebalance(load.copy(), 8, 72))


def test_across_nodes_each_expert_group_stays_on_one_node():
    """DeepSeek-V3 routes each token to at most ``topk_group`` groups: with each group on
    one node, a token's experts span at most that many nodes."""
    experts, groups, ranks, nodes = 64, 8, 8, 2
    load = zipf_counts(experts, 1.0, seed=11)
    placed = eplb.rebalance(load, ranks, experts + ranks, num_nodes=nodes, num_groups=groups)
    per_node = (experts + ranks) // nodes
    for row in placed:
        node_of = {}
        for slot, expert in enumerate(row.tolist()):
            node_of.setdefault(expert // (experts // groups), set()).add(slot // per_node)
        assert all(len(n) == 1 for n in node_of.values())
        assert set(row.tolist()) == set(range(experts))
    flat = eplb.rebalance(load, ranks, experts + ranks)
    balance = eplb.imbalance(load, placed, ranks)
    assert (balance <= eplb.imbalance(load, flat, ranks) * 1.25).all()  # the price is small


def test_before_any_load_each_rank_holds_a_block_of_experts():
    placed = eplb.initial_placement(2, 16, 4, 20)
    assert placed[0].tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12,
                                  12, 13, 14, 15, 0]  # fmt: skip
    assert (placed[0] == placed[1]).all()
    with pytest.raises(ValueError, match="split evenly"):
        eplb.initial_placement(1, 16, 3, 18)


def test_balance_of_a_layer_without_load_is_even():
    load = np.zeros((1, 8))
    assert eplb.imbalance(load, eplb.initial_placement(1, 8, 2, 8), 2).tolist() == [1.0]
