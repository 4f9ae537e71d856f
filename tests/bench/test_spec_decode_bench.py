"""``bench.spec_decode_gpu``'s parts on the CPU, on ``dummy:tiny`` (real engine, real verify).

The rates drafter reproduces its per-position acceptance rates through the engine's own
verification once the model's logits are zero; arms swapped on one engine keep their own
counters and give the tokens of no speculation; ``run_arms`` reports every arm at every
point, an arm that raises as an error record, and points past the deadline as skipped.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.spec_decode import Job, run_arms, run_load
from bench.spec_decode_gpu import TRACE_FIELDS, RatesDrafter, arm_cores, use
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.spec import register_drafter
from engine.spec.manager import SpecDecoding

RATES = [0.9, 0.6, 0.3]


@pytest.fixture(scope="module")
def core() -> EngineCore:
    register_drafter("rates", lambda config, target, device, dtype: RatesDrafter(RATES))
    core = EngineCore(EngineConfig(
        model="dummy:tiny", num_threads=1,
        speculative=SpeculativeConfig(method="rates", num_speculative_tokens=len(RATES)),
        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    ))  # fmt: skip
    with torch.no_grad():
        core.runner.model.model.norm.weight.zero_()
    return core


def jobs(n: int, tokens: int = 40) -> list[Job]:
    return [Job([3 + (i * 7 + j) % 200 for j in range(12)], tokens) for i in range(n)]


@pytest.mark.parametrize(("on_device", "overlap"), [(False, False), (True, False), (True, True)],
                         ids=["host", "device", "device-overlap"])  # fmt: skip
def test_rates_drafter_reproduces_its_acceptance_rates(core, on_device, overlap):
    """On the host or on the device (the same draws), and under overlap, where the step
    after a verify step is planned before its outcome and its rows moved back on the
    device: the tokens of no speculation and the rates asked for."""
    spec = SpecDecoding(SpeculativeConfig(method="rates", num_speculative_tokens=3,
                                          schedule="fixed"),
                        lagged=overlap, on_device=on_device)  # fmt: skip
    core.overlap, step, early = overlap, core.step, [0]

    def counted():  # steps planned while a step that verifies drafts ran
        out = step()
        early[0] += core._inflight is not None and core._inflight[0].num_draft_tokens > 0
        return out

    core.step = counted
    try:
        run = run_load(use(core, spec, RatesDrafter(RATES, on_device)), jobs(16, 60), 16, "rates")
    finally:
        core.overlap, core.step = False, step
    assert (early[0] > 10) == overlap, early
    assert all(t == [0] * 60 for t in run["tokens"])  # zero logits: greedy takes token 0
    kept, tested = run["accepted_by_position"], run["verified_by_position"]
    assert tested[0] > 300
    for j, rate in enumerate(RATES):  # P(kept at j | kept before j), measured
        given = kept[j - 1] if j else tested[0]
        error = 4 * (rate * (1 - rate) / given) ** 0.5  # four standard errors
        assert abs(kept[j] / given - rate) < error, (j, kept, tested)
    expected_length = 1 + sum(RATES[0] * RATES[1] ** (j > 0) * RATES[2] ** (j > 1)
                              for j in range(3))  # fmt: skip
    assert abs(run["acceptance_length"] - expected_length) < 0.15
    core.check_integrity()


def test_arms_on_one_engine_and_their_records(core):
    cores = arm_cores(core, RatesDrafter(RATES), "rates")
    assert list(cores) == ["none", "fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5",
                           "dynamic"]  # fmt: skip

    def broken():
        raise RuntimeError("no such arm")

    cores["broken"] = broken
    records = run_arms(cores, {"decode": lambda c: jobs(c, 12)}, [1, 4], rounds=1,
                       log=lambda line: None)  # fmt: skip
    by = {(r["concurrency"], r["arm"]): r for r in records}
    assert by[(4, "broken")]["error"] == "RuntimeError: no such arm"
    for c in (1, 4):
        assert by[(c, "none")]["acceptance_length"] == 1.0
        assert by[(c, "fixed-1")]["verify_budget_per_step"] <= c
        for arm in ("fixed-2", "fixed-5", "dynamic"):
            assert by[(c, arm)]["outputs_equal_none"] == 1.0
            assert by[(c, arm)]["vs_none"] > 0
    assert sum(by[(4, "fixed-3")]["accepted_by_position"]) > 0
    for arm in ("none", "fixed-3", "dynamic"):  # a line a step, its host times, no graph
        trace = cores[arm].spec.trace
        assert trace and all(len(row) == len(TRACE_FIELDS) for row in trace)
        assert all(row[-3] >= 0 and row[-2] > 0 and row[-1] == 0 for row in trace)
    repeated = run_arms({k: cores[k] for k in ("none", "dynamic")},
                        {"decode": lambda c: jobs(c, 4)}, [2], rounds=1, log=lambda line: None,
                        min_tokens=5 * 2 * 4)  # fmt: skip
    assert [len(r["tok_s_runs"]) for r in repeated] == [5, 5]  # 8 tokens a round
    late = run_arms(cores, {"decode": lambda c: jobs(c, 4)}, [2], rounds=1,
                    log=lambda line: None, deadline=time.perf_counter() - 1)  # fmt: skip
    assert {r["error"] for r in late} == {"skipped: out of time"}
    core.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rates_drafter_on_cuda_launches_the_step_after_a_verify_step_without_waiting():
    """The sweep's drafter must not make the steps it measures wait for the device (a
    tensor made from a host list at each launch did: every verify step then ran its eager
    kernels at the host's pace)."""
    from engine.llm import LLM
    from tests.engine.drafting import launches_without_waiting

    register_drafter("rates", lambda config, target, device, dtype: RatesDrafter(RATES))
    llm = LLM(EngineConfig(
        model="dummy:tiny", device="cuda", dtype="float32", overlap_scheduling=True,
        speculative=SpeculativeConfig(method="rates", num_speculative_tokens=len(RATES),
                                      schedule="fixed"),
        cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
    ))  # fmt: skip
    assert launches_without_waiting(llm, [[3 + i % 50] * 12 for i in range(4)]) > 5
