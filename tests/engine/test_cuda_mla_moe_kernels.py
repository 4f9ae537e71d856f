"""A DeepSeek-V3-architecture model at widths the MLA and MoE kernels take, on CUDA.

The tiny presets' latent (32 + 8) is below what the MLA decode kernel is built for, so
their CUDA tests run the torch MLA path; this model (latent 64 + 16, 128-token blocks)
runs the TileLang MLA backend and the grouped-GEMM experts. Its decode steps replayed
from CUDA graphs must give the logits of eager steps. Skipped without CUDA or TileLang.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend

from engine.attention import build_backend, torch_mla
from engine.attention.tilelang_mla import TileLangMLABackend
from engine.config import MLAConfig
from engine.loader.dummy import build_dummy_model, dummy_config
from engine.models.moe import quantize_experts
from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.runner import ModelRunner, step_inputs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kernels import tilelang_available
from kvstore.layout import KVCache
from tests.engine.drafting import drafting_run, launches_without_waiting

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and tilelang_available()), reason="needs CUDA and TileLang"
)

BLOCK = 128
PER_SEQ = 20  # blocks each sequence owns
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
KERNEL_WIDE = dataclasses.replace(
    dummy_config("deepseek-v3-tiny"), name="dummy-deepseek-v3-kernel-wide", hidden_size=256,
    num_heads=16, num_kv_heads=16, head_dim=48,
    mla=MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  q_lora_rank=96),
    moe=dataclasses.replace(dummy_config("deepseek-v3-tiny").moe, intermediate_size=64),
)  # fmt: skip


def make_runner(backend: str, quantization: str = "none") -> ModelRunner:
    model = quantize_experts(build_dummy_model(KERNEL_WIDE, "cuda", torch.bfloat16, seed=0),
                             quantization)  # fmt: skip
    cache = KVCache(model.kv_layout(BLOCK, torch.bfloat16), 1 + 4 * PER_SEQ, "cuda")
    attention = build_backend(cache, KERNEL_WIDE, model.attention_scale, "cuda", backend)
    return ModelRunner(model, attention, Sampler(KERNEL_WIDE.vocab_size, "cuda"), BLOCK)


def lockstep_errors(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]], steps: int
) -> list[float]:
    """Prefill every prompt, then ``steps`` decode steps, the same tokens in both runners
    (the second one's greedy choice); each step's relative logits error of the first
    against the second. Sequence i owns blocks ``1 + PER_SEQ * i ..``."""
    ids = [f"q{i}" for i in range(len(prompts))]
    tables = [list(range(1 + PER_SEQ * i, 1 + PER_SEQ * (i + 1))) for i in range(len(prompts))]
    plan = StepPlan(
        chunks=[ScheduledChunk(r, p, 0, t, True) for r, p, t in zip(ids, prompts, tables)],
        new_requests=[NewRequest(r, p, GREEDY, ()) for r, p in zip(ids, prompts)],
    )
    errors = []
    for step in range(steps + 1):
        logits = []
        for runner in runners:
            runner._sync_states(plan)
            with torch.inference_mode():
                logits.append(runner._logits(plan)[0].float())
        got, expected = logits
        errors.append(((got - expected).norm() / expected.norm()).item())
        tokens = expected.argmax(-1).tolist()
        plan = StepPlan(chunks=[
            ScheduledChunk(r, [tokens[i]], len(prompts[i]) + step, tables[i], True)
            for i, r in enumerate(ids)
        ])  # fmt: skip
    return errors


def test_kernel_wide_model_takes_the_tilelang_mla_backend():
    assert isinstance(make_runner("auto").backend, TileLangMLABackend)


HOPPER = pytest.param("fp8", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="FP8 experts need a Hopper GPU"))  # fmt: skip
QUANTIZATIONS = ["none", HOPPER]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_graphed_kernel_decode_matches_eager_kernel_decode(quantization):
    """Both runners take the kernels, the graphed one captured. A 2.2k-token prompt makes
    both split the MLA context alike (``choose_num_splits`` caps at 33 splits for four
    sequences here), so the two compute the same sums; against the torch MLA backend the
    kernel is compared in tests/kernels, because rounding that differs between two
    attention implementations settles a routing near-tie differently for a row now and
    then (seen: 6 % logits error at two steps of eight)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (5, 130, 33, 2200)]
    graphed = make_runner("tilelang", quantization)
    graphs = graphed.capture_decode_graphs(max_batch=8, max_seq_len=PER_SEQ * BLOCK)
    assert graphs.captured
    errors = lockstep_errors((graphed, make_runner("tilelang", quantization)), prompts, steps=8)
    assert max(errors) < 1e-2, errors


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_piecewise_graph_steps_match_eager_steps(quantization):
    """Prefill (168 tokens) and decode steps through graph pieces cut at the TileLang
    MLA attention, the grouped-GEMM experts captured inside them, against eager steps."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (5, 130, 33)]
    pieced = make_runner("tilelang", quantization)
    pieces = pieced.capture_piecewise_graphs(256)
    assert pieces.captured
    errors = lockstep_errors((pieced, make_runner("tilelang", quantization)), prompts, steps=4)
    assert max(errors) < 1e-2, errors


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a Hopper GPU",
)
def test_fp8_experts_logits_stay_near_the_bf16_models():
    """FP8 experts (the grouped FP8 path) against the same model in bf16, step by step:
    within FP8's error at the median step (a routing near-tie may tip on a step)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (5, 130, 33)]
    errors = lockstep_errors((make_runner("tilelang", "fp8"), make_runner("tilelang")),
                             prompts, steps=6)  # fmt: skip
    assert 0 < sorted(errors)[len(errors) // 2] < 0.1, errors


def test_mla_prefill_through_the_fused_backends_matches_the_math_kernel(monkeypatch):
    """The CUDA prefill takes flash (or the memory-efficient kernel), never cuDNN's
    per-shape graphs (``torch_mla.FUSED_PREFILL``): a fresh prompt and a chunk after a
    cached prefix, against SDPA's math kernel over the same bf16 operands."""
    runner = make_runner("tilelang")
    backend, mla, heads = runner.backend, KERNEL_WIDE.mla, KERNEL_WIDE.num_heads
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = backend.cache.layers[0]
    cache.copy_(torch.randn(cache.shape, generator=g, device="cuda").to(cache.dtype))
    kv_b = 0.1 * torch.randn(heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                             mla.kv_lora_rank, generator=g, device="cuda")  # fmt: skip
    chunks = [
        ScheduledChunk("fresh", [0] * 300, 0, list(range(1, 1 + PER_SEQ)), True),
        ScheduledChunk("after", [0] * 100, 200, list(range(1 + PER_SEQ, 1 + 2 * PER_SEQ)), True),
    ]
    meta = step_inputs(chunks, BLOCK, torch.device("cuda"))[0].meta
    q = torch.randn(400, heads, mla.qk_head_dim, generator=g, device="cuda").to(torch.bfloat16)
    fused = backend.prefill(cache, q, kv_b.to(torch.bfloat16), meta).float()
    monkeypatch.setattr(torch_mla, "FUSED_PREFILL", [SDPBackend.MATH])
    math = backend.prefill(cache, q, kv_b.to(torch.bfloat16), meta).float()
    assert ((fused - math).norm() / math.norm()).item() < 1e-2


def test_a_mixed_steps_short_sequences_through_the_kernel_match_the_math_kernel(monkeypatch):
    """A mixed step: a prompt's long chunk beside a decode row and a verify chunk of five
    tokens. The short ones go through the MLA decode kernel, each token a row of its own
    (``torch_mla.absorbed_max_query``: 256 on CUDA); all of it against SDPA's math kernel over
    decompressed keys and values."""
    runner = make_runner("tilelang")
    backend, mla, heads = runner.backend, KERNEL_WIDE.mla, KERNEL_WIDE.num_heads
    assert isinstance(backend, TileLangMLABackend)
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = backend.cache.layers[0]
    cache.copy_(torch.randn(cache.shape, generator=g, device="cuda").to(cache.dtype))
    kv_b = 0.1 * torch.randn(heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                             mla.kv_lora_rank, generator=g, device="cuda")  # fmt: skip
    tables = [list(range(1 + PER_SEQ * i, 1 + PER_SEQ * (i + 1))) for i in range(3)]
    chunks = [
        ScheduledChunk("decode", [0], 700, tables[0], True),
        ScheduledChunk("prompt", [0] * 300, 200, tables[1], True),
        ScheduledChunk("verify", [0] * 5, 1000, tables[2], True, num_draft=4),
    ]
    meta = step_inputs(chunks, BLOCK, torch.device("cuda"))[0].meta
    q = torch.randn(306, heads, mla.qk_head_dim, generator=g, device="cuda").to(torch.bfloat16)
    latent = torch.randn(306, mla.latent_dim, generator=g, device="cuda").to(torch.bfloat16)
    mixed = backend.forward(0, q, latent, kv_b.to(torch.bfloat16), meta).float()
    assert meta.token_rows(torch_mla.absorbed_max_query(q.device)).others == (1,)
    monkeypatch.setattr(torch_mla, "FUSED_PREFILL", [SDPBackend.MATH])
    math = backend.prefill(cache, q, kv_b.to(torch.bfloat16), meta).float()
    assert ((mixed - math).norm() / math.norm()).item() < 1e-2


MTP_PROMPT_LENGTHS = (5, 130, 33)


def mtp_engine(overlap: bool):
    """The kernel-wide model with one random MTP layer, three drafts every step (an
    ``LLM``), and three prompts."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.llm import LLM
    from engine.loader import dummy

    dummy.PRESETS["deepseek-v3-kernel-wide-mtp"] = dataclasses.replace(
        KERNEL_WIDE, name="dummy-deepseek-v3-kernel-wide-mtp", num_mtp_layers=1
    )
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in MTP_PROMPT_LENGTHS]
    llm = LLM(EngineConfig(
        model="dummy:deepseek-v3-kernel-wide-mtp", device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=2048),
        speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=3, schedule="fixed"),
        overlap_scheduling=overlap,
    ))  # fmt: skip
    return llm, prompts


def mtp_run(overlap: bool, graphed: bool) -> tuple[list, list, int]:
    """``mtp_engine``'s greedy outputs, every draft proposed, and how many steps were
    planned while a step that verifies drafts ran (``drafting_run``)."""
    run = drafting_run(*mtp_engine(overlap), graphed=graphed)
    return run.outputs, run.drafts, run.early


def test_mtp_steps_planned_before_the_verify_step_before_them_match_serial_steps():
    """Under overlap a step after a verify step is planned before its outcome: the device
    places its rows after the tokens kept (positions, context lengths, KV slots in the
    decode graphs' buffers) and feeds it the drafts made behind that step. Its tokens and
    drafts are those of the same engine collecting every step before planning the next
    (the random MTP layer's drafts are mostly rejected: every step moves rows back)."""
    overlapped, overlapped_drafts, early = mtp_run(overlap=True, graphed=True)
    serial, serial_drafts, never = mtp_run(overlap=False, graphed=True)
    assert early > 5 and never == 0
    assert overlapped == serial
    assert overlapped_drafts == serial_drafts


def test_mtp_drafts_through_the_drafters_graphs_match_its_eager_drafts():
    """The MTP layer's one-token rows (a verify step's, each chained draft's) replayed
    from its CUDA graphs, against the same engine with those graphs dropped: the same
    greedy outputs (drafts never change them) and, but for a rare near-tie that rounding
    settles the other way, the same drafts."""
    graphed_out, graphed_drafts, _ = mtp_run(overlap=True, graphed=True)
    eager_out, eager_drafts, _ = mtp_run(overlap=True, graphed=False)
    assert graphed_out == eager_out
    same = sum(a == b for a, b in zip(graphed_drafts, eager_drafts))
    assert len(graphed_drafts) == len(eager_drafts) > 0
    assert same >= 0.9 * len(eager_drafts), (same, len(eager_drafts))


def test_a_step_planned_before_the_verify_step_before_it_launches_without_waiting():
    """Launching a step whose input tokens and drafts the step before left on the device
    (and whose rows the device moves back by that step's rejected drafts) never waits for
    the device: the forward, the verification and the drafting behind it only queue work
    (``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronising call)."""
    assert launches_without_waiting(*mtp_engine(overlap=True)) > 5
