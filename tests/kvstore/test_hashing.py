from kvstore.hashing import ROOT_HASH, block_hash, extra_keys, hash_chain


def test_block_hash_is_stable_and_chained():
    h1 = block_hash(ROOT_HASH, [1, 2, 3])
    assert h1 == block_hash(ROOT_HASH, [1, 2, 3])
    assert len(h1) == 16
    assert block_hash(h1, [4]) != block_hash(ROOT_HASH, [4])
    assert block_hash(ROOT_HASH, [1, 2, 3], b"salt") != h1
    # pinned value: the hash must not change across processes, hosts or releases
    assert h1.hex() == "314bcfbba8cda5e99f59a8edb9f7a5f5"


def test_hash_chain_covers_full_blocks_only():
    chain = hash_chain(list(range(40)), 16)
    assert len(chain) == 2
    assert chain[1] == block_hash(chain[0], list(range(16, 32)))


def test_extra_keys_are_length_prefixed():
    assert extra_keys("ab", "c") != extra_keys("a", "bc")
    assert extra_keys("a", None) == extra_keys("a")
