"""The MoE dummy presets: full width at real shapes (built on the meta device, refused
where their weights do not fit), tiny ones that run."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from helpers import forward_tokens, greedy_generate

from engine.loader import load_model
from engine.loader.dummy import PRESETS, weight_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_deepseek_v3_preset_has_671b_parameters_and_its_mtp_layer():
    model = load_model("dummy:deepseek-v3", device="meta", dtype=torch.bfloat16).model
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 18432, 7168)
    assert shapes["model.layers.3.mlp.experts.w13"] == (256, 2 * 2048, 7168)
    assert shapes["model.layers.60.mlp.experts.w2"] == (256, 7168, 2048)
    assert shapes["model.layers.60.mlp.shared_experts.gate_up_proj.weight"] == (4096, 7168)
    assert shapes["model.layers.60.mlp.gate.weight"] == (256, 7168)
    assert shapes["model.layers.5.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["model.layers.5.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["model.layers.5.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert _params(model) - _params(model.mtp) == 671_026_419_200
    assert len(model.mtp) == 1 and _params(model.mtp) == 11_610_068_224
    layout = model.kv_layout(64, torch.bfloat16)
    assert layout.num_layers == 61 and layout.token_width == 576  # one latent per token
    assert model.model.layers[0].mlp.__class__.__name__ == "LlamaMLP"
    assert model.model.layers[3].mlp.gate.weight.dtype == torch.float32


def test_deepseek_v3_4l_is_one_dense_and_three_moe_layers_at_full_width():
    model = load_model("dummy:deepseek-v3-4l", device="meta", dtype=torch.bfloat16).model
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "MoE", "MoE", "MoE"]
    assert _params(model) == 36_958_707_456  # 74 GB in bf16
    assert weight_bytes(PRESETS["deepseek-v3-4l"], torch.bfloat16) > 73e9


def test_qwen3_30b_a3b_preset_has_its_30b_parameters():
    model = load_model("dummy:qwen3-30b-a3b", device="meta", dtype=torch.bfloat16).model
    assert _params(model) == 30_532_122_624
    assert tuple(model.model.layers[47].mlp.experts.w13.shape) == (128, 2 * 768, 2048)
    assert [c.shape for c in model.kv_layout(16, torch.bfloat16).components] == [(4, 128)] * 2


def test_a_full_width_preset_is_refused_at_once_where_its_weights_do_not_fit():
    start = time.perf_counter()
    with pytest.raises(MemoryError, match="dummy-deepseek-v3 needs 1271.7 GiB"):
        load_model("dummy:deepseek-v3", device="cpu", dtype=torch.bfloat16, progress=False)
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_tiny_moe_presets_run_and_are_reproducible(preset):
    first = load_model(f"dummy:{preset}", progress=False)
    logits = forward_tokens(first.model, first.tokenizer.encode("hello there"))
    assert logits.shape == (11, PRESETS[preset].vocab_size) and torch.isfinite(logits).all()
    again = load_model(f"dummy:{preset}", progress=False)
    prompt = first.tokenizer.encode("ferries")
    assert greedy_generate(first.model, prompt, 8) == greedy_generate(again.model, prompt, 8)


# The published config.json files of deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-30B-A3B (the
# keys ferry reads, and the ones beside them that it must not trip over).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 151936,
}  # fmt: skip


@pytest.mark.parametrize("preset,release", [("deepseek-v3", DEEPSEEK_V3_CONFIG),
                                            ("qwen3-30b-a3b", QWEN3_30B_A3B_CONFIG)])  # fmt: skip
def test_full_width_presets_are_the_released_models_configs(preset, release):
    from engine.config import ModelConfig

    read = ModelConfig.from_hf_config(release, name=PRESETS[preset].name)
    ours = PRESETS[preset]
    assert dataclasses.replace(read, bos_token_id=ours.bos_token_id,
                               eos_token_ids=ours.eos_token_ids) == ours  # fmt: skip
