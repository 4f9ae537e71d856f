"""Random weights at real shapes, for performance work without checkpoints.

``dummy:<preset>`` builds the preset's model directly on the target device in the target
dtype and fills it in place (no host copies), with a ``ByteTokenizer`` (one token per
UTF-8 byte, ChatML template) so it can be served over HTTP; its text is meaningless.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig, RopeScaling
from engine.models import build_model
from engine.models.base import CausalLM

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
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
}


def dummy_config(preset: str) -> ModelConfig:
    """The preset's config; raises ``KeyError`` listing the presets for an unknown name."""
    try:
        return PRESETS[preset]
    except KeyError:
        raise KeyError(f"unknown dummy preset {preset!r}; known: {sorted(PRESETS)}") from None


def build_dummy_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> CausalLM:
    """The model allocated on ``device`` in ``dtype`` with random weights made there."""
    model = build_model(config, device, dtype)
    model.init_random_weights(seed=seed)
    return model
