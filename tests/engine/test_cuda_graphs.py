"""Decode steps through the bucketed graph buffers (``engine.cuda_graphs``).

On the CPU the padded buffers run eagerly (``capture=False``): the padding rows, the
bucket choice and which steps are accepted are the same code as on CUDA. The CUDA tests
capture real graphs and replay them; they are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import build_backend
from engine.cuda_graphs import batch_buckets
from engine.loader import load_model
from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kvstore.layout import KVCache

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_runner(
    device: str = "cpu", dtype: torch.dtype = torch.float32, blocks: int = 64, preset: str = ""
):
    """A runner over a dummy model: ``tiny`` on the CPU, SmolLM2-135M's shape on CUDA (a
    shape the kernel tests sweep)."""
    preset = preset or ("tiny" if device == "cpu" else "smollm2-135m")
    loaded = load_model(f"dummy:{preset}", device=device, dtype=dtype, progress=False)
    model, cfg = loaded.model, loaded.config
    cache = KVCache(model.kv_layout(BLOCK, dtype), blocks, device)
    backend = build_backend(cache, cfg, model.attention_scale, device)
    return ModelRunner(model, backend, Sampler(cfg.vocab_size, device), BLOCK), cache


def generate(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuation of every prompt together: one prefill step, then decode steps;
    each sequence owns consecutive blocks from 1 on (block 0 stays the null block)."""
    per_seq = -(-(max(map(len, prompts)) + steps) // BLOCK)
    ids = [f"q{i}" for i in range(len(prompts))]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    new = [NewRequest(rid, p, GREEDY, ()) for rid, p in zip(ids, prompts)]
    chunks = [ScheduledChunk(rid, p, 0, t, True) for rid, p, t in zip(ids, prompts, tables)]
    out = [[] for _ in prompts]
    plan = StepPlan(chunks=chunks, new_requests=new)
    for _ in range(steps):
        result = runner.execute(plan)
        for i, rid in enumerate(ids):
            out[i].append(result.sampled[rid])
        plan = StepPlan(
            chunks=[
                ScheduledChunk(
                    rid, [out[i][-1]], len(prompts[i]) + len(out[i]) - 1, tables[i], True
                )
                for i, rid in enumerate(ids)
            ]
        )
    runner.execute(StepPlan(finished_ids=ids))
    return out


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_buckets_end_at_the_largest_batch():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)


PRESETS = ["tiny", "deepseek-v3-tiny", "qwen3-moe-tiny"]  # GQA, MLA + MoE, GQA + MoE


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_decode_matches_eager_decode_on_cpu(preset):
    eager, _ = make_runner(preset=preset)
    padded, _ = make_runner(preset=preset)
    graphs = padded.capture_decode_graphs(max_batch=8, max_seq_len=256, capture=False)
    batch = prompts(eager.sampler.vocab_size, [5, 17, 33])  # 3 rows: bucket 4, one padding row
    assert graphs.bucket_for(len(batch)) == 4
    assert generate(padded, batch, 12) == generate(eager, batch, 12)


@pytest.mark.parametrize("preset", PRESETS)
def test_padding_rows_write_only_the_null_block(preset):
    runner, cache = make_runner(preset=preset)
    runner.capture_decode_graphs(max_batch=8, max_seq_len=256, capture=False)
    before = cache.storage.clone()
    batch = prompts(runner.sampler.vocab_size, [20, 9, 3])
    generate(runner, batch, 4)
    changed = (cache.storage != before).any(-1).any(0)  # [num_blocks, block_size]
    # sequence i owns blocks 1+2i, 2+2i (24 tokens at most each); the rest must be untouched
    used = torch.zeros_like(changed)
    used[0, 0] = True  # the padding rows' slot
    for i, n in enumerate([20, 9, 3]):
        for pos in range(n + 3):
            used[1 + 2 * i + pos // BLOCK, pos % BLOCK] = True
    assert not (changed & ~used).any()
    assert changed[0].nonzero().flatten().tolist() == [0]  # padding wrote slot 0 of block 0


def test_steps_that_do_not_fit_run_eagerly():
    runner, _ = make_runner()
    graphs = runner.capture_decode_graphs(max_batch=4, max_seq_len=64, capture=False)

    def chunk(n_tokens: int, start: int = 10, blocks: int = 2) -> ScheduledChunk:
        return ScheduledChunk("r", [1] * n_tokens, start, list(range(1, 1 + blocks)), True)

    assert graphs.accepts([chunk(1)] * 4)
    assert not graphs.accepts([chunk(1)] * 5)  # larger than the largest bucket
    assert not graphs.accepts([chunk(1), chunk(2)])  # a prefill chunk: mixed step
    assert not graphs.accepts([chunk(1, start=64, blocks=5)])  # context past max_seq_len
    assert not graphs.accepts([])


def lockstep_logits_error(eager: ModelRunner, graphed: ModelRunner, lengths, steps: int):
    """Decode the same tokens through both runners; the largest relative logits error."""
    batch = prompts(eager.sampler.vocab_size, lengths)
    per_seq = -(-(max(lengths) + steps) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(batch))]
    ids = [f"q{i}" for i in range(len(batch))]
    plan = StepPlan(
        chunks=[ScheduledChunk(r, p, 0, t, True) for r, p, t in zip(ids, batch, tables)],
        new_requests=[NewRequest(r, p, GREEDY, ()) for r, p in zip(ids, batch)],
    )
    worst = 0.0
    for step in range(steps):
        for runner in (eager, graphed):
            runner._sync_states(plan)
        with torch.inference_mode():
            expected, _ = eager._logits(plan)
            got, _ = graphed._logits(plan)
            err = ((got.float() - expected).norm() / expected.norm()).item()
        worst = max(worst, err)
        tokens = expected.argmax(-1).tolist()
        plan = StepPlan(
            chunks=[
                ScheduledChunk(r, [tokens[i]], len(batch[i]) + step, tables[i], True)
                for i, r in enumerate(ids)
            ]
        )
    return worst


@needs_cuda
@pytest.mark.parametrize("lengths", [[7], [5, 130, 33], [40] * 9, [200] * 16])
def test_cuda_graph_decode_logits_match_eager(lengths):
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphs = graphed.capture_decode_graphs(max_batch=16, max_seq_len=1024)
    assert graphs.captured
    assert lockstep_logits_error(eager, graphed, lengths, steps=8) < 1e-2


@needs_cuda
def test_cuda_graphs_past_256_rows_match_eager():
    """The buckets past 256 rows, for the verify steps of speculative decoding (a row per
    draft): a step of 300 rows replays the 320-row graph as an eager step computes it."""
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=1024)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=1024)
    graphs = graphed.capture_decode_graphs(max_batch=512, max_seq_len=1024)
    assert graphs.captured and graphs.sizes[-4:] == (256, 320, 384, 512)
    assert lockstep_logits_error(eager, graphed, [20] * 300, steps=3) < 1e-2


@needs_cuda
def test_a_speculating_engine_captures_graphs_for_its_verify_steps():
    """With speculation a decode step holds each request's drafts as rows: the engine's
    graphs reach its sequences times one plus the drafts, up to 512 rows; without, its
    sequences."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.core import EngineCore

    def largest(speculative: SpeculativeConfig) -> int:
        core = EngineCore(EngineConfig(
            model="dummy:tiny", device="cuda", dtype="bfloat16", speculative=speculative,
            cache=CacheConfig(block_size=128, memory_gb=0.25),
            scheduler=SchedulerConfig(max_num_seqs=96, max_num_batched_tokens=2048,
                                      max_model_len=1024)))  # fmt: skip
        return core.runner.graphs.sizes[-1]

    assert largest(SpeculativeConfig()) == 96
    assert largest(SpeculativeConfig(method="ngram", num_speculative_tokens=3)) == 384
    assert largest(SpeculativeConfig(method="ngram", num_speculative_tokens=5)) == 512


@needs_cuda
def test_cuda_graph_greedy_generation_matches_eager():
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphed.capture_decode_graphs(max_batch=8, max_seq_len=1024)
    batch = prompts(eager.sampler.vocab_size, [12, 50, 7])
    assert generate(graphed, batch, 24) == generate(eager, batch, 24)


@needs_cuda
@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_cuda_graph_decode_of_moe_models_matches_eager(preset):
    """The MLA backend and the MoE layer capture: the graph's experts run without host
    synchronisation (``moe_experts_dense``), the eager step's by sorted tokens."""
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=512, preset=preset)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=512, preset=preset)
    graphs = graphed.capture_decode_graphs(max_batch=16, max_seq_len=1024)
    assert graphs.captured
    assert lockstep_logits_error(eager, graphed, [5, 130, 33], steps=8) < 1e-2


@needs_cuda
@pytest.mark.parametrize("preset", ["smollm2-135m", "deepseek-v3-tiny"])
def test_an_engines_start_up_captures_graphs_that_generate_as_an_eager_engine(preset):
    """The start-up's path: one dry run shared by the warm-up and the graphs (decode and
    piecewise), the warm-up, then the captures (``EngineCore._warm_up``); greedy
    generations of a batch equal those of an engine with no graphs."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM

    def engine(eager: bool) -> LLM:
        return LLM(EngineConfig(
            model=f"dummy:{preset}", device="cuda", dtype="bfloat16", enforce_eager=eager,
            cache=CacheConfig(block_size=128, memory_gb=0.5),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                      max_model_len=1024)))  # fmt: skip

    batch = prompts(256, [30, 200, 7])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    graphed = engine(eager=False)
    assert graphed.core.runner.graphs.captured
    assert graphed.core.runner.pieces.captured  # the 237-token prefill replays pieces
    ours = [r.token_ids for r in graphed.generate(batch, greedy)]
    graphed.core.check_integrity()
    del graphed
    eager = engine(eager=True)
    assert eager.core.runner.graphs is None and eager.core.runner.pieces is None
    assert ours == [r.token_ids for r in eager.generate(batch, greedy)]
