"""The tiers under the real model: greedy output is the same whether a prefix is computed,
reloaded from host memory or read from files, and a damaged file is caught, removed and
its block recomputed."""

from __future__ import annotations

import shutil

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from kvstore.hashing import extra_keys

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TEXT = "The lighthouse keeper wrote down the passing ships, the wind and the tide. " * 6


def llm(**cache) -> LLM:
    return LLM(EngineConfig(cpu_weights="fp32", cache=CacheConfig(block_size=16, **cache)))


@pytest.fixture(scope="module")
def written(tmp_path_factory, one_torch_thread):
    """A prompt computed once with a file tier: its directory and greedy output."""
    kv_dir = tmp_path_factory.mktemp("kv")
    engine = llm(num_blocks=64, kv_dir=str(kv_dir))
    prompt = engine.chat_prompt([{"role": "user", "content": TEXT}])
    (out,) = engine.generate([prompt], GREEDY)
    engine.core.kv.tiers.close()
    assert out.num_cached_tokens == 0
    return kv_dir, prompt, out.token_ids


def test_evicted_prefix_comes_back_from_host_memory(one_torch_thread):
    engine = llm(num_blocks=16, host_memory_gb=0.05)  # 15 blocks: one prompt at a time
    a = engine.chat_prompt([{"role": "user", "content": TEXT}])
    b = engine.chat_prompt([{"role": "user", "content": TEXT.upper()}])
    (first,) = engine.generate([a], GREEDY)
    engine.generate([b], GREEDY)  # evicts most of a's blocks from the device cache
    (again,) = engine.generate([a], GREEDY)
    kv = engine.core.kv
    assert kv.hit_tokens_by_tier["host"] > 0
    assert again.num_cached_tokens == (len(a) - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    engine.core.check_integrity()
    assert kv.pool.num_free == kv.pool.num_usable


def test_a_new_engine_reads_the_prefix_from_files(written, tmp_path, one_torch_thread):
    kv_dir, prompt, tokens = written
    shutil.copytree(kv_dir, tmp_path / "kv")
    engine = llm(num_blocks=64, kv_dir=str(tmp_path / "kv"))
    (out,) = engine.generate([prompt], GREEDY)
    assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert engine.core.kv.hit_tokens_by_tier["file"] == out.num_cached_tokens
    assert out.token_ids == tokens
    engine.core.kv.tiers.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_block_file_is_removed_and_recomputed(written, tmp_path, damage):
    kv_dir, prompt, tokens = written
    shutil.copytree(kv_dir, tmp_path / "kv")
    engine = llm(num_blocks=64, kv_dir=str(tmp_path / "kv"))
    tiers = engine.core.kv.tiers
    bad = 2  # the third block of the prompt
    probe = Request(
        "x", prompt, GREEDY, hash_extra=extra_keys(engine.core.model_config.fingerprint)
    )
    hashes = probe.full_block_hashes(16, len(prompt))
    path = tiers.file.path(hashes[bad])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        for i in (100, len(data) // 2, len(data) - 1):
            data[i] ^= 0x5A
    else:
        del data[len(data) // 2 :]
    path.write_bytes(data)
    (out,) = engine.generate([prompt], GREEDY)
    assert out.token_ids == tokens
    assert out.num_cached_tokens == bad * 16  # whole blocks before the bad one
    assert tiers.file.stats()["checksum_failures"] == 1
    tiers.file.flush()  # the recomputed block was written again, soundly
    assert tiers.file.load(hashes[bad]) is not None
    assert tiers.file.stats()["checksum_failures"] == 1
    engine.core.check_integrity()
    tiers.close()
    assert not list((tmp_path / "kv").rglob("*.tmp"))
