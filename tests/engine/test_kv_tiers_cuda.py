"""The tiers under a GPU KV cache: pinned host slots, write-through gathered off the GPU,
loads back onto it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_kv_tiers import PROMPT_A, PROMPT_B, Engine, assert_blocks_hold_their_content

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pinned_host_tier_and_files_under_a_gpu_cache(tmp_path):
    e = Engine(7, tmp_path, host_slots=8, device="cuda")
    assert e.kv.tiers.host.slots.is_pinned()
    e.run("a", PROMPT_A)
    e.run("b", PROMPT_B)
    req = Request("a2", PROMPT_A, SamplingParams(max_tokens=2))
    e.sched.add(req)
    e.step()
    assert_blocks_hold_their_content(e, req, 4)
    assert e.kv.hit_tokens_by_tier["host"] > 0
    while e.sched.has_work:
        e.step()
    e.close()
    fresh = Engine(32, tmp_path, device="cuda")
    req = Request("a3", PROMPT_A, SamplingParams(max_tokens=2))
    fresh.sched.add(req)
    fresh.step()
    assert req.num_cached_tokens == 16 and fresh.kv.hit_tokens_by_tier["file"] == 16
    assert_blocks_hold_their_content(fresh, req, 4)
    fresh.close()


def test_greedy_output_is_the_same_from_every_tier_on_a_gpu(tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(model="dummy:tiny", device="cuda", dtype="bfloat16",
                          cache=CacheConfig(block_size=16, num_blocks=12, host_memory_gb=0.01,
                                            kv_dir=str(tmp_path)))  # fmt: skip
    llm = LLM(config)
    a, b = list(range(10, 150)), list(range(300, 440))  # 8 full blocks each; 11 usable
    (first,) = llm.generate([a], greedy)
    llm.generate([b], greedy)
    (again,) = llm.generate([a], greedy)
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 128
    assert llm.core.kv.hit_tokens_by_tier["host"] > 0
    llm.core.check_integrity()
    llm.core.kv.tiers.close()
    other = LLM(config)
    (loaded,) = other.generate([a], greedy)
    assert loaded.token_ids == first.token_ids and loaded.num_cached_tokens == 128
    assert other.core.kv.hit_tokens_by_tier["file"] == 128
    other.core.kv.tiers.close()
