"""The MoE layer's parts against transformers' own: DeepSeek-V3's and Qwen3's routers (one
``Router`` with two strategies), the expert computation against a per-token loop, and
whole MoE blocks on the same weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from hf_models import CONFIGS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.config import ModelConfig, MoEConfig
from engine.models.moe import MoE, Router, moe_experts, moe_experts_dense

TOKENS = 64


def _hf_config(kind: str):
    return CONFIGS[kind]()


def _ours(kind: str) -> ModelConfig:
    return ModelConfig.from_hf_config(_hf_config(kind).to_dict())


def _hidden(width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(TOKENS, width, generator=torch.Generator().manual_seed(seed))


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k results in expert order, so two routers' outputs compare row by row."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _hf_block(kind: str) -> torch.nn.Module:
    torch.manual_seed(3)
    cls = Qwen3MoeSparseMoeBlock if kind == "qwen3-moe" else DeepseekV3MoE
    block = cls(_hf_config(kind)).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
        for name, buffer in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.2, 0.2)
    return block


@torch.no_grad()
def _our_block(kind: str, hf: torch.nn.Module) -> MoE:
    """Our MoE layer holding ``hf``'s weights."""
    ours = MoE(_ours(kind))
    ours.gate.weight.data = hf.gate.weight.clone()
    if ours.gate.e_score_correction_bias is not None:
        ours.gate.e_score_correction_bias.data = hf.gate.e_score_correction_bias.clone()
    ours.experts.w13.data = hf.experts.gate_up_proj.clone()  # gate rows, then up rows
    ours.experts.w2.data = hf.experts.down_proj.clone()
    if ours.shared_experts is not None:
        shared = hf.shared_experts
        fused = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
        ours.shared_experts.gate_up_proj.weight.data = fused
        ours.shared_experts.down_proj.weight.data = shared.down_proj.weight.clone()
    return ours


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_router_chooses_and_weighs_experts_like_transformers(kind):
    hf = _hf_block(kind)
    ours = _our_block(kind, hf)
    x = _hidden(hf.gate.weight.shape[1])
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        our_weights, our_ids = ours.gate(x)
    hf_weights, hf_ids = _sorted(hf_weights, hf_ids)
    our_weights, our_ids = _sorted(our_weights, our_ids)
    assert torch.equal(our_ids, hf_ids)
    torch.testing.assert_close(our_weights, hf_weights.float(), rtol=1e-6, atol=1e-7)


def test_correction_bias_steers_the_choice_and_not_the_weights():
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=4, scoring="sigmoid",
                    norm_topk_prob=False, score_correction_bias=True)  # fmt: skip
    router = Router(16, moe)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(0))
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's choice
    x = _hidden(16)
    weights, ids = router(x)
    assert (ids == 5).any(dim=-1).all()
    scores = (x @ router.weight.T).sigmoid()
    torch.testing.assert_close(weights, scores.gather(1, ids))  # the unbiased scores


def test_grouped_top_k_picks_only_from_the_best_groups():
    moe = MoEConfig(num_experts=16, top_k=4, intermediate_size=4, scoring="sigmoid",
                    num_groups=4, topk_groups=2)  # fmt: skip
    router = Router(16, moe)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(1))
    x = _hidden(16)
    _, ids = router(x)
    scores = (x @ router.weight.T).sigmoid().view(TOKENS, 4, 4)
    best_groups = scores.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices.sort().values
    for row, groups in zip(ids, best_groups):
        assert set((row // 4).tolist()) <= set(groups.tolist())
    ungrouped = Router(16, MoEConfig(num_experts=16, top_k=4, intermediate_size=4,
                                     scoring="sigmoid"))  # fmt: skip
    ungrouped.weight.data = router.weight.data
    assert not torch.equal(ungrouped(x)[1].sort().values, ids.sort().values)


def test_moe_experts_is_the_weighted_sum_of_each_tokens_experts():
    g = torch.Generator().manual_seed(2)
    experts, hidden, inter, top_k = 6, 16, 8, 3
    x = torch.randn(TOKENS, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.randint(0, experts - 1, (TOKENS, top_k), generator=g)  # the last expert idle
    weights = torch.rand(TOKENS, top_k, generator=g)
    expected = torch.zeros(TOKENS, hidden)
    for t in range(TOKENS):
        for k in range(top_k):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    # float32 sums of ~50 terms of size ~10 in another order: a few ulps of 64 apart
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(moe_experts(x, ids, weights, w13, w2), expected, **tol)
    # what a captured CUDA graph runs: the same sum, no host synchronisation
    torch.testing.assert_close(moe_experts_dense(x, ids, weights, w13, w2), expected, **tol)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_moe_block_matches_transformers(kind):
    hf = _hf_block(kind)
    ours = _our_block(kind, hf)
    x = _hidden(hf.gate.weight.shape[1], seed=4)
    with torch.no_grad():
        expected = hf(x[None])[0]
        got = ours(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
