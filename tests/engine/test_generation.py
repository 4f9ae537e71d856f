"""Greedy generation through the whole engine equals transformers' ``generate``."""

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.loader import default_model_path
from engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give me a tip for learning to program.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    config = EngineConfig(
        cpu_weights="fp32",  # the parity path: transformers' float32 weights
        cache=CacheConfig(block_size=16, memory_gb=0.25),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    return LLM(config)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers' greedy continuation of each prompt, one at a time."""
    transformers = pytest.importorskip("transformers")
    path = Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is just a token
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            out.append(gen[0, len(p) :].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_one_at_a_time_matches_transformers(llm, prompts, reference):
    llm.core.kv.pool.reset_prefix_cache()
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert got == reference


def test_greedy_batched_matches_transformers(llm, prompts, reference):
    llm.core.kv.pool.reset_prefix_cache()
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    llm.core.check_integrity()


def test_greedy_from_prefix_cache_matches_transformers(llm, prompts, reference):
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # warm the cache
    results = llm.generate(prompts, GREEDY)
    assert all(r.num_cached_tokens > 0 for r in results)
    assert [r.token_ids for r in results] == reference
    llm.core.check_integrity()


def test_a_text_prompt_is_tokenized_and_its_completion_decoded(llm, prompts):
    """``LLM.generate`` takes text as well as token ids (as the model's tokenizer reads
    it), with default sampling; a prompt of anything else is a clear TypeError."""
    import numpy as np

    text = llm.tokenizer.decode(prompts[0], skip_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    [as_text] = llm.generate([text], params)
    [as_ids] = llm.generate([np.array(prompts[0])], params)
    assert as_text.token_ids == as_ids.token_ids
    assert as_text.text == llm.tokenizer.decode(as_ids.token_ids) and as_ids.text is None
    assert llm.generate(["Hello"])[0].finish_reason in ("stop", "length")
    with pytest.raises(TypeError, match="list of token ids"):
        llm.generate([["a", "b"]])
