"""EPLB balance offline: a recorded routing trace replayed through the placement policy,
and the policy on Zipf-skewed counts.

    python -m bench.eplb_replay [TRACE ...] [--ranks 8,32] [--window 100] [--interval 50]

A trace (``ferry serve --routing-trace DIR``, or ``bench.ep_step --trace DIR``) holds
each step's tokens per MoE layer and expert (``engine.ep.load``); the files given are the
ranks of one group, summed step by step. For each group size N (that divides the
experts), with one redundant slot per rank, the steps are replayed three ways:

- ``static``: the placement before any load is known, no redundant slots
  (``eplb.initial_placement``: rank r holds a contiguous block of experts);
- ``online``: as serving does it, every ``--interval`` steps a new placement from the
  last ``--window`` steps' counts, used for the steps that follow (the first interval
  runs the initial placement with its redundant slots);
- ``hindsight``: one placement from the whole trace's counts, for every step (what the
  policy could do knowing the future).

Per placement: ``step``, the max / mean rank load of each step summed over steps (the
sum of the steps' heaviest ranks over the sum of their mean ranks: a step lasts as long as
its heaviest rank), and ``interval``, the same over each interval's summed counts (the
skew that persists across steps, which rebalancing can remove); each the mean over
layers and the worst layer. The Zipf part reports, per exponent, experts and ranks, the
max / mean rank load of the policy's placement of Zipf counts (one redundant slot per
rank) beside the placement without redundancy and the packing bound.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.common import machine_info
from engine.ep import eplb
from engine.ep.load import read_group_trace


def _ratio(loads: list[np.ndarray]) -> np.ndarray:
    """Per layer: sum over the items of the max rank load / sum of the mean rank load."""
    stack = np.stack(loads)  # [items, layers, ranks]
    mean = stack.mean(axis=2).sum(axis=0)
    return np.where(mean > 0, stack.max(axis=2).sum(axis=0) / np.where(mean > 0, mean, 1), 1.0)


def _summary(per_layer: np.ndarray) -> dict:
    return {"mean": float(per_layer.mean()), "worst_layer": float(per_layer.max())}


def replay(counts: np.ndarray, ranks: int, window: int, interval: int) -> dict:
    """The three placements' balance on ``counts`` [steps, layers, experts] (docstring)."""
    steps, layers, experts = counts.shape
    slots = experts + ranks
    static = eplb.initial_placement(layers, experts, ranks, experts)
    hindsight = eplb.rebalance(counts.sum(axis=0), ranks, slots)
    online = eplb.initial_placement(layers, experts, ranks, slots)
    out = {}
    for name in ("static", "online", "hindsight"):
        step_loads, interval_loads = [], []
        placement = {"static": static, "hindsight": hindsight, "online": online}[name]
        for start in range(0, steps, interval):
            if name == "online" and start > 0:
                placement = eplb.rebalance(counts[max(0, start - window) : start].sum(axis=0),
                                           ranks, slots)  # fmt: skip
            chunk = counts[start : start + interval]
            step_loads += [eplb.rank_loads(c, placement, ranks) for c in chunk]
            interval_loads.append(eplb.rank_loads(chunk.sum(axis=0), placement, ranks))
        out[name] = {"step": _summary(_ratio(step_loads)),
                     "interval": _summary(_ratio(interval_loads))}  # fmt: skip
    return out


def zipf_table() -> list[dict]:
    """The policy on Zipf counts (s = 1.0, 1.5; 64 and 256 experts; 8 and 32 ranks)."""
    rows = []
    rng = np.random.default_rng(0)
    for s in (1.0, 1.5):
        for experts in (64, 256):
            load = 1.0 / np.arange(1, experts + 1) ** s
            load = (load / load.sum() * 1e6)[rng.permutation(experts)][None, :]
            for ranks in (8, 32):
                slots = experts + ranks
                plain = eplb.initial_placement(1, experts, ranks, experts)
                placed = eplb.rebalance(load, ranks, slots)
                no_redundancy = eplb.rebalance(load, ranks, experts)
                rows.append({
                    "zipf_s": s, "experts": experts, "ranks": ranks,
                    "eplb": float(eplb.imbalance(load, placed, ranks)[0]),
                    "bound": float(eplb.packing_bound(load, ranks, slots)[0]),
                    "eplb_without_redundancy": float(
                        eplb.imbalance(load, no_redundancy, ranks)[0]),
                    "contiguous_without_redundancy": float(
                        eplb.imbalance(load, plain, ranks)[0]),
                })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("traces", nargs="*", help="one group's routing-trace files")
    parser.add_argument("--ranks", default="8,32", help="group sizes to replay")
    parser.add_argument("--window", type=int, default=100, help="steps a placement counts")
    parser.add_argument("--interval", type=int, default=50, help="steps between placements")
    parser.add_argument("--commit", help="commit to record (default: git's)")
    parser.add_argument("--out", default="bench/results/eplb_replay.json")
    args = parser.parse_args()
    started = time.time()
    record = {"benchmark": "eplb_replay", **machine_info(), "zipf": zipf_table()}
    if args.commit:
        record["commit"] = args.commit
    if args.traces:
        header, counts = read_group_trace(args.traces)
        steps, layers, experts = counts.shape
        record["trace"] = {"files": [str(t) for t in args.traces], "steps": steps,
                           "layers": layers, "experts": experts,
                           "pairs_per_step": float(counts.sum(axis=(1, 2)).mean() / layers),
                           "header": header}  # fmt: skip
        record["settings"] = {"window": args.window, "interval": args.interval}
        record["replay"] = {}
        for ranks in (int(n) for n in args.ranks.split(",")):
            if experts % ranks:
                continue
            record["replay"][f"ep{ranks}"] = replay(counts, ranks, args.window, args.interval)
    record["seconds"] = time.time() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("zipf", "replay") if k in record}, indent=2))


if __name__ == "__main__":
    main()
