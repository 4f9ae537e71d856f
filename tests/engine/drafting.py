"""Running an engine whose drafter drafts on the device, for the tests of the drafters
(prompt lookup: ``test_ngram_drafts``; on CUDA, MTP: ``test_cuda_mla_moe_kernels``, a
draft model and prompt lookup: ``test_cuda_device_drafters``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.llm import LLM
from engine.plan import StepPlan
from engine.sampling_params import SamplingParams
from engine.spec.base import Proposal

GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@dataclass
class Recorded:
    """A generation's outputs (in prompt order), every proposal collected (request id,
    proposal), each request's whole sequence, and how many steps were planned while a
    step that verifies drafts ran."""

    outputs: list[list[int]]
    proposals: list[tuple[str, Proposal]]
    sequences: dict[str, list[int]]
    early: int

    @property
    def drafts(self) -> list[int]:
        """Every draft token proposed, in order (per step, by request id)."""
        return [t for _, p in self.proposals for t in p.token_ids]


def generate_recorded(
    llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_24
) -> Recorded:
    """``llm.generate(prompts, params)``, recorded; every block is free after."""
    core = llm.core
    proposals, early, ids = [], [0], []
    step, finish, add = core.step, core.runner.finish, core.add_request

    def counted():
        out = step()
        early[0] += core._inflight is not None and core._inflight[0].num_draft_tokens > 0
        return out

    def recorded(launched):
        result = finish(launched)
        proposals.extend(sorted(result.proposals.items()))
        return result

    def added(request):
        ids.append(request.request_id)
        return add(request)

    core.step, core.runner.finish, core.add_request = counted, recorded, added
    try:
        outputs = [r.token_ids for r in llm.generate(prompts, params)]
    finally:
        core.step, core.runner.finish, core.add_request = step, finish, add
    core.check_integrity()
    assert core.kv.pool.num_free == core.kv.pool.num_usable
    sequences = {rid: p + out for rid, p, out in zip(ids, prompts, outputs)}
    return Recorded(outputs, proposals, sequences, early[0])


def drafting_run(llm: LLM, prompts: list[list[int]], graphed: bool = True) -> Recorded:
    """``generate_recorded`` of a model drafter whose CUDA graphs are captured; ``graphed``
    False drops them first (its rows then run eagerly)."""
    assert llm.core.runner.drafter.graphs is not None and llm.core.runner.drafter.graphs.captured
    if not graphed:
        llm.core.runner.drafter.graphs = None
    return generate_recorded(llm, prompts)


def guard_launches(llm: LLM, counted: Callable[[StepPlan], bool]) -> list[int]:
    """From now on, every launch of a step whose input tokens or drafts the step before
    left on the device runs under ``torch.cuda.set_sync_debug_mode("error")`` (it raises
    at any synchronising call); returns a counter ([n]) of those ``counted`` says."""
    runner, guarded = llm.core.runner, [0]
    launch = runner.launch

    def checked(plan):
        if not any(t < 0 for c in plan.chunks for t in c.token_ids):  # no placeholder
            return launch(plan)
        guarded[0] += counted(plan)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    runner.launch = checked
    return guarded


def launches_without_waiting(
    llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_24
) -> int:
    """Generates ``prompts`` with ``guard_launches``; returns how many of the guarded
    launches had drafts made on the device."""
    guarded = guard_launches(llm, lambda plan: any(t <= -2 for c in plan.chunks
                                                   for t in c.token_ids))  # fmt: skip
    llm.generate(prompts, params)
    return guarded[0]
