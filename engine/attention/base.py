"""Attention backend contracts and the per-step forward context.

A GQA model's attention layer computes q, k, v (and applies RoPE), then calls
``ctx.attention(layer, q, k, v)``. The backend writes the new tokens' k and v into the
paged cache at ``slot_mapping`` and attends each sequence's queries over its whole
context (cached prefix + new tokens), causally.

An MLA model's layer calls ``ctx.mla_attention(layer, q, latent, kv_b)`` instead
(``MLABackend``): the cache holds one latent per token and the backend decides how to
attend over it. Backends are chosen by device and attention kind through the registry in
``engine.attention``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from engine.config import MLAConfig
from kvstore.layout import KVCache

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    """Where the step's tokens sit. B sequences, T new tokens in all.

    Sequence i owns new tokens ``query_start_loc[i]:query_start_loc[i+1]``; its context
    after this step is ``seq_lens[i]`` tokens, the last of which are the new ones.

    A step planned before the one before it was known may have moved one-token sequences
    back on the device (``engine.runner``): their ``seq_lens_cpu`` (and ``max_seq_len``)
    are then bounds, and a backend reads one-token sequences' lengths on the device only.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    _derived: dict[object, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )  # built once a step (``derived``), never copied to another

    @classmethod
    def empty(cls, device: torch.device | str) -> AttentionMetadata:
        """A step of no sequences and no tokens (an idle expert-parallel rank's forward)."""
        return cls(
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            max_query_len=0, max_seq_len=0, query_lens_cpu=[], seq_lens_cpu=[],
        )  # fmt: skip

    @classmethod
    def one_token_each(
        cls, block_tables: np.ndarray, positions: torch.Tensor, bounds: list[int],
        block_size: int,
    ) -> AttentionMetadata:  # fmt: skip
        """One new token per sequence, at ``positions`` (on the device: known there only)
        over ``block_tables`` [B, blocks]; ``bounds``: a host bound on each position, which
        sizes the kernels' work without waiting for the device (decode steps only: a
        decode attends by ``seq_lens`` on the device)."""
        device = positions.device
        tables = host_to_device(block_tables.astype(np.int32), device)
        lens = [b + 1 for b in bounds]
        return cls(
            query_start_loc=host_to_device(np.arange(len(bounds) + 1, dtype=np.int32), device),
            seq_lens=(positions + 1).to(torch.int32), block_tables=tables,
            slot_mapping=slots_of(tables, positions, block_size), max_query_len=1,
            max_seq_len=max(lens),
            query_lens_cpu=[1] * len(bounds), seq_lens_cpu=lens,
        )  # fmt: skip

    @classmethod
    def over_null_block(cls, tokens: int, block_size: int,
                        device: torch.device | str) -> AttentionMetadata:  # fmt: skip
        """One sequence of ``tokens`` new tokens whose every block is block 0, the null
        block (never handed out): what a warm-up forward over padding attends over."""
        device = torch.device(device)
        return cls(
            query_start_loc=host_to_device(np.array([0, tokens], dtype=np.int32), device),
            seq_lens=host_to_device(np.array([tokens], dtype=np.int32), device),
            block_tables=torch.zeros(1, -(-tokens // block_size), dtype=torch.int32,
                                     device=device),
            slot_mapping=host_to_device(np.arange(tokens, dtype=np.int64) % block_size, device),
            max_query_len=tokens, max_seq_len=tokens, query_lens_cpu=[tokens],
            seq_lens_cpu=[tokens],
        )  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    def derived(self, key: Hashable, make: Callable[[], T]) -> T:
        """What is built from the step once for all its layers (every layer asks): the
        first call's ``make()``, kept under ``key`` for the step."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = make()
        return value

    def sequences(self, seqs: tuple[int, ...]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step cut down to the sequences ``seqs`` (indices in the step, ascending):
        their token rows [N] and their metadata, without slots (a backend stores the
        whole step's KV first). Built once per step, like ``token_rows``."""
        return self.derived(("sequences", seqs), lambda: self._sequences(seqs))

    def _sequences(self, seqs: tuple[int, ...]) -> tuple[torch.Tensor, AttentionMetadata]:
        start = np.cumsum([0, *self.query_lens_cpu])
        rows = np.concatenate([np.arange(start[i], start[i + 1]) for i in seqs])
        query_lens = [self.query_lens_cpu[i] for i in seqs]
        seq_lens = [self.seq_lens_cpu[i] for i in seqs]
        device = self.seq_lens.device
        index = device_index(seqs, device)
        return (
            host_to_device(rows.astype(np.int64), device),
            AttentionMetadata(
                query_start_loc=host_to_device(
                    np.cumsum([0, *query_lens]).astype(np.int32), device),
                seq_lens=self.seq_lens.index_select(0, index),
                block_tables=self.block_tables.index_select(0, index),
                slot_mapping=self.slot_mapping[:0],
                max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            ),
        )  # fmt: skip

    def token_rows(self, max_query_len: int) -> TokenRows:
        """The new tokens of the sequences with at most ``max_query_len`` of them, each as a
        decode row of its own: a sequence's j-th new token attends over its context up to
        and including itself, which is the causal mask of its chunk row by row. Built once
        per step (every layer asks) from the host-side fields, copied to the device
        without waiting."""
        return self.derived(("token rows", max_query_len),
                            lambda: TokenRows.of(self, max_query_len))  # fmt: skip


@dataclass(frozen=True)
class TokenRows:
    """``AttentionMetadata.token_rows``: ``rows`` [N], the step's token rows of the short
    sequences, and ``meta``, one query per row (None when no sequence is short);
    ``others``, the sequences left (their indices in the step); ``leading``, the number
    of rows when the short sequences are the step's first ones (0 otherwise)."""

    rows: torch.Tensor | None
    meta: AttentionMetadata | None
    others: tuple[int, ...]
    leading: int = 0  # when the short sequences are the step's first ones: their rows

    @classmethod
    def of(cls, meta: AttentionMetadata, max_query_len: int) -> TokenRows:
        start = np.cumsum([0, *meta.query_lens_cpu])
        short = [i for i, n in enumerate(meta.query_lens_cpu) if n <= max_query_len]
        others = tuple(i for i, n in enumerate(meta.query_lens_cpu) if n > max_query_len)
        if not short:
            return cls(None, None, others)
        owner = np.concatenate([np.full(meta.query_lens_cpu[i], i) for i in short])
        rows = np.concatenate([np.arange(start[i], start[i + 1]) for i in short])
        # the j-th of a sequence's n new tokens sees seq_len - n + 1 + j tokens: the
        # device's seq_len (a bound on the host where the row moved back: engine.runner)
        after = (start[owner + 1] - rows - 1).astype(np.int32)  # its sequence's tokens after it
        lens = (np.asarray(meta.seq_lens_cpu)[owner] - after).tolist()
        device = meta.seq_lens.device
        own = host_to_device(owner.astype(np.int64), device)
        return cls(
            rows=host_to_device(rows.astype(np.int64), device),
            meta=AttentionMetadata(
                query_start_loc=host_to_device(np.arange(len(rows) + 1, dtype=np.int32), device),
                seq_lens=meta.seq_lens.index_select(0, own) - host_to_device(after, device),
                block_tables=meta.block_tables.index_select(0, own),
                slot_mapping=meta.slot_mapping[:0],
                max_query_len=1, max_seq_len=max(lens),
                query_lens_cpu=[1] * len(rows), seq_lens_cpu=lens,
            ),  # fmt: skip
            others=others,
            leading=len(rows) if short == list(range(len(short))) else 0,
        )


def padded_tables(block_ids: list[list[int]], width: int = 1) -> np.ndarray:
    """Block tables as the rows of one int32 array, padded with the null block (0) to the
    longest table or ``width`` columns, whichever is more."""
    lengths = np.fromiter(map(len, block_ids), np.int64, len(block_ids))
    tables = np.zeros((len(block_ids), int(lengths.max(initial=width))), dtype=np.int32)
    # every block in one pass: a row at a time costs ~1 us a row, ~1 ms for a verify step
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), np.int32, int(lengths.sum()))  # fmt: skip
    return tables


def host_to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device``; to CUDA from pinned memory, without waiting
    (a copy from pageable memory waits for the device)."""
    tensor = host if isinstance(host, torch.Tensor) else torch.from_numpy(host)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_index(values, device: torch.device) -> torch.Tensor:
    """Host ints (a list or an array) as an int64 tensor on ``device``, without waiting."""
    return host_to_device(np.asarray(values, dtype=np.int64), device)


ALIGN_BYTES = 64  # where each array of a packed copy starts (``device_arrays``)


def device_indices(device: torch.device, *values) -> list[torch.Tensor]:
    """Several arrays of host ints (lists, nested lists or arrays) as int64 tensors on
    ``device``, in their shapes, from one copy: on CUDA each copy from the host costs the
    host some 20-30 us (a pinned staging buffer, the copy, an event) whatever its size,
    and a verify step needs a dozen such arrays."""
    return device_arrays(device, np.int64, *values)


def device_arrays(device: torch.device, dtype: type, *values) -> list[torch.Tensor]:
    """``device_indices`` in ``dtype``. Each array starts a multiple of ``ALIGN_BYTES``
    into the copy: a kernel may read its arguments in aligned vectors."""
    arrays = [np.asarray(v, dtype=dtype) for v in values]
    step = max(1, ALIGN_BYTES // np.dtype(dtype).itemsize)
    starts = np.cumsum([0] + [-(-a.size // step) * step for a in arrays])
    host = np.zeros(int(starts[-1]), dtype=dtype)
    for a, at in zip(arrays, starts):
        host[at : at + a.size] = a.reshape(-1)
    flat = host_to_device(host, device)
    return [flat[at : at + a.size].view(a.shape) for a, at in zip(arrays, starts)]


def slots_of(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slot of each row's position through its own row of ``block_tables``, on the
    device (positions known there only)."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    return block_tables[rows, positions // block_size].long() * block_size + positions % block_size


def move_back(meta: AttentionMetadata, positions: torch.Tensor, rows: torch.Tensor,
              seqs: torch.Tensor, by: torch.Tensor, block_size: int) -> None:  # fmt: skip
    """Move the one-token sequences ``seqs`` (the step's rows ``rows``) back by ``by``
    positions, in place on the device: their positions (each stream's, M-RoPE's too),
    lengths and KV slots. Their host-side lengths stay bounds (``AttentionMetadata``)."""
    positions[..., rows] -= by
    meta.seq_lens[seqs] -= by.to(meta.seq_lens.dtype)
    # a one-token sequence's token index is its length - 1
    meta.slot_mapping[rows] = slots_of(meta.block_tables[seqs], meta.seq_lens[seqs].long() - 1,
                                       block_size)  # fmt: skip


class AttentionBackend(ABC):
    """Paged attention over a ``KVCache`` with components ``k`` and ``v``."""

    def __init__(
        self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ):
        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] → output [T, Hq, D]; stores k, v in the cache."""


class MLABackend(ABC):
    """Multi-head latent attention over a ``KVCache`` with the one component ``latent``.

    Per token and layer the cache holds ``latent = [c, k_pe]``: the normalised compressed
    KV ``c`` (``kv_lora_rank``) and the rotated key ``k_pe`` (``qk_rope_head_dim``) that
    every head shares. Head h's key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``,
    where ``kv_b`` (the model's ``kv_b_proj`` weight, [H * (nope + v), kv_lora_rank]) stacks
    ``W_UK[h]`` (nope rows) over ``W_UV[h]`` (v rows) for each head in turn. A backend may
    decompress keys and values (prefill) or fold ``W_UK`` into the query and apply ``W_UV``
    after attending over the latents themselves (decode); the result is the same.
    """

    def __init__(self, cache: KVCache, num_heads: int, mla: MLAConfig, scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.mla = mla
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, nope + rope] (rotary part rotated), latent: [T, kv_lora_rank + rope]
        → output [T, H, v_head_dim]; stores the latents in the cache."""


@dataclass
class ForwardContext:
    """Everything a model forward needs besides its inputs; built per step, never global.

    ``backend`` is the kind the model's attention asks for: an ``AttentionBackend`` for
    ``attention``, an ``MLABackend`` for ``mla_attention``."""

    meta: AttentionMetadata
    backend: AttentionBackend | MLABackend

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if not q.shape[0]:  # a forward over no tokens (an idle expert-parallel rank)
            return q.new_empty(q.shape)
        return self.backend.forward(layer, q, k, v, self.meta)

    def mla_attention(
        self, layer: int, q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor
    ) -> torch.Tensor:
        if not q.shape[0]:
            return q.new_empty(0, q.shape[1], self.backend.mla.v_head_dim)
        return self.backend.forward(layer, q, latent, kv_b, self.meta)
