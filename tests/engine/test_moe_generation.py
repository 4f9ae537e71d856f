"""Greedy generation of DeepSeek-V3 and Qwen3-MoE through the whole engine equals
transformers' ``generate`` on the same tiny random checkpoints: one prompt at a time,
all prompts batched, and with their prefixes served from the cache.

The step budget (48 tokens) is below the longer prompts, so they prefill in chunks that
share steps with other sequences' decodes: MLA's prefill path (decompressed keys and
values over the cached latents) and its decode path (absorbed projections) both run.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import CONFIGS, load_reference

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

NEW_TOKENS = 32
PROMPT_LENS = [7, 23, 40, 61, 90, 33]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tiny_moe_dir):
    """(engine, prompts, transformers' greedy continuation of each prompt alone)."""
    folder = tiny_moe_dir(request.param)
    llm = LLM(EngineConfig(
        model=str(folder), num_threads=1, cache=CacheConfig(block_size=16, num_blocks=96),
        scheduler=SchedulerConfig(max_num_batched_tokens=48),
    ))  # fmt: skip
    prompts = _prompts(llm.core.model_config.vocab_size)
    ref = load_reference(folder)
    ref.generation_config.eos_token_id = None  # like ignore_eos: EOS is just a token
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = ref.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
            expected.append(out[0, len(p) :].tolist())
    return llm, prompts, expected


def test_greedy_one_at_a_time_matches_transformers(case):
    llm, prompts, expected = case
    llm.core.kv.pool.reset_prefix_cache()
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected


def test_greedy_batched_matches_transformers(case):
    llm, prompts, expected = case
    llm.core.kv.pool.reset_prefix_cache()
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    llm.core.check_integrity()


def test_greedy_from_prefix_cache_matches_transformers(case):
    llm, prompts, expected = case
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # warm the cache
    results = llm.generate(prompts, GREEDY)
    assert [r.num_cached_tokens for r in results] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    assert [r.token_ids for r in results] == expected
