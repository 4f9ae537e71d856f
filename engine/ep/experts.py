"""A rank's share of a MoE model's routed experts, and how it changes (EPLB).

``ExpertParallel.attach(model)`` puts an ``ExpertSlots`` module in place of each MoE
layer's ``Experts`` (``engine.models.moe``): the rank keeps the weights of its own
``slots_per_rank`` physical slots only, and the layer's call becomes route → dispatch →
local experts → combine, with the same result. Dense layers, shared experts, attention and
the embeddings stay replicated, as the model loaded them.

**Routing.** A placement ``phy2log`` [MoE layers, slots] (``engine.ep.eplb``) says which
logical expert each slot holds. A layer's ``RoutingTable`` maps a token's chosen logical
expert to one of its replicas: pair number ``i`` of a step (token t, choice k: ``i = t*K +
k``) on rank r takes replica ``(i + r) % replicas``, so each rank spreads its pairs evenly
over an expert's replicas without any communication. Every replica holds the same
weights: which one computes a pair does not change the result.

**Rebalancing** (``rebalance``, on every rank at the same step): the window's counts are
summed over the group, every rank computes the same new placement from them (the policy
is deterministic), and where it lowers the layers' mean max/mean rank load the weights
move: a slot whose expert another slot of this rank already holds is copied locally, any
other is received from the lowest rank that holds it, in one all-to-all per layer whose
row counts every rank knows without asking. The routing tables switch with the weights,
between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import ExpertParallelConfig
from engine.ep import eplb
from engine.ep.comm import SUM, GroupComm
from engine.ep.dispatcher import MoEDispatcher, make_dispatcher
from engine.ep.load import ExpertLoad
from engine.models.moe import MoE


class RoutingTable:
    """One layer's logical expert → replica slots, on the device (module docstring)."""

    def __init__(self, phy2log: np.ndarray, num_experts: int, device: torch.device) -> None:
        counts = np.bincount(phy2log, minlength=num_experts)
        if (counts == 0).any():
            raise ValueError(f"experts {np.flatnonzero(counts == 0).tolist()} have no slot")
        table = np.full((num_experts, counts.max()), -1, dtype=np.int64)
        for e in range(num_experts):
            where = np.flatnonzero(phy2log == e)
            table[e, : len(where)] = where
        self.slots = torch.from_numpy(table).to(device)
        self.counts = torch.from_numpy(counts).to(device)

    def route(self, topk_ids: torch.Tensor, offset: int) -> torch.Tensor:
        """The global slot [T, K] of each (token, choice) pair."""
        flat = topk_ids.reshape(-1)
        pair = torch.arange(flat.numel(), device=flat.device) + offset
        replica = pair % self.counts[flat]
        return self.slots[flat, replica].view(topk_ids.shape)


class ExpertSlots(nn.Module):
    """One MoE layer's experts on one rank: ``local``, the layer's own kind of experts
    module (``Experts``, or ``Fp8Experts`` under ``--quantization fp8``) holding this
    rank's ``slots_per_rank`` slots, local slot ``j`` being global slot ``rank *
    slots_per_rank + j``. ``forward`` has ``Experts.forward``'s contract."""

    def __init__(self, local: nn.Module, layer: int, ep: ExpertParallel) -> None:
        super().__init__()
        self.local = local
        self.layer = layer  # the MoE layer's index among the model's MoE layers
        self._ep = [ep]  # shared, kept out of this module's children

    @property
    def w13(self) -> torch.Tensor:
        return self.local.w13

    @property
    def w2(self) -> torch.Tensor:
        return self.local.w2

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ep = self._ep[0]
        ep.load.count(self.layer, topk_ids)
        slots = ep.tables[self.layer].route(topk_ids, ep.rank)
        got = ep.dispatcher.dispatch(hidden, slots, topk_weights)
        rows = got.hidden.shape[0]
        ep.computed += rows
        if rows:
            out = self.local(got.hidden, got.slots[:, None], got.weights[:, None])
        else:
            out = got.hidden.new_empty(0, hidden.shape[1])
        return ep.dispatcher.combine(out, got.handle)


@dataclass(frozen=True)
class Rebalanced:
    """What a rebalance decided: the window's mean max/mean rank load under the old and
    the new placement, and whether the weights moved."""

    before: float
    after: float
    moved: bool


class ExpertParallel:
    """This rank's share of the experts (module docstring), over ``comm``'s group.

    ``trace``: the file this rank records its routing trace into (None: none)."""

    def __init__(self, comm: GroupComm, config: ExpertParallelConfig,
                 trace: Path | None = None) -> None:  # fmt: skip
        self.comm, self.config, self.trace = comm, config, trace
        self.rank, self.size = comm.rank, comm.size
        self.layers: list[ExpertSlots] = []
        self.tables: list[RoutingTable] = []
        self.moe_layers: list[int] = []  # decoder layer index of each MoE layer
        self.computed = 0  # pairs this rank's slots computed, since start
        self.rebalances = 0
        self.last: Rebalanced | None = None
        self.dispatcher: MoEDispatcher | None = None
        self.load: ExpertLoad | None = None
        self.phy2log: np.ndarray | None = None

    @property
    def num_slots(self) -> int:
        return self.num_experts + self.config.redundant_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.size

    def attach(self, model: nn.Module) -> None:
        """Keep only this rank's slots of every MoE layer of ``model`` (loaded whole), in
        the initial placement (``eplb.initial_placement``)."""
        layers = [(i, layer.mlp) for i, layer in enumerate(model.model.layers)
                  if isinstance(layer.mlp, MoE)]  # fmt: skip
        if not layers:
            raise ValueError("expert parallelism needs a model with MoE layers")
        first = layers[0][1].experts
        self.num_experts = first.w13.shape[0]
        if self.num_experts % self.size or self.config.redundant_experts % self.size:
            raise ValueError(f"{self.num_experts} experts and {self.config.redundant_experts} "
                             f"redundant slots must both split over {self.size} ranks")  # fmt: skip
        self.moe_layers = [i for i, _ in layers]
        self.device = first.w13.device
        self.phy2log = eplb.initial_placement(len(layers), self.num_experts, self.size,
                                              self.num_slots)  # fmt: skip
        self.dispatcher = make_dispatcher(self.comm, self.slots_per_rank)
        meta = {"rank": self.rank, "ranks": self.size, "moe_layers": self.moe_layers}
        self.load = ExpertLoad(len(layers), self.num_experts, self.config.eplb_window,
                               self.device, self.trace, meta)  # fmt: skip
        for index, (_, moe) in enumerate(layers):
            local = self._local(self.phy2log[index])
            full = moe.experts
            if not np.array_equal(local, np.arange(self.num_experts)):  # else all: no copy
                # a layer at a time: the whole layer's experts go once it is replaced
                mine = torch.from_numpy(local).to(self.device)
                full = type(full).from_stacked(*(t.index_select(0, mine)
                                                 for t in full.stacked()))  # fmt: skip
            moe.experts = ExpertSlots(full, index, self)
            self.layers.append(moe.experts)
        self.tables = [RoutingTable(row, self.num_experts, self.device) for row in self.phy2log]

    def _local(self, row: np.ndarray, rank: int | None = None) -> np.ndarray:
        """The logical experts of ``rank``'s slots in the layer placement ``row``."""
        rank = self.rank if rank is None else rank
        return row[rank * self.slots_per_rank : (rank + 1) * self.slots_per_rank]

    # -- after each step ----------------------------------------------------------------

    def end_step(self) -> Rebalanced | None:
        """Close a step of the group (every rank calls it after the same step); every
        ``eplb_interval`` steps, rebalance."""
        self.load.end_step()
        interval = self.config.eplb_interval
        if interval and self.load.steps % interval == 0:
            return self.rebalance()
        return None

    def rebalance(self) -> Rebalanced:
        """Place the experts anew from the group's window counts, and move the weights
        when that is better (module docstring). Every rank of the group calls it at once."""
        counts = self.comm.all_reduce(self.load.window_counts(), SUM)
        load = counts.cpu().numpy()
        old = self.phy2log
        before = float(eplb.imbalance(load, old, self.size).mean())
        if not load.any():
            self.last = Rebalanced(before, before, False)
            return self.last
        new = eplb.rebalance(load, self.size, self.num_slots)
        after = float(eplb.imbalance(load, new, self.size).mean())
        moved = after < before - 1e-9
        if moved:
            self.apply(new)
            self.rebalances += 1
        self.last = Rebalanced(before, after if moved else before, moved)
        return self.last

    @torch.no_grad()
    def apply(self, phy2log: np.ndarray) -> None:
        """Switch to the placement ``phy2log``: weights and routing tables."""
        for index, layer in enumerate(self.layers):
            old, new = self.phy2log[index], phy2log[index]
            if np.array_equal(old, new):
                continue
            layer.local = type(layer.local).from_stacked(*self._moved(layer, old, new))
            self.tables[index] = RoutingTable(new, self.num_experts, self.device)
        self.phy2log = phy2log.copy()

    def _moved(self, layer: ExpertSlots, old: np.ndarray,
               new: np.ndarray) -> list[torch.Tensor]:  # fmt: skip
        """This rank's weights under ``new`` (``layer.local.stacked()``'s tensors): local
        copies, and what the other ranks send, each slot's tensors moved as one row of
        bytes."""
        spr, me = self.slots_per_rank, self.rank
        sources = [self._source(old, int(e), s // spr) for s, e in enumerate(new)]
        sends = [[sources[r * spr + j][1] for j in range(spr)
                  if sources[r * spr + j][0] == me and r != me]
                 for r in range(self.size)]  # fmt: skip
        received = [sum(1 for j in range(spr) if sources[me * spr + j][0] == src)
                    if src != me else 0 for src in range(self.size)]  # fmt: skip
        tensors = layer.local.stacked()
        flat = torch.cat([t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors], dim=1)
        order = torch.tensor([j for rows in sends for j in rows], dtype=torch.long,
                             device=flat.device)  # fmt: skip
        got = flat.new_empty(sum(received), flat.shape[1])
        self.comm.all_to_all(got, flat.index_select(0, order), received, [len(r) for r in sends])
        out = flat.new_empty(spr, flat.shape[1])
        taken = dict.fromkeys(range(self.size), 0)
        starts = np.concatenate(([0], np.cumsum(received)))
        for j in range(spr):
            src, slot = sources[me * spr + j]
            if src == me:
                out[j] = flat[slot]
            else:
                out[j] = got[starts[src] + taken[src]]
                taken[src] += 1
        moved, at = [], 0
        for t in tensors:
            width = t[0].numel() * t.element_size()
            moved.append(out[:, at : at + width].contiguous().view(t.dtype)
                         .reshape(spr, *t.shape[1:]))  # fmt: skip
            at += width
        return moved

    def _source(self, old: np.ndarray, expert: int, rank: int) -> tuple[int, int]:
        """(rank, local slot) where a slot of ``rank`` that is to hold ``expert`` gets it:
        ``rank``'s own slot holding it already, else the lowest rank's."""
        here = np.flatnonzero(self._local(old, rank) == expert)
        if len(here):
            return rank, int(here[0])
        slot = int(np.flatnonzero(old == expert)[0])
        return slot // self.slots_per_rank, slot % self.slots_per_rank

    def close(self) -> None:
        if self.load is not None:
            self.load.close()
