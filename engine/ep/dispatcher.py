"""Tokens to the ranks that hold their experts, and the experts' results back.

A MoE layer of an expert-parallel model runs, on every rank of the group, at once:

    d = dispatcher.dispatch(hidden, slots, weights)   # pairs to the ranks owning their slot
    y = moe_experts(d.hidden, d.slots[:, None], d.weights[:, None], w13_local, w2_local)
    out = dispatcher.combine(y, d.handle)              # [T, H]: each token's sum

**The contract** (``MoEDispatcher``), for a group of ``num_ranks`` ranks holding
``slots_per_rank`` physical expert slots each (global slot ``s`` lives on rank
``s // slots_per_rank`` as its local slot ``s % slots_per_rank``):

- ``dispatch(hidden [T, H], slots [T, K] int64 global slot ids, weights [T, K] float32)``:
  every (token t, choice k) pair goes to the rank owning ``slots[t, k]``. ``T`` may differ
  between ranks and be 0 (a rank with nothing to run still calls it: every rank of the
  group calls ``dispatch`` and then ``combine`` once per MoE layer, in layer order). It
  returns ``Dispatched``: the rows this rank received, one per pair — ``hidden`` [R, H]
  in ``hidden``'s dtype, ``slots`` [R] int64 local slot ids, ``weights`` [R] float32 —
  grouped by source rank (rank 0's first) and, within a source, in its (t, k) order; and
  a ``handle`` that only ``combine`` reads.
- ``combine(out [R, H], handle)``: ``out`` row i is the weighted expert output of
  received row i (the routing weight already applied); returns [T, H] in ``out``'s dtype,
  row t the float32 sum over token t's K pairs, wherever they ran.
- Buffers: ``dispatch`` only reads its inputs and returns tensors of its own, which the
  caller owns from then on; ``combine`` may reuse ``out``'s storage, and returns a fresh
  tensor. Nothing is kept between layers but what the handle holds.
- ``capturable``: whether a CUDA graph may capture both calls (no host synchronisation
  and fixed shapes for a fixed T).

Backends: ``LocalDispatcher`` (one rank: the pairs stay, no copy leaves the device, so a
decode step still captures into a CUDA graph) and ``AllToAllDispatcher`` (torch.distributed
all-to-all with counts: NCCL on GPUs, gloo on the CPU). The latter exchanges the per-rank
pair counts first and reads them on the host — ``all_to_all_single`` takes its split
sizes as host integers — so it is not capturable: decode steps of a group of more than
one rank run eagerly. It sends a token's hidden state once per pair, also when two of its
experts sit on one rank. A DeepEP-style backend (per-(token, rank) rows, fixed-size
buffers that a graph can capture, NVLink/RDMA kernels) implements the same two calls; the
model does not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.ep.comm import GroupComm


@dataclass
class Dispatched:
    """The pairs a rank received (see the module docstring for their order)."""

    hidden: torch.Tensor  # [R, H]
    slots: torch.Tensor  # [R] int64, local slot ids
    weights: torch.Tensor  # [R] float32
    handle: Any


class MoEDispatcher(ABC):
    capturable: ClassVar[bool]

    def __init__(self, num_ranks: int, rank: int, slots_per_rank: int) -> None:
        self.num_ranks, self.rank, self.slots_per_rank = num_ranks, rank, slots_per_rank

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> Dispatched: ...  # fmt: skip

    @abstractmethod
    def combine(self, out: torch.Tensor, handle: Any) -> torch.Tensor: ...


class LocalDispatcher(MoEDispatcher):
    """The group of one rank: every slot is local, the pairs are the token rows repeated."""

    capturable = True

    def __init__(self, slots_per_rank: int) -> None:
        super().__init__(1, 0, slots_per_rank)

    def dispatch(self, hidden, slots, weights) -> Dispatched:
        tokens, top_k = slots.shape
        rows = hidden.repeat_interleave(top_k, dim=0) if top_k > 1 else hidden
        return Dispatched(rows, slots.reshape(-1), weights.reshape(-1).float(), (tokens, top_k))

    def combine(self, out, handle) -> torch.Tensor:
        tokens, top_k = handle
        return out.view(tokens, top_k, out.shape[-1]).float().sum(dim=1).to(out.dtype)


@dataclass
class _Sent:
    """What ``AllToAllDispatcher.combine`` needs of its ``dispatch``."""

    token_of: torch.Tensor  # [P] the token of each sent pair, in sent order
    sent: list[int]  # pairs sent to each rank
    received: list[int]  # pairs received from each rank
    tokens: int


class AllToAllDispatcher(MoEDispatcher):
    """Pairs sorted by destination rank, exchanged with ``GroupComm.all_to_all``: the
    counts first (read on the host), then the routing metadata and the hidden states; the
    results come back the same way."""

    capturable = False

    def __init__(self, comm: GroupComm, slots_per_rank: int) -> None:
        super().__init__(comm.size, comm.rank, slots_per_rank)
        self.comm = comm

    def dispatch(self, hidden, slots, weights) -> Dispatched:
        tokens, top_k = slots.shape
        flat = slots.reshape(-1)
        dest = torch.div(flat, self.slots_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # by destination, then (t, k)
        counts = torch.bincount(dest, minlength=self.num_ranks)
        theirs = torch.empty_like(counts)
        self.comm.all_to_all(theirs, counts, [1] * self.num_ranks, [1] * self.num_ranks)
        sent, received = counts.tolist(), theirs.tolist()
        token_of = torch.div(order, top_k, rounding_mode="floor")
        # local slot and weight side by side: a slot id is exact in float32 (< 2**24)
        meta = torch.stack(((flat[order] % self.slots_per_rank).float(),
                            weights.reshape(-1)[order].float()), dim=1)  # fmt: skip
        got_meta = meta.new_empty(sum(received), 2)
        self.comm.all_to_all(got_meta, meta, received, sent)
        got = hidden.new_empty(sum(received), hidden.shape[1])
        self.comm.all_to_all(got, hidden[token_of].contiguous(), received, sent)
        handle = _Sent(token_of, sent, received, tokens)
        return Dispatched(got, got_meta[:, 0].long(), got_meta[:, 1].contiguous(), handle)

    def combine(self, out, handle: _Sent) -> torch.Tensor:
        back = out.new_empty(sum(handle.sent), out.shape[1])
        self.comm.all_to_all(back, out.contiguous(), handle.sent, handle.received)
        total = torch.zeros(handle.tokens, out.shape[1], dtype=torch.float32, device=out.device)
        return total.index_add_(0, handle.token_of, back.float()).to(out.dtype)


def make_dispatcher(comm: GroupComm, slots_per_rank: int) -> MoEDispatcher:
    """The dispatcher for ``comm``'s group: local on one rank, all-to-all otherwise."""
    if comm.size == 1:
        return LocalDispatcher(slots_per_rank)
    return AllToAllDispatcher(comm, slots_per_rank)
