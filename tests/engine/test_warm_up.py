"""The forwards an engine runs before it serves (``ModelRunner.warm_up``): they
touch no real block, change no later output, and the engine's start-up reports them; the
start-up also waits for its grammar compiler, so no import runs beside the first requests."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore, warm_up_steps
from tests.engine.test_cuda_graphs import BLOCK, generate, make_runner, prompts

PRESETS = ["tiny", "deepseek-v3-tiny"]  # GQA, MLA + MoE


@pytest.mark.parametrize("preset", PRESETS)
def test_warm_up_writes_only_the_null_block(preset):
    runner, cache = make_runner(preset=preset)
    before = cache.storage.clone()
    runner.warm_up([(1,), (1, 1, 1), (3 * BLOCK + 5, 2)])
    changed = (cache.storage != before).any(-1).any(0)  # [num_blocks, block_size]
    assert changed[0].any() and not changed[1:].any()


@pytest.mark.parametrize("preset", PRESETS)
def test_outputs_after_a_warm_up_are_those_of_a_cold_runner(preset):
    cold, _ = make_runner(preset=preset)
    warmed, _ = make_runner(preset=preset)
    warmed.warm_up([(40,), (1, 1)])
    batch = prompts(cold.sampler.vocab_size, [7, 30])
    assert generate(warmed, batch, 6) == generate(cold, batch, 6)


def test_an_engine_warms_up_before_it_serves_and_keeps_every_block_free():
    core = EngineCore(EngineConfig(model="dummy:tiny", cache=CacheConfig(num_blocks=32),
                                   scheduler=SchedulerConfig(max_model_len=256)))  # fmt: skip
    assert core.startup["warm_up"] >= 0
    assert core.kv.pool.num_free == 31  # all but the null block
    core.kv.pool.check_integrity()
    assert core.grammars.compiler._compiler.done()  # xgrammar is not imported beside requests


def test_a_gpu_warms_up_every_few_row_product_and_a_whole_step_and_the_cpu_a_short_prompt():
    sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256)
    few = ((1,), (1, 1), (1, 1, 1), (1, 1, 1, 1))  # gemv kernels are built per row count
    assert warm_up_steps("cuda:0", sched, 32768) == (*few, (4096,))
    assert warm_up_steps("cuda", sched, 1024) == (*few, (1024,))  # no longer than the model
    two = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=2)
    assert warm_up_steps("cuda", two, 1024) == ((1,), (1, 1), (512,))
    assert warm_up_steps("cpu", sched, 32768) == ((16,),)
