"""Prompt logprobs computed in the prefill: equal to a full forward of the prompt, in
chunks and with the prompt already in the prefix cache (which such a request does not
use, while others still do), delivered once on the request's first output, with overlap
scheduling too, and with every KV block accounted for."""

from __future__ import annotations

import pytest
import torch
from helpers import forward_tokens

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.messages import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP = 3


@pytest.fixture(scope="module")
def core(one_torch_thread) -> EngineCore:
    """Chunks of at most 24 tokens, so a 60-token prompt is prefilled in three steps."""
    return EngineCore(
        EngineConfig(
            cache=CacheConfig(block_size=16, memory_gb=0.05),
            scheduler=SchedulerConfig(max_num_batched_tokens=24),
        )
    )


@pytest.fixture(scope="module")
def prompt(core: EngineCore) -> list[int]:
    text = "The river ran past the old mill, where the miller's daughter sat counting " * 4
    ids = core.tokenizer.encode(text, add_special_tokens=True)
    assert len(ids) > 48
    return ids


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Every output of each request, stepping the engine until all finish."""
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (ids, sampling) in requests.items():
        assert core.add_request(EngineRequest(rid, ids, sampling)) is None
    while core.has_work:
        for out in core.step():
            outputs[out.request_id].append(out)
    core.check_integrity()
    return outputs


def expected(core: EngineCore, prompt: list[int]) -> torch.Tensor:
    """Log-softmax of the model's logits at every prompt position, in one forward pass."""
    return forward_tokens(core.runner.model, prompt).log_softmax(-1)


def check(entries, prompt: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = reference[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=2e-3)
        given = row[prompt[i]].item()
        assert int((row > given + 2e-3).sum()) < entry.rank <= int((row > given - 2e-3).sum())
        values, _ = row.topk(TOP)
        assert entry.top_logprobs == pytest.approx(values.tolist(), abs=2e-3)
        assert [row[t].item() for t in entry.top_ids] == pytest.approx(values.tolist(), abs=2e-3)


def test_chunked_prefill_matches_one_forward_even_with_the_prompt_cached(core, prompt):
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    warm = run(core, {"warm": (prompt, greedy)})["warm"]
    assert warm[0].prompt_logprobs is None
    asking = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)
    outs = run(core, {"asks": (prompt, asking)})["asks"]
    assert outs[0].num_cached_tokens == 0  # the cached prompt was computed again
    check(outs[0].prompt_logprobs, prompt, expected(core, prompt))
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert [t for o in outs for t in o.new_token_ids] == [t for o in warm for t in o.new_token_ids]
    again = run(core, {"again": (prompt, greedy)})["again"]
    assert again[0].num_cached_tokens >= 48  # others still use the cache


def test_prompt_logprobs_in_a_batch_and_with_overlap_scheduling(core, prompt):
    short = prompt[:20]
    overlapped = EngineCore(core.config.replace(overlap_scheduling=True))
    for engine in (core, overlapped):
        outs = run(engine, {
            "a": (prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)),
            "b": (short, SamplingParams(temperature=0.0, max_tokens=4)),
            "c": (short, SamplingParams(temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=1,
                                        logprobs=2)),
            "d": (prompt[:1], SamplingParams(max_tokens=2, prompt_logprobs=2)),
        })  # fmt: skip
        entries = outs["a"][0].prompt_logprobs
        reference = expected(engine, prompt)
        assert len(entries) == len(prompt) and all(e.top_ids == [] for e in entries[1:])
        for i, entry in enumerate(entries[1:], start=1):
            assert entry.logprob == pytest.approx(reference[i - 1, prompt[i]].item(), abs=2e-3)
        assert outs["b"][0].prompt_logprobs is None
        assert [len(e.top_ids) for e in outs["c"][0].prompt_logprobs[1:]] == [1] * 19
        assert outs["c"][0].logprobs is not None  # sampled-token logprobs still come
        assert outs["d"][0].prompt_logprobs == [None]
        for out in outs.values():
            assert sum(o.prompt_logprobs is not None for o in out) <= 1
