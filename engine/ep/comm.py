"""The collectives an expert-parallel group needs, over torch.distributed or on one rank.

``GroupComm`` is what the dispatcher, the lockstep rounds and the weight moves of a
rebalance call: ``all_reduce`` and ``all_to_all`` with per-rank row counts, blocking until
done (they raise ``GroupFailed`` when a peer is gone or silent past the group's timeout).
``TorchComm`` runs them on a torch.distributed process group made directly from a store
(``join``: gloo on the CPU, NCCL on CUDA devices, no global ``init_process_group``);
``SoloComm`` is the one-rank group, where both are copies.

The rendezvous of a group on one host is a ``FileStore`` in a directory only the group's
owner can read (the frontend's private temporary directory), so only processes of that
user that were told the path can join. A group that spans hosts meets at
``tcp://HOST:PORT`` instead, a ``TCPStore`` that rank 0 serves on ``PORT`` (the
deployment keeps that port reachable from the group's hosts alone). The process group's
own connections bind ``host`` (loopback unless the group spans hosts).
"""

from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

SUM, MAX, MIN = "sum", "max", "min"
_ARRIVAL_POLL_S = 0.05  # how often a rank looks whether the others have arrived


class GroupFailed(RuntimeError):
    """A collective of the group did not complete: a rank died, hung or left."""


class GroupComm(ABC):
    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = SUM) -> torch.Tensor:
        """``tensor`` reduced over the group, in place; returns it."""

    @abstractmethod
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_rows: list[int],
                   in_rows: list[int]) -> torch.Tensor:  # fmt: skip
        """Rank r's ``inp`` rows ``sum(in_rows[:d]) ..`` (``in_rows[d]`` of them) go to rank
        d; ``out`` receives, by source rank in order, ``out_rows[s]`` rows from rank s."""

    def close(self) -> None:  # noqa: B027 - nothing to release for one rank
        pass


class SoloComm(GroupComm):
    """A group of one: reductions are the identity, an all-to-all a copy."""

    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, op: str = SUM) -> torch.Tensor:
        return tensor

    def all_to_all(self, out, inp, out_rows, in_rows) -> torch.Tensor:
        return out.copy_(inp)


class TorchComm(GroupComm):
    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._ops = {SUM: torch.distributed.ReduceOp.SUM, MAX: torch.distributed.ReduceOp.MAX,
                     MIN: torch.distributed.ReduceOp.MIN}  # fmt: skip

    def all_reduce(self, tensor: torch.Tensor, op: str = SUM) -> torch.Tensor:
        options = torch.distributed.AllreduceOptions()
        options.reduceOp = self._ops[op]
        self._wait(self.group.allreduce([tensor], options))
        return tensor

    def all_to_all(self, out, inp, out_rows, in_rows) -> torch.Tensor:
        work = self.group.alltoall_base(out, inp, list(out_rows), list(in_rows),
                                        torch.distributed.AllToAllOptions())  # fmt: skip
        self._wait(work)
        return out

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a peer's socket closed; both: the timeout
            raise GroupFailed(f"rank {self.rank} of {self.size}: {_first_line(exc)}") from None

    def close(self) -> None:
        self.group = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def join(rendezvous: str, name: str, rank: int, size: int, backend: str, host: str,
         timeout_s: float, join_timeout_s: float,
         give_up: Callable[[], bool] = lambda: False) -> TorchComm:  # fmt: skip
    """Rank ``rank`` of the ``size``-rank process group ``name`` (a store prefix, so one
    rendezvous file can serve several groups), through the ``FileStore`` at ``rendezvous``;
    returns once every rank has joined. Raises ``GroupFailed`` after ``join_timeout_s``,
    or as soon as ``give_up()`` says so while it waits for the others (the frontend that
    started it is gone). Collectives give up after ``timeout_s``."""
    import torch.distributed as dist

    store = _store(rendezvous, rank, size, join_timeout_s)
    prefixed = dist.PrefixStore(name, store)
    deadline = time.monotonic() + join_timeout_s
    prefixed.add("arrived", 1)
    while prefixed.add("arrived", 0) < size:
        if give_up() or time.monotonic() > deadline:
            why = "gave up" if give_up() else f"not all there after {join_timeout_s:.0f} s"
            raise GroupFailed(f"rank {rank} of {size} could not join {name}: {why}")
        time.sleep(_ARRIVAL_POLL_S)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        elif backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            group = dist.ProcessGroupGloo(prefixed, rank, size, options)
        else:
            raise ValueError(f"unknown process group backend {backend!r}")
    except RuntimeError as exc:
        raise GroupFailed(f"rank {rank} of {size} could not join {name}: "
                          f"{_first_line(exc)}") from None  # fmt: skip
    return TorchComm(group, rank, size)


def _store(rendezvous: str, rank: int, size: int, timeout_s: float):
    """The group's store: a ``FileStore`` at a path, or the ``TCPStore`` rank 0 serves at
    ``tcp://HOST:PORT`` (each process's joins share its one server)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rendezvous.startswith("tcp://"):
        host, _, port = rendezvous[len("tcp://") :].rpartition(":")
        try:
            return dist.TCPStore(host.strip("[]"), int(port), size, rank == 0, timeout,
                                 wait_for_workers=False, multi_tenant=True)  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            raise GroupFailed(f"rank {rank} of {size} could not reach {rendezvous}: "
                              f"{_first_line(exc)}") from None  # fmt: skip
    store = dist.FileStore(rendezvous, size)
    store.set_timeout(timeout)
    return store
