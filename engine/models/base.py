"""The model contract the runner relies on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.attention.base import ForwardContext
from engine.config import ModelConfig
from kvstore.layout import KVCacheLayout

if TYPE_CHECKING:
    from engine.messages import MediaItem


@dataclass(frozen=True)
class Spliced:
    """Embeddings that replace the token embeddings of some rows of a step: ``values[i]``
    goes to row ``rows[i]`` (an image's tokens get the vision tower's outputs)."""

    rows: torch.Tensor  # [M] int64, indices into the step's tokens
    values: torch.Tensor  # [M, hidden]


@dataclass(frozen=True)
class RopeTable:
    """Rotary positions of one sequence that are not its token indices (M-RoPE).

    ``prompt`` [streams, N] holds each prompt token's positions; from ``linear_from`` on
    (past the last image) every token sits at its index + ``delta`` in every stream, so
    generated tokens and trailing text need no table.
    """

    prompt: np.ndarray
    delta: int
    linear_from: int

    def positions(self, start: int, end: int) -> np.ndarray:
        """Positions [streams, end - start] of tokens ``start .. end``."""
        streams, n = self.prompt.shape
        head = self.prompt[:, start : min(end, n)]
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (streams, len(tail)))], axis=1)


class CausalLM(nn.Module, ABC):
    """A decoder that reads and writes its KV through ``ctx`` and returns hidden states.

    ``forward`` takes the step's new tokens flattened over sequences (``input_ids`` of
    shape [T] and ``positions``: [T], or [streams, T] for a model whose ``rope_table``
    gives some sequences positions of their own) and returns [T, hidden]; ``spliced``
    replaces the token embeddings of some rows (an image's placeholder tokens) before the
    first layer. ``compute_logits`` maps the rows to sample from to float32 logits
    [N, vocab].
    """

    config: ModelConfig

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        spliced: Spliced | None = None,
    ) -> torch.Tensor: ...

    def rope_table(self, num_prompt_tokens: int, media: Sequence[MediaItem]) -> RopeTable | None:
        """The positions of a prompt with ``media`` in it when they are not its token
        indices (None: they are; the default, and every text-only model's)."""
        return None

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
