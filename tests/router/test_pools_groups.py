"""How the pools spawn an expert-parallel group: one process per rank, each a worker of
its own named ``<worker>/r<rank>``, all meeting through one rendezvous file in the
frontend's private directory; on CUDA one GPU per rank."""

from __future__ import annotations

import os
import stat

import pytest

from engine.config import EngineConfig
from router.config import PDConfig
from router.metrics import TransferMetrics
from router.pools import WorkerPools
from router.routing import Router


@pytest.fixture
def pools():
    pd = PDConfig(num_prefill=1, num_decode=2, decode_ep=4)
    pools = WorkerPools(EngineConfig(model="dummy:qwen3-moe-tiny"), pd, "secret",
                        Router("round_robin"), TransferMetrics(), None)
    yield pools
    pools._ctx.destroy(linger=0)
    os.rmdir(pools._tmp)


def test_a_group_is_one_process_per_rank_meeting_in_a_private_directory(pools):
    specs = pools._specs("decode", "d1", ["cpu"] * 4)
    assert [name for name, _ in specs] == ["d1/r0", "d1/r1", "d1/r2", "d1/r3"]
    members = [config.group for _, config in specs]
    assert [m.rank for m in members] == [0, 1, 2, 3]
    assert {(m.name, m.size) for m in members} == {("d1", 4)}
    assert len({m.rendezvous for m in members}) == 1
    assert os.path.dirname(members[0].rendezvous) == pools._tmp
    assert stat.S_IMODE(os.stat(pools._tmp).st_mode) == 0o700  # only its owner can join
    assert all(config.name == name for name, config in specs)
    again = pools._specs("decode", "d1", ["cpu"] * 4)  # a restart meets somewhere new
    assert again[0][1].group.rendezvous != members[0].rendezvous


def test_a_worker_of_one_rank_is_no_group(pools):
    [(name, config)] = pools._specs("prefill", "p0", ["cpu"])
    assert name == "p0" and config.group is None


def test_a_gpu_group_needs_a_gpu_per_rank(pools):
    specs = pools._specs("decode", "d0", ["cuda:0", "cuda:1"])
    assert [c.engine.device for _, c in specs] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="one per rank"):
        pools._specs("decode", "d0", ["cuda:0", "cuda:1", "cuda:0"])
