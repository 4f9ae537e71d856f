"""A worker as one rank of an expert-parallel group: the ranks step in lockstep.

Each rank of a group is a worker process of its own (its own channel, scheduler, KV cache,
prefix cache and KV events: attention is data-parallel), but its MoE layers exchange
tokens with every other rank's in every forward. So the group's steps are *rounds*, and a
role in a group calls ``round`` exactly once per iteration of the worker shell's loop —
from ``step`` and from ``tick`` alike (the shell calls one of them per iteration):

1. The ranks all-reduce two flags: whether any has something to run, and whether all are
   draining with nothing held (then the shell may return on every rank at once).
2. If any has something to run, every rank runs one engine step; one that runs no
   forward in it (nothing of its own, or a plan that fits nothing) runs the model over no
   tokens, so that every rank takes part in every MoE layer's dispatch and combine.
3. Every rank then closes the step for its expert counts, and every ``eplb_interval``
   steps the group rebalances (``engine.ep.experts``), all ranks at the same round.

While the group is idle, each rank waits ``IDLE_WAIT_MS`` for input between rounds
(``wait_ms``), so a request that arrives at one rank is run within that long by all.

A collective that fails (a peer died: gloo sees its socket close at once; or hung past
``ExpertParallelConfig.timeout_s``) raises ``GroupFailed``: the rank cannot go on alone,
and the frontend takes the whole group down. Without a ``GroupMember`` the group is this
rank alone (``SoloComm``), which still records the routing trace.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ExpertParallelConfig
from engine.ep.comm import MAX, GroupComm, SoloComm, join
from engine.ep.experts import ExpertParallel, Rebalanced
from engine.messages import ExpertStats, RequestOutput
from engine.worker.config import GroupMember

if TYPE_CHECKING:
    from engine.core import EngineCore

log = logging.getLogger("ferry.ep")

IDLE_WAIT_MS = 10  # an idle group's ranks meet this often
JOIN_TIMEOUT_S = 900.0  # every rank has loaded its model and joined by then


class ExpertGroup:
    """This process's rank of ``member``'s group (module docstring); ``device``: where its
    engine runs (NCCL carries the tokens between GPUs, gloo the round flags; gloo both on
    the CPU); ``name``: the worker's, which names its routing-trace file."""

    def __init__(self, member: GroupMember | None, config: ExpertParallelConfig, device: str,
                 name: str = "", give_up: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        started = time.perf_counter()
        self.member = member
        self.control: GroupComm = SoloComm()
        self.data: GroupComm = self.control
        if member is not None:
            self.control = self.data = self._join(member, "gloo", "control", config, give_up)
            if torch.device(device).type == "cuda":
                self.data = self._join(member, "nccl", "data", config, give_up)
                self.data.all_reduce(torch.zeros(1, device=device))  # NCCL connects lazily
        self.join_seconds = time.perf_counter() - started
        trace = None
        if config.routing_trace:
            file = re.sub(r"[^A-Za-z0-9_.-]", "_", name or "worker") + ".rtrace"
            trace = Path(config.routing_trace) / file
        self.experts = ExpertParallel(self.data, config, trace)
        self.busy = False  # some rank had something to run in the last round
        self.all_leaving = False  # every rank was draining with nothing held, last round
        self.rounds = 0
        self.steps = 0

    @staticmethod
    def _join(member: GroupMember, backend: str, part: str, config: ExpertParallelConfig,
              give_up: Callable[[], bool]) -> GroupComm:  # fmt: skip
        return join(member.rendezvous, f"{member.name}/{part}", member.rank, member.size,
                    backend, member.host, config.timeout_s, JOIN_TIMEOUT_S, give_up)  # fmt: skip

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def size(self) -> int:
        return self.control.size

    @property
    def wait_ms(self) -> int:
        return IDLE_WAIT_MS

    def round(self, core: EngineCore, leaving: bool) -> list[RequestOutput]:
        """One round of the group (module docstring): ``core``'s step, or an empty forward
        when another rank runs one. ``leaving``: this rank is draining with nothing held."""
        flags = torch.tensor([float(core.has_work), float(not leaving)])
        self.control.all_reduce(flags, MAX)
        self.rounds += 1
        self.busy, self.all_leaving = bool(flags[0]), not bool(flags[1])
        if not self.busy:
            return []
        forwards = core.runner.num_forwards
        outputs = core.step() if core.has_work else []
        if core.runner.num_forwards == forwards:
            core.runner.idle_forward()
        self.steps += 1
        done = self.experts.end_step()
        if done is not None:
            self._log(done)
        return outputs

    def _log(self, done: Rebalanced) -> None:
        if done.moved:
            log.info("rank %d/%d: experts rebalanced at step %d: mean max/mean rank load "
                     "%.3f -> %.3f", self.rank, self.size, self.steps, done.before,
                     done.after)  # fmt: skip

    def stats(self) -> ExpertStats:
        """What the frontend shows of this rank's experts (per-expert and per-rank load)."""
        ep = self.experts
        member = self.member
        last = ep.last
        return ExpertStats(
            group=member.name if member else "", rank=self.rank, size=self.size,
            moe_layers=ep.moe_layers, num_experts=ep.num_experts,
            routed=ep.load.total.flatten().tolist(), computed=ep.computed,
            rebalances=ep.rebalances, imbalance=last.after if last else 0.0,
        )  # fmt: skip

    def close(self) -> None:
        self.experts.close()
        self.data.close()
        self.control.close()
