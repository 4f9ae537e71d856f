"""DeepSeek-V3 (and models of its architecture: Kimi K2, ...): MLA + MoE (+ MTP).

- **Attention** is multi-head latent attention (``MLAttention``). Queries come from the
  hidden state directly (``q_proj``) or through a low-rank bottleneck (``q_a_proj`` →
  ``q_a_layernorm`` → ``q_b_proj``). ``kv_a_proj_with_mqa`` makes one compressed KV
  ``c`` (normalised by ``kv_a_layernorm``) and one rotary key ``k_pe`` per token, shared
  by all heads; ``[c, k_pe]`` is the latent, the only thing the KV cache keeps
  (``KVCacheLayout.for_mla``). ``kv_b_proj`` holds the per-head up-projections to keys
  and values; the attention backend (``ctx.mla_attention``, an
  ``engine.attention.MLABackend``) uses it to decompress (prefill) or absorbs it into
  the query and the output (decode). RoPE covers the ``qk_rope_head_dim`` dims, in
  DeepSeek's interleaved pairs, with YaRN; under YaRN the softmax scale carries
  ``mscale(factor, mscale_all_dim)**2``, as in transformers.
- **MLP**: the first ``first_k_dense_replace`` layers are dense, the rest
  ``engine.models.moe.MoE`` with sigmoid routing, the selection-only correction bias,
  grouped top-k, ``routed_scaling_factor`` and shared experts.
- **MTP**: the checkpoint's ``num_nextn_predict_layers`` layers after the decoder
  (``model.layers.<num_layers + i>``) load into ``model.mtp[i]`` (``MultiTokenPredictor``);
  nothing runs them yet.

Weights load under Hugging Face's names (FP8 block-quantized checkpoints are dequantized
by the loader before they get here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.base import ForwardContext
from engine.config import ModelConfig
from engine.models.base import CausalLM
from engine.models.decoder import DecoderLayer, DecoderModel, lm_head
from engine.models.llama import Linear, LlamaForCausalLM, RMSNorm
from engine.models.moe import feed_forward, moe_weight_target
from engine.models.rotary import RotaryEmbedding, softmax_mscale
from kvstore.layout import KVCacheLayout

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepSeek's RMSNorm default

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# an MTP layer's copies of the embeddings and the output head, which it shares with the model
_MTP_SHARED = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring); ``forward`` → [T, hidden]."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.layer_idx = layer_idx
        self.num_heads = heads = config.num_heads
        hidden, bias = config.hidden_size, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.rotary = [rotary]  # shared, kept out of this module's parameters and buffers

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        mla = self.mla
        q_nope, q_pe = self._queries(hidden).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        q_pe, k_pe = self.rotary[0](positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c), k_pe.squeeze(1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        out = ctx.mla_attention(self.layer_idx, q, latent, self.kv_b_proj.weight)
        return self.o_proj(out.flatten(1))


class MultiTokenPredictor(DecoderLayer):
    """One of DeepSeek-V3's multi-token prediction modules (checkpoint layer
    ``num_layers + i``): a decoder layer (MLA + MoE) fed with ``eh_proj([enorm(embedding
    of token t+1), hnorm(main model's hidden state at t)])``, whose output goes through
    ``shared_head.norm`` and the model's own output head to predict token t+2. The
    embeddings and the head are the main model's (the checkpoint's copies are skipped).
    Run by the MTP drafter (``engine.spec.mtp``), over a KV cache layer of its own (one
    more MLA latent per token)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, MLAttention(config, layer_idx, rotary),
                         feed_forward(config, layer_idx))  # fmt: skip
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(hidden, eps)})


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 decoder (module docstring); ``LlamaForCausalLM``'s forward, logits
    and loading, over MLA + MoE layers, with the MTP layers in ``mtp``."""

    def __init__(self, config: ModelConfig) -> None:
        CausalLM.__init__(self)  # the layers are this model's, not Llama's
        mla = config.mla
        if mla is None or config.moe is None:
            raise ValueError("DeepSeek-V3 needs MLA and MoE configs")
        self.config = config
        rotary = RotaryEmbedding(
            mla.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, interleaved=mla.rope_interleave,
        )  # fmt: skip

        def layer(i: int) -> DecoderLayer:
            return DecoderLayer(config, MLAttention(config, i, rotary), feed_forward(config, i))

        self.model = DecoderModel(config, rotary, layer)
        self.lm_head = lm_head(config)
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(config, config.num_layers + i, rotary)
            for i in range(config.num_mtp_layers)
        )

    @property
    def attention_scale(self) -> float:
        """Softmax scale the attention backend must use."""
        cfg = self.config
        assert cfg.mla is not None
        return cfg.mla.qk_head_dim**-0.5 * softmax_mscale(cfg.rope_scaling) ** 2

    def kv_layout(self, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        cfg = self.config
        assert cfg.mla is not None
        return KVCacheLayout.for_mla(
            cfg.num_layers, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, block_size, dtype
        )

    def _shard(self, name: str) -> tuple[str, object]:
        """Parameter name and index that checkpoint tensor ``name`` fills."""
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= self.config.num_layers:  # an MTP layer
            mtp = int(match.group(1)) - self.config.num_layers
            name = f"mtp.{mtp}.{name[match.end() :]}"
        if ".self_attn." in name:  # MLA's projections keep their names (no fused q/k/v)
            return name, None
        assert self.config.moe is not None
        return moe_weight_target(name, self.config.moe) or super()._shard(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` without the MTP layers' copies of the
        embeddings and output head."""
        super().load_weights((n, t) for n, t in weights if not _MTP_SHARED.match(n))
