"""A step's forward and sampling never wait for the GPU (CUDA only).

Under ``torch.cuda.set_sync_debug_mode("error")`` any synchronising call (``.item()``,
``.tolist()``, a host-to-device copy from pageable memory, a data-dependent size such as
``nonzero`` or boolean-mask indexing) raises. The step's one deliberate synchronisation,
the copy of the sampled tokens to the host (``SampledTokens.to_host``), runs after the
guarded region.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_cuda_graphs import BLOCK, make_runner, prompts

from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=64),
    "temperature": SamplingParams(temperature=0.8, max_tokens=64),
    "top_k_top_p_min_p": SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, max_tokens=64
    ),
    "seeded": SamplingParams(temperature=1.0, top_p=0.5, seed=7, max_tokens=64),
    "penalties_bias_min_tokens": SamplingParams(
        temperature=1.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        logit_bias={5: 3.0, 11: -100.0},
        min_tokens=10,
        stop_token_ids=[2],
        max_tokens=64,
    ),
    "logprobs": SamplingParams(temperature=0.5, logprobs=3, max_tokens=64),
}


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run_steps(runner, params: list[SamplingParams], steps: int, guarded: bool) -> list[list[int]]:
    """A prefill step then decode steps; each step's forward and sampling under the guard
    when ``guarded``. Returns every request's tokens."""
    batch = prompts(runner.sampler.vocab_size, [9 + 13 * i for i in range(len(params))])
    per_seq = -(-(max(map(len, batch)) + steps) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(batch))]
    ids = [f"s{i}" for i in range(len(batch))]
    plan = StepPlan(
        chunks=[ScheduledChunk(r, p, 0, t, True) for r, p, t in zip(ids, batch, tables)],
        new_requests=[
            NewRequest(r, p, sp, (2,)) for r, p, sp in zip(ids, batch, params, strict=True)
        ],
    )
    out: list[list[int]] = [[] for _ in ids]
    for step in range(steps):
        runner._sync_states(plan)
        with no_sync() if guarded else contextlib.nullcontext():
            sample_ids, sampled = runner.sample(plan)
        result = sampled.to_host()  # the deliberate copy, outside the guard
        assert result.token_ids and all(
            0 <= t < runner.sampler.vocab_size for t in result.token_ids
        )
        runner._advance(sample_ids, result.token_ids)
        for i, t in enumerate(result.token_ids):
            out[i].append(t)
        plan = StepPlan(
            chunks=[
                ScheduledChunk(r, [out[i][-1]], len(batch[i]) + step, tables[i], True)
                for i, r in enumerate(ids)
            ]
        )
    runner.execute(StepPlan(finished_ids=ids))
    return out


@pytest.mark.parametrize("graphs", ["decode", "piecewise", ""],
                         ids=["cuda_graphs", "piecewise_graphs", "eager"])  # fmt: skip
def test_forward_and_sampling_never_synchronise(graphs):
    runner, _ = make_runner("cuda", torch.bfloat16, blocks=256)
    if graphs:
        runner.capture_decode_graphs(max_batch=8, max_seq_len=512)
    if graphs == "piecewise":  # the prefill step replays pieces
        runner.capture_piecewise_graphs(128)
    params = list(PARAMS.values())
    run_steps(runner, params, steps=3, guarded=False)  # compile kernels, warm allocators
    run_steps(runner, params, steps=6, guarded=True)


def test_the_guard_catches_a_synchronising_call():
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError), no_sync():
        x.sum().item()
