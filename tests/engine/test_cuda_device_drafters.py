"""The drafters that draft on the device, on CUDA: a draft model, its one-token rows
replayed from its CUDA graphs (SmolLM2-135M's shape drafting for itself: the same random
weights, so its greedy drafts are the target's next tokens), and prompt lookup. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm import LLM
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from tests.engine.drafting import (
    GREEDY_24,
    drafting_run,
    guard_launches,
    launches_without_waiting,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = "dummy:smollm2-135m"
PROMPT_LENGTHS = (5, 130, 33)


def draft_engine(overlap: bool) -> tuple[LLM, list[list[int]]]:
    """The model drafting three tokens for itself every step (float32: a near-tie that
    the rows' different kernels round apart is rare), and three prompts."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(300, 40000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    llm = LLM(EngineConfig(
        model=MODEL, device="cuda", dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=1024),
        speculative=SpeculativeConfig(method="draft", draft_model=MODEL,
                                      num_speculative_tokens=3, schedule="fixed"),
        overlap_scheduling=overlap,
    ))  # fmt: skip
    return llm, prompts


def test_a_draft_model_on_cuda_drafts_the_targets_own_continuation():
    """Drafting for itself, serially and with the step after a verify step planned before
    its outcome (the draft model then drafts behind it from the tokens on the device):
    the same outputs, and every proposal is the target's own continuation but for a rare
    near-tie."""
    runs = [drafting_run(*draft_engine(overlap)) for overlap in (True, False)]
    assert runs[0].outputs == runs[1].outputs
    assert runs[0].early > 5 and runs[1].early == 0
    for run in runs:
        drafts = right = 0
        for rid, proposal in run.proposals:
            sequence = run.sequences[rid]
            for j, token in enumerate(proposal.token_ids):
                drafts += 1
                right += sequence[proposal.start + j] == token
        assert right >= 0.95 * drafts and drafts > 40, (right, drafts)


def test_draft_model_rows_through_its_graphs_match_its_eager_rows():
    """Its one-token rows replayed from its CUDA graphs, against the same engine with the
    graphs dropped: the same outputs and drafts."""
    graphed = drafting_run(*draft_engine(overlap=True), graphed=True)
    eager = drafting_run(*draft_engine(overlap=True), graphed=False)
    assert (graphed.outputs, graphed.drafts) == (eager.outputs, eager.drafts)


def test_a_step_after_a_draft_model_verify_step_launches_without_waiting():
    assert launches_without_waiting(*draft_engine(overlap=True)) > 5


def lookup_engine() -> LLM:
    return LLM(EngineConfig(
        model=MODEL, device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                      schedule="fixed"),
        overlap_scheduling=True,
    ))  # fmt: skip


REPEATING = [[500 + i % 7 for i in range(40)], [900, 901, 902] * 9, list(range(1000, 1030)) * 2]


def test_prompt_lookup_on_cuda_proposes_the_most_recent_longest_match():
    from tests.engine.test_ngram_drafts import run_checked

    run_checked(lookup_engine(), REPEATING, GREEDY_24)


@pytest.mark.parametrize("case", ["greedy", "sampled", "penalized"])
def test_a_step_after_a_prompt_lookup_verify_step_launches_without_waiting(case):
    """Greedy; sampled: rejection sampling with top-p and logprobs of the verified rows;
    penalized: penalties and min_tokens counting the drafts and the tokens of the step
    still running on the device. The random model's outputs must repeat for the lookup to
    draft: sampled from its top two tokens and penalized lightly, they do (broader samples
    or heavier penalties gave no drafts at all)."""
    params = {
        "greedy": GREEDY_24,
        "sampled": SamplingParams(temperature=0.8, top_k=2, top_p=0.95, logprobs=2,
                                  max_tokens=24, ignore_eos=True, seed=1),
        "penalized": SamplingParams(temperature=0.0, frequency_penalty=0.02,
                                    repetition_penalty=1.01, presence_penalty=0.01,
                                    min_tokens=16, stop_token_ids=[2], max_tokens=24),
    }[case]  # fmt: skip
    assert launches_without_waiting(lookup_engine(), REPEATING, params) > 5


def test_a_prompt_joining_a_step_planned_after_a_verify_step_launches_without_waiting():
    """The prompts arrive while the others' verify steps run: the step planned before
    that outcome holds their prefill beside the moved decode rows."""
    llm = lookup_engine()
    core = llm.core
    guarded = guard_launches(llm, lambda plan: any(not c.is_decode for c in plan.chunks))
    waiting = [EngineRequest(f"p{i}", p, GREEDY_24) for i, p in enumerate(REPEATING * 2)]
    while waiting or core.has_work:
        inflight = core._inflight
        if waiting and (not core.has_work or inflight[0].num_draft_tokens):
            core.add_request(waiting.pop(0))
        core.step()
    assert guarded[0] >= 2
    core.check_integrity()
