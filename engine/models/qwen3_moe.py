"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, experts for the MLP.

Attention is the Llama family's with Qwen3's per-head q/k RMSNorm (``LlamaAttention``,
GQA over the paged k/v cache); every layer not in ``moe.dense_layers`` (transformers'
``mlp_only_layers`` and ``decoder_sparse_step``) has ``engine.models.moe.MoE`` for its
MLP: softmax top-k routing, no shared experts. RoPE is the rotate-half form, with YaRN
when the config asks for it. Weights load under Hugging Face's names; the per-expert
tensors stack into ``experts.w13`` / ``experts.w2``.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.decoder import DecoderLayer, DecoderModel, lm_head
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.moe import feed_forward, moe_weight_target
from engine.models.rotary import RotaryEmbedding


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE decoder; ``LlamaForCausalLM``'s forward, logits, KV layout and loading,
    over MoE layers."""

    def __init__(self, config: ModelConfig) -> None:
        CausalLM.__init__(self)  # the layers are this model's, not Llama's
        if config.moe is None:
            raise ValueError("Qwen3-MoE needs a MoE config")
        self.config = config
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )  # fmt: skip

        def layer(i: int) -> DecoderLayer:
            return DecoderLayer(config, LlamaAttention(config, i, rotary), feed_forward(config, i))

        self.model = DecoderModel(config, rotary, layer)
        self.lm_head = lm_head(config)

    def _shard(self, name: str) -> tuple[str, object]:
        assert self.config.moe is not None
        return moe_weight_target(name, self.config.moe) or super()._shard(name)
