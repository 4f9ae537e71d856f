"""How many tokens each MoE layer routed to each logical expert: per step, over a sliding
window of steps, since start; and the routing trace, each step's counts in a file.

Counting happens on the device inside the MoE layers (``count``: an ``index_add_``, no
host synchronisation, so a captured decode step counts too); ``end_step`` closes a step:
its counts go into the window (a ring of ``window`` steps) and the total, and to the trace
when one is recorded (the trace's write reads the counts back to the host).

The trace file (``RoutingTrace``): one line of JSON (``{"format": "ferry-routing-trace",
"version": 1, "layers": L, "experts": E, ...}``), then one record per step, ``L * E``
little-endian int32: the pairs (token, choice) routed to expert ``e`` of MoE layer ``l``
at ``l * E + e``. The ranks of a group each record the tokens they routed, one file per
rank; their step ``i`` is the same step of the group (the ranks step in lockstep).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

TRACE_FORMAT = "ferry-routing-trace"
TRACE_VERSION = 1


class ExpertLoad:
    def __init__(self, num_layers: int, num_experts: int, window: int,
                 device: torch.device | str, trace: Path | None = None,
                 trace_meta: dict | None = None) -> None:  # fmt: skip
        if window < 1:
            raise ValueError("the EPLB window is at least one step")
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        shape = (num_layers, num_experts)
        self.current = torch.zeros(shape, dtype=torch.int64, device=device)
        self.ring = torch.zeros((window, *shape), dtype=torch.int64, device=device)
        self.total = torch.zeros(shape, dtype=torch.int64, device=device)
        self.steps = 0
        self._trace: RoutingTrace | None = None
        if trace is not None:
            self.record(trace, trace_meta)

    def record(self, path: Path, meta: dict | None = None) -> None:
        """From the next step on, append each step's counts to a new trace at ``path``
        (the one recorded so far, if any, is closed)."""
        self.close()
        header = {"layers": self.num_layers, "experts": self.num_experts, **(meta or {})}
        self._trace = RoutingTrace.create(path, header)

    def count(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add a layer's choices (``topk_ids`` [T, K] logical expert ids) to this step."""
        flat = topk_ids.reshape(-1)
        self.current[layer].index_add_(0, flat, torch.ones_like(flat))

    def end_step(self) -> None:
        """Close the step: into the window, the total and the trace."""
        if self._trace is not None:
            self._trace.append(self.current.cpu().numpy())
        self.ring[self.steps % self.window].copy_(self.current)
        self.total += self.current
        self.current.zero_()
        self.steps += 1

    def window_counts(self) -> torch.Tensor:
        """[layers, experts]: the last ``window`` steps' counts, summed."""
        return self.ring.sum(dim=0)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None


class RoutingTrace:
    """A routing trace file, appended to step by step (module docstring)."""

    def __init__(self, path: Path, meta: dict, handle) -> None:
        self.path, self.meta, self._file = path, meta, handle

    @classmethod
    def create(cls, path: Path, meta: dict) -> RoutingTrace:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("wb")
        header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **meta}
        handle.write(json.dumps(header).encode() + b"\n")
        handle.flush()
        return cls(path, header, handle)

    def append(self, counts: np.ndarray) -> None:
        self._file.write(counts.astype("<i4").tobytes())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_trace(path: Path | str) -> tuple[dict, np.ndarray]:
    """(header, counts [steps, layers, experts]) of one trace file; a record cut short by
    a process that died while writing it is dropped."""
    data = Path(path).read_bytes()
    line, _, body = data.partition(b"\n")
    header = json.loads(line)
    if header.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not a routing trace")
    size = header["layers"] * header["experts"]
    steps = len(body) // (4 * size)
    counts = np.frombuffer(body[: steps * 4 * size], dtype="<i4")
    return header, counts.reshape(steps, header["layers"], header["experts"]).astype(np.int64)


def read_group_trace(paths: Sequence[Path | str]) -> tuple[dict, np.ndarray]:
    """The group's counts per step: its ranks' traces summed (over the steps all hold)."""
    parts = [read_trace(p) for p in paths]
    header = parts[0][0]
    steps = min(len(counts) for _, counts in parts)
    return header, sum(counts[:steps] for _, counts in parts)
