"""``ferry serve --decode-ep 2``: decode workers that are groups of two rank processes
(gloo), serving a tiny random DeepSeek-V3 checkpoint written by transformers, with every
prompt's KV moved by a prefill worker into the chosen rank's cache.

- Two groups (four decode ranks, each a decode target of its own): 16 concurrent streamed
  chats all complete, token for token as the aggregated engine answers them; ``/health``
  and ``/metrics`` show the groups, each rank, per-rank and per-expert load.
- ``kill -9`` of one rank in the middle of 16 streams: its whole group goes down (the
  other rank is killed, no process is left behind), every stream goes on from another
  decode worker within 10 s and ends with the same tokens, the survivors (the other
  group, the prefill worker) keep their processes through it — they run with
  ``FERRY_DEBUG_INTEGRITY=1``, so a bookkeeping error would have killed them — and the
  dead group is started again.
- A prefill group and a decode group of two ranks each, the decode group with redundant
  expert slots and rebalancing every few steps, answer the same.
- A decode group of two ``ferry worker --ep 2`` processes, one rank each as if on two
  hosts (``--ep-node-rank``, meeting at ``--ep-leader``), joins a frontend and answers the
  same; ``kill -9`` of one rank ends both processes with an error, no rank left behind.

Tokens are compared through chat logprobs' ``bytes``: the checkpoint's 260 ids are the
byte tokenizer's 256 bytes and 4 special tokens, so the bytes name each token exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from conftest import assert_sound, run_worker
from helpers import free_port, metric

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 40
FAILOVER_S = 10.0
FLAGS = ("--threads", "1", "--block-size", "16", "--kv-tiers", "none",
         "--local-prefill-tokens", "0")  # fmt: skip
QUESTIONS = [f"Ferry {i}: which harbour comes after the {i}th lighthouse?" for i in range(STREAMS)]


async def _stream(client: httpx.AsyncClient, server, content: str) -> dict:
    """One greedy streamed chat: each token's bytes, when each chunk came, any error."""
    body = {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "stream": True}  # fmt: skip
    tokens, times, error = [], [], None
    async with client.stream("POST", f"{server.v1}/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            logprobs = (chunk["choices"][0].get("logprobs") or {}).get("content") or []
            if logprobs:
                tokens += [tuple(t["bytes"]) for t in logprobs]
                times.append(time.monotonic())
    return {"tokens": tokens, "times": times, "error": error}


async def _all(server, fault=None) -> list[dict]:
    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(headers=server.headers, timeout=300, limits=limits) as c:
        tasks = [asyncio.create_task(_stream(c, server, q)) for q in QUESTIONS]
        if fault is not None:
            await fault(tasks)
        return await asyncio.gather(*tasks)


def _health(server) -> dict:
    return server.health()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def folder(tiny_moe_dir):
    return tiny_moe_dir("deepseek-v3")


@pytest.fixture(scope="module")
def aggregated(folder, serve, tmp_path_factory) -> list[list[tuple]]:
    """The aggregated engine's greedy tokens for every question."""
    log = tmp_path_factory.mktemp("ep-aggregated") / "serve.log"
    with serve(log, *FLAGS, "--model", str(folder), "--aggregated") as s:
        answers = asyncio.run(_all(s))
    assert all(a["error"] is None and len(a["tokens"]) == MAX_TOKENS for a in answers)
    return [a["tokens"] for a in answers]


def test_two_groups_of_two_ranks_answer_16_streams_as_aggregated_and_survive_a_kill(
    folder, aggregated, serve, tmp_path
):
    flags = (*FLAGS, "--model", str(folder), "--decode", "2", "--decode-ep", "2")
    with serve(tmp_path / "serve.log", *flags) as s:
        health = _health(s)
        groups = {g["name"]: g for g in health["groups"]}
        assert set(groups) == {"d0", "d1"}
        assert all(g["size"] == 2 and g["healthy"] for g in groups.values())
        ranks = [w for w in health["workers"] if w["role"] == "decode"]
        assert sorted(w["name"] for w in ranks) == ["d0/r0", "d0/r1", "d1/r0", "d1/r1"]
        answers = asyncio.run(_all(s))
        for i, answer in enumerate(answers):
            assert answer["error"] is None, (i, answer["error"])
            assert answer["tokens"] == aggregated[i], i
        assert metric(s, "ferry_kv_transfer_blocks_total") > 0  # into the ranks' caches
        time.sleep(2.5)  # the ranks' expert counts go out once a second
        body = httpx.get(f"{s.base_url}/metrics", timeout=30).text
        assert 'ferry_ep_group_ranks{group="d0",role="decode"} 2.0' in body
        assert 'ferry_ep_group_healthy{group="d1"} 1.0' in body
        computed = [metric(s, "ferry_ep_rank_computed_pairs_total", group=w["group"],
                           worker=w["name"]) for w in ranks]  # fmt: skip
        assert all(c > 0 for c in computed), computed  # every rank computed experts
        routed = [line for line in body.splitlines()
                  if line.startswith("ferry_expert_routed_pairs_total{")]  # fmt: skip
        assert len(routed) == 2 * 2 * 16  # two groups x two MoE layers x 16 experts
        assert sum(float(line.rsplit(" ", 1)[1]) for line in routed) == sum(computed)
        assert_sound(s)

        # -- kill -9 one rank of d0 in the middle of 16 streams --------------------------
        victim = next(w for w in ranks if w["name"] == "d0/r1")
        sibling = next(w for w in ranks if w["name"] == "d0/r0")
        survivors = [w["pid"] for w in _health(s)["workers"] if w.get("group") != "d0"]
        killed_at, inflight = {}, []

        async def fault(tasks) -> None:
            while metric(s, "ferry_worker_requests_inflight", role="decode",
                         worker="d0/r1") < 2:  # fmt: skip
                await asyncio.sleep(0.05)
            # its streams are under way (a rank counts a request once it decodes); 0.2 s more
            # let them all end first on a loaded machine now and then: nothing to migrate
            await asyncio.sleep(0.05)
            inflight.extend(metric(s, "ferry_worker_requests_inflight", role="decode",
                                   worker=w["name"]) for w in ranks)  # fmt: skip
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at["t"] = time.monotonic()

        answers = asyncio.run(_all(s, fault))
        kill = killed_at["t"]
        assert sum(n > 0 for n in inflight) >= 3, inflight  # the router spread the streams
        for i, answer in enumerate(answers):
            assert answer["error"] is None, (i, answer["error"])
            assert answer["tokens"] == aggregated[i], i
            after = [t for t in answer["times"] if t > kill]
            if after:  # the stream went on after the kill: within the bound
                assert after[0] - kill <= FAILOVER_S, (i, after[0] - kill)
        assert metric(s, "ferry_router_migrations_total") > 0
        assert not _alive(sibling["pid"]) and not _alive(victim["pid"])
        assert all(_alive(pid) for pid in survivors)
        deadline = time.monotonic() + 180
        while not all(g["healthy"] for g in _health(s)["groups"]):
            assert time.monotonic() < deadline, _health(s)
            time.sleep(0.5)
        assert all(_alive(pid) for pid in survivors)  # idle since, integrity checked
        restarted = {w["name"]: w["pid"] for w in _health(s)["workers"] if w.get("group") == "d0"}
        assert set(restarted) == {"d0/r0", "d0/r1"}
        assert sibling["pid"] not in restarted.values()
        assert "of its group d0 is gone" in s.log_tail(200_000)


def test_prefill_and_decode_groups_rebalancing_live_answer_as_aggregated(folder, aggregated,
                                                                         serve, tmp_path):
    flags = (*FLAGS, "--model", str(folder), "--prefill-ep", "2", "--decode-ep", "2",
             "--ep-redundant-experts", "2", "--eplb-interval", "4", "--eplb-window", "8")
    with serve(tmp_path / "serve.log", *flags) as s:
        groups = {g["name"]: (g["role"], g["size"]) for g in _health(s)["groups"]}
        assert groups == {"p0": ("prefill", 2), "d0": ("decode", 2)}
        answers = asyncio.run(_all(s))
        for i, answer in enumerate(answers):
            assert answer["error"] is None, (i, answer["error"])
            assert answer["tokens"] == aggregated[i], i
        time.sleep(2.5)
        assert metric(s, "ferry_eplb_rebalances_total", group="d0") > 0
        assert 0 < metric(s, "ferry_eplb_imbalance", group="d0") < 2
        assert "experts rebalanced" in s.log_tail(200_000)
        assert_sound(s)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_group_of_ferry_workers_on_two_hosts_answers_as_aggregated_and_dies_whole(
    folder, aggregated, serve, tmp_path
):
    flags = (*FLAGS, "--model", str(folder), "--kv-transport", "tcp")
    with serve(tmp_path / "serve.log", *flags, "--decode", "0", healthy=False) as s:
        leader = f"127.0.0.1:{free_port()}"
        worker = (*flags, "--role", "decode", "--name", "dx", "--ep", "2", "--ep-local-ranks",
                  "1", "--ep-leader", leader, "--frontend", s.control_url)  # fmt: skip
        with (
            run_worker(tmp_path / "w0.log", *worker, "--ep-node-rank", "0") as w0,
            run_worker(tmp_path / "w1.log", *worker, "--ep-node-rank", "1") as w1,
        ):
            deadline = time.monotonic() + 180
            while httpx.get(f"{s.base_url}/ready", timeout=30).status_code != 200:
                assert time.monotonic() < deadline, _health(s)
                time.sleep(0.5)
            health = _health(s)
            assert [(g["name"], g["size"]) for g in health["groups"]] == [("dx", 2)]
            decode = {w["name"]: w for w in health["workers"] if w["role"] == "decode"}
            assert set(decode) == {"dx/r0", "dx/r1"}
            assert {decode[n]["rank"] for n in decode} == {0, 1}
            phases = {"process", "group", "weights", "compile", "warm_up", "graphs"}
            assert all(set(w["startup"]) == phases for w in decode.values()), decode
            [rank0], [rank1] = _children(w0.pid), _children(w1.pid)  # each host's own rank
            answers = asyncio.run(_all(s))
            for i, answer in enumerate(answers):
                assert answer["error"] is None, (i, answer["error"])
                assert answer["tokens"] == aggregated[i], i
            os.kill(rank1, signal.SIGKILL)
            assert w1.wait(FAILOVER_S) == 1  # its host's group process says so
            assert w0.wait(FAILOVER_S) == 1  # the other host's rank saw its peer go
            assert not _alive(rank0)
            deadline = time.monotonic() + FAILOVER_S
            while httpx.get(f"{s.base_url}/ready", timeout=30).status_code != 503:
                assert time.monotonic() < deadline, _health(s)
                time.sleep(0.2)
