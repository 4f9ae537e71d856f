"""The model contract the runner relies on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.base import ForwardContext
from engine.config import ModelConfig
from kvstore.layout import KVCacheLayout


class CausalLM(nn.Module, ABC):
    """A decoder that reads and writes its KV through ``ctx`` and returns hidden states.

    ``forward`` takes the step's new tokens flattened over sequences (``input_ids`` and
    ``positions`` of shape [T]) and returns [T, hidden]. ``compute_logits`` maps the rows
    to sample from to float32 logits [N, vocab].
    """

    config: ModelConfig

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take weights under Hugging Face's names (``model.layers.0.self_attn.q_proj.weight``)."""

    @abstractmethod
    def init_random_weights(self, seed: int = 0) -> None:
        """Fill every parameter in place with random values (dummy weights for benchmarks)."""

    @abstractmethod
    def kv_layout(self, block_size: int, dtype: torch.dtype) -> KVCacheLayout: ...

    @property
    @abstractmethod
    def attention_scale(self) -> float:
        """Softmax scale the attention backend must use."""
