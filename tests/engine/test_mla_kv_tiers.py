"""MLA latent blocks through the KV tiers: a DeepSeek-V3 prefix evicted to host memory, or
written to files and read by a new engine, comes back into the latent cache and greedy
output is the same as when it was computed."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(folder, **cache) -> LLM:
    return LLM(EngineConfig(model=str(folder), num_threads=1,
                            cache=CacheConfig(block_size=BS, **cache)))  # fmt: skip


def _prompt(seed: int, n: int = 100) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_evicted_latents_come_back_from_host_memory(tiny_moe_dir):
    engine = _engine(tiny_moe_dir("deepseek-v3"), num_blocks=9, host_memory_gb=0.01)
    assert [c.name for c in engine.core.kv_cache.layout.components] == ["latent"]
    a, b = _prompt(1), _prompt(2)
    (first,) = engine.generate([a], GREEDY)
    engine.generate([b], GREEDY)  # 8 usable blocks: b evicts a's
    (again,) = engine.generate([a], GREEDY)
    assert engine.core.kv.hit_tokens_by_tier["host"] > 0
    assert again.num_cached_tokens == (len(a) - 1) // BS * BS
    assert again.token_ids == first.token_ids
    engine.core.check_integrity()


def test_a_new_engine_reads_latents_from_the_file_tier(tiny_moe_dir, tmp_path):
    folder, kv_dir = tiny_moe_dir("deepseek-v3"), tmp_path / "kv"
    writer = _engine(folder, num_blocks=32, kv_dir=str(kv_dir))
    prompt = _prompt(3)
    (computed,) = writer.generate([prompt], GREEDY)
    writer.core.kv.tiers.close()  # flushes the writes
    assert computed.num_cached_tokens == 0
    assert len(list(kv_dir.rglob("*.kv"))) == len(prompt) // BS
    reader = _engine(folder, num_blocks=32, kv_dir=str(kv_dir))
    (loaded,) = reader.generate([prompt], GREEDY)
    assert loaded.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert reader.core.kv.hit_tokens_by_tier["file"] == loaded.num_cached_tokens
    assert loaded.token_ids == computed.token_ids
    reader.core.kv.tiers.close()
