from router.pairing import Candidate, Pair, RoundRobin, get_policy


def test_round_robin_walks_each_pool_independently():
    policy = get_policy("round_robin")
    assert isinstance(policy, RoundRobin)
    p = [Candidate("p0"), Candidate("p1")]
    d = [Candidate("d0"), Candidate("d1"), Candidate("d2")]
    picks = [policy.select(p, d, [1, 2]) for _ in range(6)]
    assert picks == [Pair(i % 2, i % 3) for i in range(6)]


def test_unknown_policy_is_refused():
    import pytest

    with pytest.raises(ValueError, match="round_robin"):
        get_policy("psychic")
