"""The expert-parallel dispatcher's contract and the group's collectives, over real gloo
process groups of separate processes (``ep_ranks``): pairs reach the rank owning their
slot, grouped by source rank in each source's order, and come back summed per token;
a rank with no tokens still takes part; a rank's expert weights follow the placement; a
peer that dies makes the next collective fail at once instead of hanging."""

from __future__ import annotations

import pytest
import torch
from ep_ranks import run_group

from engine.ep.dispatcher import LocalDispatcher
from engine.models.moe import moe_experts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_rank_dispatch_and_combine_are_moe_experts():
    g = torch.Generator().manual_seed(0)
    hidden, top_k, experts, inter = 16, 3, 6, 8
    x = torch.randn(5, hidden, generator=g)
    ids = torch.randint(0, experts, (5, top_k), generator=g)
    weights = torch.rand(5, top_k, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    dispatcher = LocalDispatcher(experts)
    got = dispatcher.dispatch(x, ids, weights)
    assert got.hidden.shape == (5 * top_k, hidden) and got.slots.tolist() == ids.flatten().tolist()
    out = moe_experts(got.hidden, got.slots[:, None], got.weights[:, None], w13, w2)
    torch.testing.assert_close(dispatcher.combine(out, got.handle),
                               moe_experts(x, ids, weights, w13, w2))  # fmt: skip
    empty = dispatcher.dispatch(x[:0], ids[:0], weights[:0])
    assert dispatcher.combine(empty.hidden, empty.handle).shape == (0, hidden)


def test_pairs_reach_their_slots_rank_grouped_by_source_and_come_back_summed(tmp_path):
    tokens = [5, 0, 9]  # rank 1 has nothing this step
    results = run_group(3, "dispatch_roundtrip", tmp_path, tokens=tokens, slots_per_rank=2,
                        top_k=3)  # fmt: skip
    for rank, result in enumerate(results):
        assert result["shape"] == [tokens[rank], 8]
        assert result["error"] < 1e-5
        sources = result["sources"]
        assert sources == sorted(sources)  # by source rank, then the source's token order
        assert all(0 <= s < 2 for s in result["slots"])  # local slot ids
    received = sum(len(r["sources"]) for r in results)
    assert received == sum(tokens) * 3  # every pair went somewhere, once


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_expert_weights_follow_each_new_placement(tmp_path, quantization):
    """Every tensor of a slot moves with it: bf16/fp32 weights, or FP8 ones and their
    scales."""
    results = run_group(2, "weight_moves", tmp_path, model="dummy:qwen3-moe-tiny",
                        redundant=2, seeds=[1, 2, 3], quantization=quantization)  # fmt: skip
    assert results == [[True, True, True]] * 2


def test_a_rank_whose_peer_died_fails_its_next_collective_at_once(tmp_path):
    first, second = run_group(2, "peer_dies", tmp_path, after_rounds=3)
    assert second is None  # it left without a word
    assert first["error"] and "rank 0 of 2" in first["error"]
    assert first["seconds"] < 5  # seen at once, not after the 30 s timeout
