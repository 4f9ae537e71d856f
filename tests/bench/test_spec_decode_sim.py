"""The simulated machine's step costs (bench.spec_decode_sim)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.spec_decode_sim import H100_COSTS
from engine.plan import ScheduledChunk, StepPlan


def _decode(requests: int, context: int, drafts: int = 0) -> StepPlan:
    return StepPlan([ScheduledChunk(f"r{i}", [0] * (1 + drafts), context, [], True, drafts)
                     for i in range(requests)])  # fmt: skip


def test_a_decode_steps_attention_costs_each_row_every_kv_block_it_reads():
    """With ``--kv-block-cost`` a decode step costs its fitted time plus, per row, that
    much per 128-token block of KV it reads (a chunk's rows at its longest context): 256
    rows at 100 tokens of context read one block each, at 200 two, so the step costs 256
    blocks' worth more; steps with prefill are as fitted."""
    costs = replace(H100_COSTS, kv_block_row_s=3.5e-6)
    short, long = costs.forward(_decode(256, 100)), costs.forward(_decode(256, 200))
    assert short == pytest.approx(H100_COSTS.forward(_decode(256, 100)) + 256 * 3.5e-6)
    assert long - short == pytest.approx(256 * 3.5e-6)
    verify = costs.forward(_decode(128, 127, drafts=1))  # the draft's row reaches block 2:
    # both rows are counted at their chunk's longest context
    assert verify == pytest.approx(H100_COSTS.forward(_decode(128, 127, 1)) + 128 * 4 * 3.5e-6)
    prompt = StepPlan([ScheduledChunk("p", [0] * 300, 0, [], True)])
    assert costs.forward(prompt) == H100_COSTS.forward(prompt)
