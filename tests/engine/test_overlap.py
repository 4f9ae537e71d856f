"""Overlap scheduling: step N+1 is planned and launched before step N's tokens are back.
It must change nothing a client sees: the same tokens, finish reasons and logprobs as
planning after every step, through EOS and length stops, preemption, aborts mid-flight
and requests that cannot overlap, on MLA and MoE models too, with every KV block
accounted for."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.messages import EngineRequest
from engine.sampling_params import GrammarSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engines(model: str = "default", **config) -> tuple[LLM, LLM]:
    base = EngineConfig(model=model, **config)
    return LLM(base.replace(overlap_scheduling=False)), LLM(base.replace(overlap_scheduling=True))


def prompts(llm: LLM, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    topics = ["the sea", "a robot", "bread", "winter", "a violin", "chess", "rain", "bees"]
    return [llm.chat_prompt([{"role": "user", "content": f"Write {rng.randrange(1, 4)} "
                                                       f"sentences about {topics[i % 8]}."}])
            for i in range(n)]  # fmt: skip


def same(a, b) -> None:
    assert [(c.token_ids, c.finish_reason) for c in a] == [
        (c.token_ids, c.finish_reason) for c in b
    ]


def test_overlapped_steps_give_the_same_tokens_greedy_and_seeded():
    plain, overlapped = engines()
    batch = prompts(plain, 8)
    sampling = [SamplingParams(temperature=0, max_tokens=[5, 40, 64, 3, 64, 17, 64, 1][i])
                for i in range(8)]  # fmt: skip
    reference = plain.generate(batch, sampling)
    assert {c.finish_reason for c in reference} == {"stop", "length"}  # both stops happen
    same(reference, overlapped.generate(batch, sampling))
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=48, logprobs=2)
              for i in range(8)]  # fmt: skip
    a, b = plain.generate(batch, seeded), overlapped.generate(batch, seeded)
    same(a, b)
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    overlapped.core.check_integrity()
    assert overlapped.core.kv.pool.num_free == overlapped.core.kv.pool.num_usable


def test_overlap_survives_preemption_in_a_small_cache():
    config = {"cache": CacheConfig(num_blocks=24, block_size=16),
              "scheduler": SchedulerConfig(max_num_batched_tokens=256)}  # fmt: skip
    plain, overlapped = engines(**config)
    batch = prompts(plain, 6, seed=1)
    sampling = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reference = plain.generate(batch, sampling)
    result = overlapped.generate(batch, sampling)
    same(reference, result)
    assert overlapped.core.scheduler.num_preemptions > 0
    overlapped.core.check_integrity()


def overlapped_steps(llm: LLM, batch, sampling) -> tuple[list, int]:
    """``llm.generate(batch, sampling)`` and how many of its steps were left running while
    the next was planned."""
    core, step, left = llm.core, llm.core.step, [0]

    def counted():
        out = step()
        left[0] += core._inflight is not None
        return out

    core.step = counted
    try:
        return llm.generate(batch, sampling), left[0]
    finally:
        core.step = step


def test_penalties_and_min_tokens_overlap_and_still_match():
    """Penalties and min_tokens read a request's outputs: the tokens of the step still
    running count on the device, so their steps overlap too, greedy and seeded."""
    plain, overlapped = engines()
    batch = prompts(plain, 5, seed=2)
    greedy = [SamplingParams(temperature=0, max_tokens=48, min_tokens=32),
              SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=30, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=30)]  # fmt: skip
    reference = plain.generate(batch, greedy)
    unforced = plain.generate(batch[:1], SamplingParams(temperature=0, max_tokens=48))
    assert len(unforced[0].token_ids) < 32 <= len(reference[0].token_ids)  # held back
    result, left = overlapped_steps(overlapped, batch, greedy)
    same(reference, result)
    assert left > 20
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, min_tokens=12,
                             frequency_penalty=0.4 * i, repetition_penalty=1.0 + 0.1 * i)
              for i in range(5)]  # fmt: skip
    same(plain.generate(batch, seeded), overlapped.generate(batch, seeded))
    overlapped.core.check_integrity()


def test_structured_requests_overlap_and_still_match():
    """A structured request's next mask needs its grammar advanced by the step still
    running: the next step's forward is queued before that step is collected, its
    sampling after. The same tokens as planning after every step, beside plain requests,
    regex and JSON, through the grammar's end."""
    plain, overlapped = engines()
    batch = prompts(plain, 4, seed=3)
    sampling = [
        SamplingParams(temperature=0, max_tokens=24,
                       grammar=GrammarSpec(kind="regex", value="[a-z ]{5,20}\\.")),
        SamplingParams(temperature=0, max_tokens=40, grammar=GrammarSpec(
            kind="json", value='{"type":"object","properties":{"name":{"type":"string",'
                               '"maxLength":12}},"required":["name"]}')),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=4, max_tokens=24,
                       grammar=GrammarSpec(kind="regex", value="(yes|no|maybe)( [a-z]+){2,6}")),
    ]  # fmt: skip
    reference = plain.generate(batch, sampling)
    assert reference[1].finish_reason == "stop"  # the grammar ended it
    result, left = overlapped_steps(overlapped, batch, sampling)
    same(reference, result)
    assert left > 10
    overlapped.core.check_integrity()
    assert overlapped.core.kv.pool.num_free == overlapped.core.kv.pool.num_usable


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_overlap_gives_the_same_greedy_tokens_with_mla_and_moe_models(preset):
    """MLA's latent KV cache and routed experts under overlap, in a cache small enough to
    preempt: the same greedy tokens as without, every KV block accounted for."""
    config = {"cache": CacheConfig(num_blocks=20, block_size=4),
              "scheduler": SchedulerConfig(max_num_batched_tokens=32)}  # fmt: skip
    plain, overlapped = engines(f"dummy:{preset}", num_threads=1, **config)
    batch = [[3 + i, 5, 7, 11, 13, 17 + i] * (i + 1) for i in range(5)]
    sampling = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                for m in (12, 20, 5, 20, 1)]  # fmt: skip
    same(plain.generate(batch, sampling), overlapped.generate(batch, sampling))
    assert overlapped.core.scheduler.num_preemptions > 0
    overlapped.core.check_integrity()
    assert overlapped.core.kv.pool.num_free == overlapped.core.kv.pool.num_usable


def test_aborting_a_request_while_its_step_runs_frees_everything():
    core = EngineCore(EngineConfig(model="dummy:tiny", num_threads=1, overlap_scheduling=True,
                                   cache=CacheConfig(num_blocks=64, block_size=4)))  # fmt: skip
    sampling = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        core.add_request(EngineRequest(f"r{i}", [1 + i, 2, 3, 4, 5, 6, 7], sampling))
    seen: dict[str, int] = {}
    for _ in range(5):
        for out in core.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
    assert core._inflight is not None  # a step is running while we abort
    core.abort(["r1", "r2"])
    while core.has_work:
        for out in core.step():
            assert out.request_id not in ("r1", "r2")
            seen[out.request_id] += len(out.new_token_ids)
    assert seen["r0"] == seen["r3"] == 50
    core.check_integrity()
    assert core.kv.pool.num_free == core.kv.pool.num_usable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_decode_on_cuda_gives_the_same_tokens_with_graphs():
    """On the GPU the next step's input token goes from the running step's output to the
    graph's input buffer on the device, and the tokens come back behind their own step."""
    base = EngineConfig(model="dummy:tiny", device="cuda", dtype="bfloat16",
                        cache=CacheConfig(num_blocks=256, block_size=16))  # fmt: skip
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batch = [[3 + i, 5, 7, 11, 13, 17 + i] * (i + 1) for i in range(6)]
    plain = LLM(base).generate(batch, sampling)
    overlapped = LLM(base.replace(overlap_scheduling=True))
    same(plain, overlapped.generate(batch, sampling))
    overlapped.core.check_integrity()
