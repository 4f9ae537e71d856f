"""Decode steps on the CPU replayed as recorded programs of the C kernels' calls
(``engine.cuda_graphs``, ``kernels.cpu.CpuKernels.record``): the same tokens as eager
steps, recorded only where nothing but those kernels computes, every bucket by its first
step."""

from __future__ import annotations

import pytest
import torch

from engine.attention import build_backend
from engine.config import EngineConfig
from engine.cpu_kernels import cpu_kernels
from engine.cuda_graphs import CPU_BUCKETS, _KeepAllocations
from engine.llm import LLM
from engine.loader import load_model
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kvstore.layout import KVCache
from tests.engine.test_cuda_graphs import BLOCK, generate, prompts

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the CPU kernels")


def make_runner(weights: str) -> ModelRunner:
    """int4: the default model (a GGUF; its products on the integer kernel); fp32: a tiny
    random one."""
    spec = "default" if weights == "int4" else "dummy:tiny"
    loaded = load_model(spec, "cpu", torch.float32, progress=False, weights=weights)
    model, cfg = loaded.model, loaded.config
    cache = KVCache(model.kv_layout(BLOCK, torch.float32), 64, "cpu")
    backend = build_backend(cache, cfg, model.attention_scale, "cpu")
    return ModelRunner(model, backend, Sampler(cfg.vocab_size, "cpu"), BLOCK)


def recorded(runner: ModelRunner) -> list[int]:
    return [b.size for b in runner.graphs._buckets.values() if b.program is not None]


def test_recorded_decode_steps_give_the_eager_steps_tokens():
    eager, replayed = make_runner("int4"), make_runner("int4")
    graphs = replayed.capture_decode_graphs(8, 256, CPU_BUCKETS, capture=False)
    graphs.capture()
    assert graphs.captured and recorded(replayed) == [1]  # checked on the smallest bucket
    batch = prompts(eager.sampler.vocab_size, [5, 17, 33])
    assert generate(replayed, batch, 10) == generate(eager, batch, 10)
    assert recorded(replayed) == [1, 3]  # the 3-row steps: recorded by the first, replayed after
    one = prompts(eager.sampler.vocab_size, [9], seed=1)
    assert generate(replayed, one, 6) == generate(eager, one, 6)


def test_a_model_whose_products_run_in_torch_stays_eager():
    """Float32 matrices multiply in torch (``F.linear``), which a program cannot replay."""
    eager, runner = make_runner("fp32"), make_runner("fp32")
    graphs = runner.capture_decode_graphs(8, 256, CPU_BUCKETS, capture=False)
    graphs.capture()
    assert not graphs.captured and recorded(runner) == []
    batch = prompts(eager.sampler.vocab_size, [5, 17])
    assert generate(runner, batch, 6) == generate(eager, batch, 6)


def test_a_recording_keeps_its_allocations_and_refuses_torch_arithmetic():
    kernels = cpu_kernels()
    with kernels.record() as rec, _KeepAllocations(rec) as keep:
        before = torch.empty(3)  # before the start: the caller's
        rec.start()
        buffer = torch.empty(4)
        buffer.view(2, 2)  # a view computes nothing
        assert rec.refused is None
        torch.ones(2) + 1
    assert [t.data_ptr() for t in keep.tensors][:1] == [buffer.data_ptr()]
    assert before.data_ptr() not in [t.data_ptr() for t in keep.tensors]
    assert rec.refused is not None and "ones" in rec.refused
    with kernels.record() as rec, _KeepAllocations(rec) as keep:
        torch.ones(2) * 2  # before the embedding: a replay would not compute it again
    assert rec.refused is not None and "before the embedding" in rec.refused
    with kernels.record() as rec, _KeepAllocations(rec) as keep:
        keep.embedding()
        torch.ones(2) * 2  # the embedding's own work, which a replay runs itself
    assert rec.refused is None


def test_the_default_engine_records_its_decode_steps_and_generates_as_eager():
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    replayed = LLM(EngineConfig())
    assert replayed.core.runner.graphs.captured
    batch = [replayed.chat_prompt([{"role": "user", "content": f"Tell me about {t}."}])
             for t in ("bees", "rain", "chess")]  # fmt: skip
    ours = [r.token_ids for r in replayed.generate(batch, greedy)]
    replayed.core.check_integrity()
    eager = LLM(EngineConfig(enforce_eager=True))
    assert eager.core.runner.graphs is None
    assert ours == [r.token_ids for r in eager.generate(batch, greedy)]


def test_a_prefill_worker_records_no_decode_program():
    """Its requests end at the token their last prompt chunk samples: no decode step."""
    from engine.core import EngineCore
    from engine.pd_scheduler import PrefillScheduler

    assert EngineCore(EngineConfig(), scheduler_cls=PrefillScheduler).runner.graphs is None
