"""The Llama forward with the CUDA kernels (add+RMSNorm, RoPE, SiLU-and-mul, and the
skinny GEMV for the decode steps' projections and logits) against its torch ops.

Skipped without CUDA or TileLang. Both bf16 paths are compared with a float32 CPU run of
the same weights: the kernels' error must be no larger than the torch ops' own.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_graphs import BLOCK, make_runner, prompts

import engine.models.llama as llama
from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.sampling_params import SamplingParams
from kernels import tilelang_available

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and tilelang_available()), reason="needs CUDA and TileLang"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def step_logits(runner, batch: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Float32 CPU logits of a prefill step and ``steps`` decode steps fed fixed tokens."""
    per_seq = -(-(max(map(len, batch)) + steps) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(batch))]
    ids = [f"m{i}" for i in range(len(batch))]
    plan = StepPlan(
        chunks=[ScheduledChunk(r, p, 0, t, True) for r, p, t in zip(ids, batch, tables)],
        new_requests=[NewRequest(r, p, GREEDY, ()) for r, p in zip(ids, batch)],
    )
    out = []
    for step in range(steps + 1):
        runner._sync_states(plan)
        with torch.inference_mode():
            out.append(runner._logits(plan)[0].float().cpu())
        plan = StepPlan(
            chunks=[
                ScheduledChunk(r, [(7 * step + i) % 500 + 1], len(batch[i]) + step, tables[i], True)
                for i, r in enumerate(ids)
            ]
        )
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fused_norm_and_rope_are_as_accurate_as_torch_ops(monkeypatch):
    reference, _ = make_runner("cpu", torch.float32, blocks=128, preset="smollm2-135m")
    fused, _ = make_runner("cuda", torch.bfloat16, blocks=128)
    plain, _ = make_runner("cuda", torch.bfloat16, blocks=128)
    weights = fused.model.state_dict()  # one set of weights for all three
    plain.model.load_state_dict(weights)
    reference.model.load_state_dict({k: v.float().cpu() for k, v in weights.items()})
    batch = prompts(reference.sampler.vocab_size, [37, 5, 80])
    expected = step_logits(reference, batch, 4)
    got_fused = step_logits(fused, batch, 4)
    monkeypatch.setattr(llama, "_TILELANG_PRESENT", False)
    got_plain = step_logits(plain, batch, 4)
    for e, f, p in zip(expected, got_fused, got_plain, strict=True):
        assert rel(f, e) <= 1.5 * rel(p, e) + 1e-3
        assert rel(f, e) < 5e-2
