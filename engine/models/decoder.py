"""The decoder skeleton that the non-Llama models assemble from their own parts.

``DecoderLayer`` is Llama's pre-norm block — ``input_layernorm`` → attention →
``post_attention_layernorm`` → MLP, the residual stream carried beside the hidden states
and added inside the next norm — around any attention and MLP module (GQA or MLA; dense
MLP or MoE). ``DecoderModel`` is Llama's stack (embeddings, layers, final norm) over
layers built by a callback. Both take their forward from ``engine.models.llama``, so the
stream is computed one way for every model.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from engine.config import ModelConfig
from engine.models.llama import Embedding, Linear, LlamaDecoderLayer, LlamaModel, RMSNorm


class DecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer.forward`` over the given attention and MLP.

    ``self_attn(hidden, positions, ctx)`` and ``mlp(hidden)`` are all the layer asks of
    them."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        nn.Module.__init__(self)  # the parts are given, not Llama's
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


class DecoderModel(LlamaModel):
    """``LlamaModel.forward`` over ``make_layer(i)`` for each layer; ``rotary`` is the
    table every layer's attention shares (registered here, so ``build_model`` fills it)."""

    def __init__(
        self, config: ModelConfig, rotary: nn.Module, make_layer: Callable[[int], nn.Module]
    ) -> None:
        nn.Module.__init__(self)  # the layers are made by the caller, not Llama's
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def lm_head(config: ModelConfig) -> Linear | None:
    """The output projection; None when it is the embedding matrix (tied)."""
    if config.tie_word_embeddings:
        return None
    return Linear(config.hidden_size, config.vocab_size, bias=False)
