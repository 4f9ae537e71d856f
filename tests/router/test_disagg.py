"""The disaggregated topology through ``DisaggClient``: prefill and decode worker
processes, KV over a transport, failures and cancellations.

Workers run with ``FERRY_DEBUG_INTEGRITY=1``: each checks its block bookkeeping whenever
it goes idle and dies on a mismatch, so a worker still alive at the end passed them all.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import pytest_asyncio

from engine.client import EngineClient, EngineDeadError
from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams
from engine.worker.config import TransferConfig
from router.config import PDConfig
from router.disagg import DisaggClient

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _integrity_checks():
    old = os.environ.get("FERRY_DEBUG_INTEGRITY")
    os.environ["FERRY_DEBUG_INTEGRITY"] = "1"
    yield
    if old is None:
        os.environ.pop("FERRY_DEBUG_INTEGRITY", None)
    else:
        os.environ["FERRY_DEBUG_INTEGRITY"] = old


async def collect(client, rid: str, prompt: list[int], sampling=GREEDY) -> list[int]:
    tokens = []
    async for out in client.generate(rid, prompt, sampling):
        assert out.finish_reason != "error", out.error
        tokens += out.new_token_ids
    return tokens


async def wait_idle(client: DisaggClient, timeout: float = 30.0) -> None:
    """Until every worker reports no running, waiting or transferring requests and no
    referenced blocks; then assert they are all alive (their integrity checks passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(
            w.stats is not None and w.stats.kv_blocks_used == 0 and w.num_transferring == 0
            and w.stats.num_running == 0 and w.stats.num_waiting == 0
            for w in client.workers if w.alive
        ):  # fmt: skip
            break
        await asyncio.sleep(0.1)
    for w in client.workers:
        if w.alive:
            assert w.stats.kv_blocks_used == 0, (w.name, w.stats)
            assert w.num_transferring == 0, w.name


def restarts(client: DisaggClient) -> float:
    """Workers the pools restarted (with integrity checks on, a worker dies on a mismatch
    and would come back unnoticed but for this count)."""
    return sum(s.value for m in client.pools.restarts.collect() for s in m.samples
               if s.name.endswith("_total"))  # fmt: skip


def tiny(**cache) -> EngineConfig:
    return EngineConfig(model="dummy:tiny", num_threads=1,
                        cache=CacheConfig(num_blocks=1024, block_size=4, **cache))  # fmt: skip


# ---- equivalence with the aggregated engine ------------------------------------------------


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(4)
    lengths = [round(10 * 100 ** (i / 11)) for i in range(12)]  # 10 .. 1000, geometric
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]
    for base in (3, 6, 8, 10):  # four more that extend earlier ones: prefix-cache hits
        prompts.append(prompts[base] + [rng.randrange(100, vocab - 100) for _ in range(37)])
    return prompts


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def reference():
    config = EngineConfig(model="default", num_threads=1, cpu_weights="fp32")
    client = EngineClient(config)
    await client.start()
    prompts = _prompts(49152)
    try:
        outputs = [await collect(client, f"r{i}", p) for i, p in enumerate(prompts)]
    finally:
        await client.shutdown()
    return prompts, outputs


@pytest.mark.parametrize(("transport", "local"), [("shm", 0), ("tcp", 16)])
async def test_greedy_outputs_match_the_aggregated_engine(reference, transport, local):
    prompts, expected = reference
    config = EngineConfig(model="default", num_threads=1, cpu_weights="fp32")
    transfer = TransferConfig(transport, local_prefill_tokens=local)
    client = DisaggClient(config, PDConfig(transfer=transfer))
    await client.start()
    try:
        got = [await collect(client, f"d{i}", p) for i, p in enumerate(prompts)]
        assert got == expected
        transferred = client.transfers.blocks._value.get()
        assert transferred > 0
        await wait_idle(client)
        assert all(w.alive for w in client.workers) and restarts(client) == 0
    finally:
        await client.shutdown()


# ---- failures -------------------------------------------------------------------------------


NO_HEALING = {"restart_workers": False}  # what a dead worker leaves behind, alone


async def test_killing_the_decode_worker_mid_stream_fails_the_stream_quickly():
    client = DisaggClient(tiny(), PDConfig(transfer=TransferConfig(local_prefill_tokens=0),
                                           **NO_HEALING))  # fmt: skip
    await client.start()
    try:
        long = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)
        stream = client.generate("x", list(range(1, 40)), long)
        seen = 0
        started = None
        with pytest.raises(EngineDeadError, match="decode"):
            async for out in stream:
                seen += len(out.new_token_ids)
                if seen >= 3 and started is None:
                    os.kill(client.pools.decode[0].proc.pid, signal.SIGKILL)
                    started = time.monotonic()
        assert time.monotonic() - started < 5
        assert not client.is_healthy
        assert client.health()["workers"][1]["healthy"] is False
        with pytest.raises(EngineDeadError):
            await collect(client, "y", [1, 2, 3])
        await wait_idle(client)  # the prefill worker survives with nothing held
        assert client.pools.prefill[0].alive
    finally:
        await client.shutdown()


async def test_killing_the_prefill_worker_before_the_transfer_fails_cleanly():
    # a prompt long enough that the prefill is still running when the worker dies
    config = tiny().replace(scheduler=tiny().scheduler.__class__(max_num_batched_tokens=8))
    client = DisaggClient(config, PDConfig(transfer=TransferConfig(local_prefill_tokens=0),
                                           **NO_HEALING))  # fmt: skip
    await client.start()
    try:
        stream = client.generate("x", [1 + i % 250 for i in range(900)], GREEDY)
        task = asyncio.ensure_future(stream.__anext__())
        deadline = time.monotonic() + 10
        while "x" not in client._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert "x" in client._pending  # the prefill worker has it; no KV has moved
        os.kill(client.pools.prefill[0].proc.pid, signal.SIGKILL)
        started = time.monotonic()
        out = await asyncio.wait_for(task, 10)
        assert out.finish_reason == "error" and "prefill" in out.error
        assert time.monotonic() - started < 5
        await stream.aclose()
        await wait_idle(client)  # the decode worker freed the reserved blocks
        assert client.pools.decode[0].alive and not client.is_healthy
    finally:
        await client.shutdown()


async def test_1000_requests_with_random_disconnects_at_concurrency_32_leak_no_blocks():
    """Clients leave before any output, after some, just before the end, or stay; every
    worker checks its allocators whenever it goes idle (and dies on a mismatch: no worker
    may have been restarted), and KV use is back to idle within 5 s."""
    client = DisaggClient(tiny(), PDConfig(transfer=TransferConfig(local_prefill_tokens=8)))
    await client.start()
    rng = random.Random(7)
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(2, 120))]
        max_tokens = rng.randrange(1, 24)
        sampling = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                  ignore_eos=True)  # fmt: skip
        leave_after = rng.choice([0, 0, 1, 2, 5, max(0, max_tokens - 2), None])
        async with gate:
            if leave_after == 0 and rng.random() < 0.5:  # cancelled before any output
                task = asyncio.ensure_future(collect(client, f"c{i}", prompt, sampling))
                await asyncio.sleep(rng.random() * 0.05)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
            seen = 0
            async for out in client.generate(f"c{i}", prompt, sampling):
                assert out.finish_reason != "error", out.error
                seen += 1
                if leave_after is not None and seen > leave_after:
                    break

    try:
        await asyncio.gather(*(one(i) for i in range(1000)))
        await wait_idle(client, timeout=5)
        assert all(w.alive for w in client.workers)
        assert restarts(client) == 0
    finally:
        await client.shutdown()


async def test_a_reader_that_stops_reading_is_dropped_after_a_bounded_buffer():
    """A client that stops reading its stream holds at most OUTPUT_BUFFER outputs: its
    request is aborted on the workers, and its reader finds out once it reads again."""
    from engine.client import OUTPUT_BUFFER, ReaderTooSlow

    client = DisaggClient(tiny(), PDConfig(transfer=TransferConfig(local_prefill_tokens=0)))
    await client.start()
    try:
        long = SamplingParams(temperature=0, max_tokens=OUTPUT_BUFFER + 500, ignore_eos=True)
        stream = client.generate("slow", list(range(1, 40)), long)
        first = await anext(stream)
        assert first.new_token_ids  # then this reader stops reading
        decode = client.pools.decode[0]
        deadline = time.monotonic() + 120
        while decode.inflight or decode.stats.num_running:
            assert time.monotonic() < deadline, "the unread request kept running"
            await asyncio.sleep(0.2)
        with pytest.raises(ReaderTooSlow):
            async for _ in stream:
                pass
        await wait_idle(client)
        # others were served meanwhile and after
        assert len(await collect(client, "fast", list(range(1, 30)))) == GREEDY.max_tokens
    finally:
        await client.shutdown()
