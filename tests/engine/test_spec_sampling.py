"""Sampling at temperature 1.0 with speculative decoding is sampling from the target.

On a tiny Llama whose next-token probabilities transformers computes exactly: the first
token a verify step yields (the second of each generation: the first comes from the
prompt's own step) follows the exact marginal ``sum_a q(a | prompt) q(x | prompt, a)``,
and the bigram frequencies of many short generations cannot be told from those without
speculation; chi-square at p > 0.01, with the target drafting for itself (its greedy
drafts kept about a third of the time at temperature 1) and with prompt lookup.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import chi_square_p, chi_square_two_sample_p
from hf_models import load_reference

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLES = 3000


def engine(model: str, seed: int, **spec) -> LLM:
    speculative = SpeculativeConfig()
    if spec:
        speculative = SpeculativeConfig(num_speculative_tokens=3, schedule="fixed", **spec)
    return LLM(EngineConfig(
        model=model, num_threads=1, seed=seed, cache=CacheConfig(block_size=4, num_blocks=1200),
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=1024),
        speculative=speculative,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny_moe_dir) -> str:
    return str(tiny_moe_dir("llama"))


@pytest.fixture(scope="module")
def drafters(llama) -> dict[str, dict]:
    return {"draft": dict(method="draft", draft_model=llama), "ngram": dict(method="ngram")}


@pytest.fixture(scope="module")
def prompt(llama) -> list[int]:
    """The model's own greedy continuation of a start, then the start and the first few
    tokens of it again: what it samples next often occurs in the prompt, so prompt lookup
    has drafts to propose."""
    ref = load_reference(llama)
    start = torch.tensor([[30, 31, 32]])
    with torch.inference_mode():
        gen = ref.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=24,
                           do_sample=False)[0].tolist()  # fmt: skip
    return gen + gen[:7]


@pytest.fixture(scope="module")
def second_token_distribution(llama, prompt) -> torch.Tensor:
    """P(second generated token = x | prompt), exactly, from transformers' float32 model."""
    ref = load_reference(llama)
    with torch.inference_mode():
        first = ref(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [a] for a in range(vocab)])
        second = ref(batch).logits[:, -1].double().softmax(-1)  # [a, x]
    return first @ second


@pytest.mark.parametrize("name", ["draft", "ngram", None], ids=["draft", "ngram", "none"])
def test_first_verified_token_follows_the_exact_distribution(
    name, llama, drafters, prompt, second_token_distribution
):
    llm = engine(llama, seed=11, **(drafters[name] if name else {}))
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([prompt] * SAMPLES, params)
    counts = Counter(r.token_ids[1] for r in out)
    expected = (second_token_distribution * SAMPLES).tolist()
    p = chi_square_p([counts[i] for i in range(len(expected))], expected)
    assert p > 0.01
    stats = llm.core.scheduler.stats()
    if name:  # the second token really came out of verify steps, kept drafts and rejected
        assert stats.spec_verify_groups > SAMPLES // 5
        assert 0 < sum(stats.spec_draft_accepted) < sum(stats.spec_draft_verified)


BIGRAM_PROMPTS = [[5, 6, 7, 8, 9], [100, 7, 100, 7, 100, 7], [250, 1, 2]]


def bigrams(llm: LLM, n: int, prompt: list[int]) -> Counter:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    choices = [prompt, *BIGRAM_PROMPTS]
    prompts = [choices[i % len(choices)] for i in range(n)]
    counts: Counter = Counter()
    for prompt, r in zip(prompts, llm.generate(prompts, params)):
        seq = [prompt[-1], *r.token_ids]
        counts.update(zip(seq, seq[1:]))
    return counts


@pytest.mark.parametrize("name", ["draft", "ngram"])
def test_bigram_frequencies_cannot_be_told_from_plain_sampling(name, llama, drafters, prompt):
    spec = engine(llama, seed=31, **drafters[name])
    plain = engine(llama, seed=32)
    a, b = bigrams(spec, 1500, prompt), bigrams(plain, 1500, prompt)
    assert chi_square_two_sample_p(a, b) > 0.01
    assert sum(spec.core.scheduler.stats().spec_draft_accepted) > 0
