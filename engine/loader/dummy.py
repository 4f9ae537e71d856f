"""Random weights at real shapes, for performance work without checkpoints.

``dummy:<preset>`` builds the preset's model directly on the target device in the target
dtype and fills it in place (no host copies), with a ``ByteTokenizer`` (one token per
UTF-8 byte, ChatML template) so it can be served over HTTP; its text is meaningless.

The full-width MoE presets (``deepseek-v3``: 61 layers and the MTP layer, 1.3 TB in
bf16; ``deepseek-v3-4l``: 1 dense + 3 MoE layers, 74 GB; ``qwen3-30b-a3b``: 61 GB) are
for GPUs. On ``device="meta"`` any preset builds at once (shapes only, no weights); on a
device without room for its weights the build stops before allocating, with the size it
needed. The ``*-tiny`` presets run anywhere.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from engine.config import MLAConfig, ModelConfig, MoEConfig, RopeScaling, VisionConfig
from engine.models import build_model, build_vision_model
from engine.models.base import CausalLM
from engine.models.qwen2_5_vl import VisionTransformer

_BYTE_TOKENS = dict(bos_token_id=256, eos_token_ids=(257, 259))  # ByteTokenizer's specials
# ByteTokenizer(vision=True)'s <|vision_start|>, <|vision_end|>, <|image_pad|>
_VISION_TOKENS = dict(vision_start_token_id=260, vision_end_token_id=261, image_token_id=262)

_QWEN2_5_VL_7B = ModelConfig(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=128000,
    attention_bias=True,
    architecture="qwen2_5_vl",
    name="dummy-qwen2.5-vl-7b",
    vision=VisionConfig(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
        window_size=112, fullatt_block_indexes=(7, 15, 23, 31), **_VISION_TOKENS,
    ),
    mrope_section=(16, 24, 24),
    **_BYTE_TOKENS,
)  # fmt: skip

_DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_layers=61,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(
        kind="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=163840,
    architecture="deepseek_v3",
    name="dummy-deepseek-v3",
    mla=MLAConfig(
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        q_lora_rank=1536,
    ),
    moe=MoEConfig(
        num_experts=256, top_k=8, intermediate_size=2048, num_shared_experts=1,
        scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=8,
        topk_groups=4, score_correction_bias=True, dense_layers=(0, 1, 2),
    ),
    num_mtp_layers=1,
    **_BYTE_TOKENS,
)  # fmt: skip

_QWEN3_30B_A3B = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    qk_norm=True,
    architecture="qwen3_moe",
    name="dummy-qwen3-30b-a3b",
    moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True),
    **_BYTE_TOKENS,
)


def _narrow(config: ModelConfig, name: str, **changes) -> ModelConfig:
    return dataclasses.replace(config, name=f"dummy-{name}", **changes)


_LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
    architecture="llama",
    name="dummy-llama3-8b",
    bos_token_id=256,
    eos_token_ids=(257, 259),
)

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": _LLAMA3_8B,
    # the 8B's vocabulary at Llama-3.2-1B's shape: a draft model for it
    "llama3.2-1b": _narrow(
        _LLAMA3_8B, "llama3.2-1b", hidden_size=2048, intermediate_size=8192, num_layers=16,
        head_dim=64, tie_word_embeddings=True,
        rope_scaling=dataclasses.replace(_LLAMA3_8B.rope_scaling, factor=32.0),
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        architecture="llama",
        name="dummy-smollm2-135m",
        bos_token_id=256,
        eos_token_ids=(257, 259),
    ),
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        architecture="llama",
        name="dummy-tiny",
        bos_token_id=256,
        eos_token_ids=(257, 259),
    ),
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v3-4l": _narrow(
        _DEEPSEEK_V3, "deepseek-v3-4l", num_layers=4, num_mtp_layers=0,
        moe=dataclasses.replace(_DEEPSEEK_V3.moe, dense_layers=(0,)),
    ),
    "deepseek-v3-tiny": _narrow(
        _DEEPSEEK_V3, "deepseek-v3-tiny", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=24,
        max_position_embeddings=2048,
        rope_scaling=dataclasses.replace(
            _DEEPSEEK_V3.rope_scaling, factor=4.0, original_max_position_embeddings=512
        ),
        mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, q_lora_rank=48),
        moe=dataclasses.replace(_DEEPSEEK_V3.moe, num_experts=16, top_k=4,
                                intermediate_size=32, num_groups=4, topk_groups=2,
                                dense_layers=(0,)),
    ),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen2.5-vl-7b": _QWEN2_5_VL_7B,
    "qwen2.5-vl-tiny": _narrow(
        _QWEN2_5_VL_7B, "qwen2.5-vl-tiny", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=4096, mrope_section=(2, 3, 3),
        vision=VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                            out_hidden_size=64, window_size=56, fullatt_block_indexes=(1,),
                            **_VISION_TOKENS),
    ),
    "qwen3-moe-tiny": _narrow(
        _QWEN3_30B_A3B, "qwen3-moe-tiny", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=2048,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
    ),
}  # fmt: skip


# The image processor of each vision preset (preprocessor_config.json's settings).
IMAGE_PROCESSORS: dict[str, dict] = {
    "qwen2.5-vl-7b": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384},
    "qwen2.5-vl-tiny": {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64},
}


def dummy_config(preset: str) -> ModelConfig:
    """The preset's config; raises ``KeyError`` listing the presets for an unknown name."""
    try:
        return PRESETS[preset]
    except KeyError:
        raise KeyError(f"unknown dummy preset {preset!r}; known: {sorted(PRESETS)}") from None


def build_dummy_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
    vision: bool = True,
) -> CausalLM:  # fmt: skip
    """The model allocated on ``device`` in ``dtype`` with random weights made there
    (shapes alone on ``meta``; ``vision`` False: without its vision tower).
    ``MemoryError`` before anything is allocated when the weights do not fit the device's
    free memory."""
    device = torch.device(device)
    if device.type == "meta":
        return build_model(config, device, dtype, vision=vision)
    check_fits(build_model(config, "meta", dtype, vision=vision), config.name, device, dtype)
    model = build_model(config, device, dtype, vision=vision)
    model.init_random_weights(seed=seed)
    return model


def build_dummy_vision(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> VisionTransformer:
    """The preset's vision tower alone with random weights (as ``build_dummy_model``)."""
    device = torch.device(device)
    if device.type != "meta":
        check_fits(build_vision_model(config, "meta", dtype), config.name, device, dtype)
    tower = build_vision_model(config, device, dtype)
    if device.type != "meta":
        tower.init_random_weights(seed=seed)
    return tower


def check_fits(model: torch.nn.Module, name: str, device: torch.device, dtype: torch.dtype):
    """``MemoryError`` when the weights of ``model`` (built on meta) do not fit ``device``."""
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free = free_memory(device)
    if need > free:
        raise MemoryError(
            f"{name} needs {need / 2**30:.1f} GiB of weights in {dtype}; "
            f"{device} has {free / 2**30:.1f} GiB free"
        )


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (counted on the meta device)."""
    model = build_model(config, "meta", dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_memory(device: torch.device) -> int:
    """Bytes ``device`` can still give: free GPU memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
