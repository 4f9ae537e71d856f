"""The expert-parallel load balancer (EPLB): where each layer's experts live, from their load.

A group of ``num_ranks`` ranks has ``num_slots`` physical expert slots per MoE layer
(``num_experts`` logical experts plus the redundant ones), ``num_slots / num_ranks`` on each
rank, slot ``s`` on rank ``s // (num_slots / num_ranks)``. A *placement* is ``phy2log``
[layers, num_slots]: the logical expert each slot holds. Every logical expert has at least
one slot; one with ``c`` slots (replicas) has its tokens split evenly over them, so each
replica carries ``load / c``.

The policy, per layer, from the tokens routed to each logical expert in a window:

1. **Replicate**: give the redundant slots one by one to the logical expert whose load per
   replica is the highest at that moment, up to one replica per rank (``replicate``).
   Greedy is optimal for the largest load per replica.
2. **Place**: pack the replicas onto ranks, heaviest first, each onto the lightest rank
   that still has a free slot and does not hold that expert yet (``pack``: longest
   processing time first, with the ranks' slot counts as capacity), then swap pairs of
   replicas between the heaviest rank and another while that lowers the heavier of the two
   (``_improve``). The objective is the largest rank load of the layer.
3. **Hierarchically**, when the group spans ``num_nodes`` nodes (tokens crossing nodes cost
   more): first the logical experts — in the ``num_groups`` groups of a model with grouped
   routing, which keeps a token's experts on few nodes — are packed onto nodes by load
   with equal counts per node, then steps 1-2 run within each node on its share of slots
   and ranks. Where the groups do not divide over the nodes, the placement is global.

Everything here is a pure function of numpy arrays, deterministic (ties go to the lowest
index), so every rank of a group computes the same placement from the same counts.
"""

from __future__ import annotations

import numpy as np

_IMPROVE_ROUNDS = 64  # pair swaps tried per layer, at most


def replicate(load: np.ndarray, num_slots: int, max_replicas: int = 0) -> np.ndarray:
    """Replicas per logical expert (``load`` [E]): one each, and each of the
    ``num_slots - E`` others to the expert with the highest load per replica then, among
    those with fewer than ``max_replicas`` (the ranks: a second replica on one rank gains
    nothing; 0: no limit) while there are such."""
    num_experts = load.shape[0]
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
    counts = np.ones(num_experts, dtype=np.int64)
    load = load.astype(np.float64)
    for _ in range(num_slots - num_experts):
        per_replica = load / counts
        if max_replicas and (counts < max_replicas).any():
            per_replica = np.where(counts < max_replicas, per_replica, -1.0)
        counts[int(np.argmax(per_replica))] += 1
    return counts


def pack(weights: np.ndarray, items: np.ndarray, num_packs: int) -> np.ndarray:
    """The pack (0 .. ``num_packs - 1``) of each item: ``len(weights) / num_packs`` items per
    pack, heaviest first onto the lightest pack with room that holds no item of the same
    ``items`` value (a logical expert) yet, when there is one; then pair swaps that lower
    the heaviest pack (``_improve``)."""
    size = len(weights)
    if size % num_packs:
        raise ValueError(f"{size} items do not split evenly into {num_packs} packs")
    if num_packs == 1:
        return np.zeros(size, dtype=np.int64)
    per_pack = size // num_packs
    order = np.argsort(-weights, kind="stable")
    where = np.empty(size, dtype=np.int64)
    totals = np.zeros(num_packs)
    filled = np.zeros(num_packs, dtype=np.int64)
    held: list[set[int]] = [set() for _ in range(num_packs)]
    for i in order:
        room = filled < per_pack
        fresh = room & np.array([int(items[i]) not in h for h in held])
        choice = fresh if fresh.any() else room
        p = int(np.flatnonzero(choice)[np.argmin(totals[choice])])
        where[i] = p
        totals[p] += weights[i]
        filled[p] += 1
        held[p].add(int(items[i]))
    return _improve(weights, items, where, num_packs)


def _improve(weights: np.ndarray, items: np.ndarray, where: np.ndarray,
             num_packs: int) -> np.ndarray:  # fmt: skip
    """Swap an item of the heaviest pack with a lighter item of another pack while that
    lowers the heavier of the two packs below the heaviest (never two replicas of one expert
    onto one pack)."""
    where = where.copy()
    held = np.zeros((num_packs, int(items.max()) + 1), dtype=np.int64)
    np.add.at(held, (where, items), 1)
    for _ in range(_IMPROVE_ROUNDS):
        totals = np.bincount(where, weights, minlength=num_packs)
        top = int(np.argmax(totals))
        best, swap = totals[top], None
        others = np.flatnonzero(where != top)
        for i in np.flatnonzero(where == top):
            delta = weights[i] - weights[others]
            worse = np.maximum(totals[top] - delta, totals[where[others]] + delta)
            free = (held[where[others], items[i]] == 0) & (held[top, items[others]] == 0)
            worse = np.where((delta > 0) & free, worse, np.inf)
            k = int(np.argmin(worse))
            if worse[k] < best - 1e-12:
                best, swap = worse[k], (int(i), int(others[k]))
        if swap is None:
            break
        i, j = swap
        held[where[i], items[i]] -= 1
        held[where[j], items[j]] -= 1
        where[i], where[j] = where[j], where[i]
        held[where[i], items[i]] += 1
        held[where[j], items[j]] += 1
    return where


def place_layer(load: np.ndarray, num_ranks: int, num_slots: int) -> np.ndarray:
    """One layer's ``phy2log`` [num_slots] over ``num_ranks`` ranks (steps 1 and 2)."""
    if num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots do not split evenly over {num_ranks} ranks")
    counts = replicate(load, num_slots, num_ranks)
    experts = np.repeat(np.arange(len(load)), counts)
    weights = load[experts] / counts[experts]
    rank_of = pack(weights, experts, num_ranks)
    per_rank = num_slots // num_ranks
    phy2log = np.empty(num_slots, dtype=np.int64)
    for r in range(num_ranks):
        mine = np.flatnonzero(rank_of == r)
        # a rank's slots in logical order: a slot keeps its expert when loads change little
        phy2log[r * per_rank : (r + 1) * per_rank] = np.sort(experts[mine])
    return phy2log


def place_hierarchical(load: np.ndarray, num_ranks: int, num_slots: int, num_nodes: int,
                       num_groups: int = 0) -> np.ndarray:  # fmt: skip
    """One layer's ``phy2log`` over ``num_nodes`` nodes of ``num_ranks / num_nodes`` ranks
    (step 3): expert groups (``num_groups``; 0: one expert each) onto nodes, then each
    node's experts over its ranks. Global where the groups do not split over the nodes."""
    num_experts = len(load)
    groups = num_groups or num_experts
    if num_nodes <= 1 or groups % num_nodes or num_ranks % num_nodes or num_slots % num_nodes:
        return place_layer(load, num_ranks, num_slots)
    per_group = num_experts // groups
    group_load = load.reshape(groups, per_group).sum(axis=1)
    node_of = pack(group_load, np.arange(groups), num_nodes)
    ranks, slots = num_ranks // num_nodes, num_slots // num_nodes
    phy2log = np.empty(num_slots, dtype=np.int64)
    for n in range(num_nodes):
        mine = (np.flatnonzero(node_of == n)[:, None] * per_group + np.arange(per_group)).ravel()
        mine.sort()
        local = place_layer(load[mine], ranks, slots)
        phy2log[n * slots : (n + 1) * slots] = mine[local]
    return phy2log


def rebalance(load: np.ndarray, num_ranks: int, num_slots: int, num_nodes: int = 1,
              num_groups: int = 0) -> np.ndarray:  # fmt: skip
    """The placement ``phy2log`` [layers, num_slots] for ``load`` [layers, experts] (tokens
    routed to each logical expert in the window)."""
    load = np.asarray(load, dtype=np.float64)
    return np.stack([
        place_hierarchical(layer, num_ranks, num_slots, num_nodes, num_groups) for layer in load
    ])  # fmt: skip


def rank_loads(load: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """Each rank's load [layers, num_ranks] under ``phy2log``: every replica of an expert
    carries an equal share of its tokens."""
    load = np.asarray(load, dtype=np.float64)
    layers, num_slots = phy2log.shape
    out = np.zeros((layers, num_ranks))
    per_rank = num_slots // num_ranks
    for layer in range(layers):
        counts = np.bincount(phy2log[layer], minlength=load.shape[1])
        share = load[layer][phy2log[layer]] / counts[phy2log[layer]]
        out[layer] = share.reshape(num_ranks, per_rank).sum(axis=1)
    return out


def imbalance(load: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """max / mean rank load per layer (1.0: perfectly even; layers without load: 1.0)."""
    loads = rank_loads(load, phy2log, num_ranks)
    mean = loads.mean(axis=1)
    return np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


def packing_bound(load: np.ndarray, num_ranks: int, num_slots: int) -> np.ndarray:
    """Per layer, a lower bound of max / mean that no packing of this module's replication
    (``replicate``, at most one replica per rank) beats: the largest replica, the mean, and
    for each ``j`` below the slots per rank ``k``: of the ``j * num_ranks + 1`` largest
    replicas some rank holds ``j + 1``, so it carries at least the ``j + 1`` smallest of
    them plus the ``k - j - 1`` smallest replicas overall. Where it exceeds 1, the slots do
    not allow an even spread."""
    load = np.asarray(load, dtype=np.float64)
    per_rank = num_slots // num_ranks
    out = np.ones(load.shape[0])
    for layer, row in enumerate(load):
        mean = row.sum() / num_ranks
        if mean <= 0:
            continue
        counts = replicate(row, num_slots, num_ranks)
        weights = np.sort(np.repeat(row / counts, counts))[::-1]
        bound = max(weights[0], mean)
        for j in range(1, per_rank):
            top = weights[: j * num_ranks + 1]
            bound = max(bound, top[-(j + 1) :].sum() + weights[::-1][: per_rank - j - 1].sum())
        out[layer] = bound / mean
    return out


def initial_placement(num_layers: int, num_experts: int, num_ranks: int,
                      num_slots: int) -> np.ndarray:  # fmt: skip
    """The placement before any load is known: expert ``e`` in slot ``e`` of the ranks'
    first ``num_experts / num_ranks`` slots each (rank ``r`` holds a contiguous block),
    the redundant slots holding replicas of experts that rank does not hold, in turn."""
    if num_experts % num_ranks or num_slots % num_ranks or num_slots < num_experts:
        raise ValueError(f"{num_experts} experts in {num_slots} slots over {num_ranks} ranks "
                         "need both to split evenly")  # fmt: skip
    own, extra = num_experts // num_ranks, (num_slots - num_experts) // num_ranks
    rows = []
    for r in range(num_ranks):
        block = list(range(r * own, (r + 1) * own))
        others = [(r + 1) * own + i for i in range(extra)]
        rows += block + [e % num_experts for e in others]
    return np.tile(np.array(rows, dtype=np.int64), (num_layers, 1))
