"""Image embeddings from an encode worker's cache into a prefill worker's inbox through
each KV transport: the encode side's ``EmbeddingCache`` and sender, the prefill side's
``EmbeddingInbox`` and ``EmbeddingWaits``, the transport's real sockets or segments
between them (no worker processes). shm and tcp run in one process; every transport
also runs with the prefill side in a process of its own (cuda_ipc and nccl open their
peer's memory or communicator only from another process: skipped without CUDA, nccl
without two GPUs)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import xxhash

from encode.cache import EmbeddingCache, FileTierConfig
from engine.media import EmbeddingInbox, blocks_for, embedding_layout
from engine.messages import EngineRequest, MediaItem
from engine.sampling_params import SamplingParams
from kvstore.layout import KVCache
from kvstore.transport import get_transport
from kvstore.transport.base import KVDestination, KVEndpoint
from prefill.embeddings import EmbeddingWaits
from prefill.messages import PrefillRequest

SECRET = "embed-test-secret"
HIDDEN, BLOCK = 24, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")  # fmt: skip
TRANSPORTS = ["shm", "tcp"]  # in one process
# (transport, the encode side's device, the prefill side's device): across processes
ACROSS = [
    ("shm", "cpu", "cpu"),
    ("tcp", "cpu", "cpu"),
    pytest.param("cuda_ipc", "cuda:0", "cuda:0", marks=CUDA),
    pytest.param("nccl", "cuda:0", "cuda:1", marks=TWO_GPUS),
]
LENGTHS = [10, 4, 17]  # tokens per image: a partial last block, one whole block, several


def _rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _request(rid: str, lengths: list[int], deadline: float = 1e12) -> PrefillRequest:
    media, offset = [], 3
    for i, n in enumerate(lengths):
        media.append(MediaItem(f"image-{rid}-{i}".encode(), offset, n, (1, 2, n * 2)))
        offset += n + 2
    req = EngineRequest(rid, list(range(offset + 3)), SamplingParams(max_tokens=1), media=media)
    return PrefillRequest(req, KVDestination(KVEndpoint("shm", "", "", 0), [], 0, deadline))


def _source_cache(transport, name: str, layout, device: str) -> KVCache:
    """The encode side's cache: the transport's own where it shares device memory (as
    the encode worker's is); for shm and tcp any cache sends (an shm segment would stay
    open in this process until the transport goes)."""
    if name in ("shm", "tcp"):
        return KVCache(layout, 32, device)
    return transport.allocate_cache(layout, 32, device)


class _Pair:
    """An encode worker's cache and sender, a prefill worker's inbox and waits."""

    def __init__(self, name: str) -> None:
        layout = embedding_layout(HIDDEN, torch.float32, block_size=BLOCK)
        encode_side = get_transport(name, secret=SECRET)
        kv = _source_cache(encode_side, name, layout, "cpu")
        self.cache = EmbeddingCache(kv, "tower", FileTierConfig(""))
        self.sender = encode_side.sender(kv)
        prefill_side = get_transport(name, secret=SECRET)
        self.inbox = EmbeddingInbox(prefill_side, layout, 24, "cpu", "127.0.0.1")
        self.waits = EmbeddingWaits(self.inbox, 30.0, "p0")

    def encode_and_send(self, wanted, req: PrefillRequest, rows: list[torch.Tensor]) -> None:
        """What the encode worker does for each image: store, send, release; then the
        frontend's EmbeddingsReady."""
        for i, (dest, tid, item) in enumerate(zip(wanted.destinations, wanted.transfer_ids,
                                                  req.request.media)):  # fmt: skip
            blocks = self.cache.store(item.content_hash, rows[i])
            stats = self.sender.send(dest.endpoint, tid, [b.block_id for b in blocks],
                                     dest.block_ids, 10.0)  # fmt: skip
            assert stats.num_blocks == blocks_for(item.length, BLOCK)
            self.cache.release(blocks)
            self.waits.ready(req.request_id, i)

    def close(self) -> None:
        self.sender.close()
        self.waits.close()
        self.cache.close()
        # drop the caches now: a shm cache's segment lives as long as its tensor
        self.cache = self.sender = self.waits = self.inbox = None


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    p = _Pair(request.param)
    yield p
    p.close()
    gc.collect()


def test_embeddings_land_in_the_reserved_inbox_blocks_exactly(pair):
    req = _request("r1", LENGTHS)
    pair.waits.add(req)
    (wanted,) = pair.waits.reserve()
    assert wanted.request_id == "r1" and len(wanted.destinations) == len(LENGTHS)
    rows = [_rows(i, n) for i, n in enumerate(LENGTHS)]
    pair.encode_and_send(wanted, req, rows)
    ready, failures = pair.waits.take()
    assert failures == []
    ((got_req, got_rows),) = ready
    assert got_req.request_id == "r1"
    assert all(torch.equal(a, b) for a, b in zip(got_rows, rows))
    pair.waits.check_integrity()
    assert pair.inbox.pool.num_free == pair.inbox.pool.num_usable  # every block given back


def test_two_requests_in_flight_each_get_their_own_rows(pair):
    reqs = [_request("a", [9, 5]), _request("b", [13])]
    for r in reqs:
        pair.waits.add(r)
    wanted = pair.waits.reserve()
    assert [w.request_id for w in wanted] == ["a", "b"]
    rows = {"a": [_rows(10, 9), _rows(11, 5)], "b": [_rows(12, 13)]}
    for w, r in reversed(list(zip(wanted, reqs))):  # answered in the other order
        pair.encode_and_send(w, r, rows[r.request_id])
    ready, failures = pair.waits.take()
    assert failures == []
    assert {r.request_id for r, _ in ready} == {"a", "b"}
    for r, got in ready:
        assert all(torch.equal(x, y) for x, y in zip(got, rows[r.request_id]))
    pair.waits.check_integrity()


def test_an_image_said_ready_but_never_written_fails_its_request(pair):
    if pair.inbox.receiver.endpoint.backend == "shm":
        pytest.skip("shm cannot observe direct writes: its receiver says every one landed")
    req = _request("r2", [6, 6])
    pair.waits.add(req)
    (wanted,) = pair.waits.reserve()
    blocks = pair.cache.store(b"only-the-first", _rows(3, 6))
    dest = wanted.destinations[0]
    pair.sender.send(dest.endpoint, wanted.transfer_ids[0], [b.block_id for b in blocks],
                     dest.block_ids, 10.0)  # fmt: skip
    pair.cache.release(blocks)
    pair.waits.ready("r2", 0)
    pair.waits.ready("r2", 1)  # the frontend says so; the receiver saw nothing written
    ready, failures = pair.waits.take()
    assert ready == [] and len(failures) == 1 and "not landed" in failures[0].error
    pair.waits.check_integrity()
    assert pair.inbox.pool.num_free == pair.inbox.pool.num_usable


# The prefill side in a process of its own: prints the EmbeddingsWanted of one request,
# waits for "sent", then prints a digest of the rows it took (or its failure).
_PREFILL = """
import json, sys, msgspec, torch, xxhash
sys.path.insert(0, sys.argv[4])
from test_embedding_transport import BLOCK, HIDDEN, SECRET, _request
from engine.media import EmbeddingInbox, embedding_layout
from kvstore.layout import KVCache
from kvstore.transport import get_transport
from prefill.embeddings import EmbeddingWaits
name, device, lengths = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if device.startswith("cuda"):
    torch.cuda.set_device(device)
layout = embedding_layout(HIDDEN, torch.float32, block_size=BLOCK)
inbox = EmbeddingInbox(get_transport(name, secret=SECRET), layout, 24, device, "127.0.0.1")
waits = EmbeddingWaits(inbox, 30.0, "p1")
req = _request("x", lengths)
waits.add(req)
(wanted,) = waits.reserve()
print(msgspec.json.encode(wanted).decode(), flush=True)
assert sys.stdin.readline().strip() == "sent"
for i in range(len(lengths)):
    waits.ready("x", i)
ready, failures = waits.take()
if failures:
    print("failed: " + failures[0].error, flush=True)
else:
    h = xxhash.xxh3_64()
    for rows in ready[0][1]:
        h.update(rows.cpu().numpy().tobytes())
    print(h.hexdigest(), flush=True)
waits.check_integrity()
sys.stdin.readline()
waits.close()
"""


@pytest.mark.parametrize("name, encode_device, prefill_device", ACROSS)
def test_embeddings_reach_a_prefill_worker_in_another_process(name, encode_device,
                                                              prefill_device):  # fmt: skip
    from prefill.messages import EmbeddingsWanted

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, "-c", _PREFILL, name, prefill_device, json.dumps(LENGTHS), str(here)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    sender = cache = None
    try:
        wanted = msgspec.json.decode(child.stdout.readline(), type=EmbeddingsWanted)
        if encode_device.startswith("cuda"):
            torch.cuda.set_device(encode_device)
        layout = embedding_layout(HIDDEN, torch.float32, block_size=BLOCK)
        transport = get_transport(name, secret=SECRET)
        kv = _source_cache(transport, name, layout, encode_device)
        cache = EmbeddingCache(kv, "tower", FileTierConfig(""))
        sender = transport.sender(kv)
        rows = [_rows(i, n) for i, n in enumerate(LENGTHS)]
        digest = xxhash.xxh3_64()
        for i, (dest, tid) in enumerate(zip(wanted.destinations, wanted.transfer_ids)):
            blocks = cache.store(f"image-{i}".encode(), rows[i].to(encode_device))
            sender.send(dest.endpoint, tid, [b.block_id for b in blocks], dest.block_ids, 30.0)
            cache.release(blocks)
            digest.update(rows[i].numpy().tobytes())
        child.stdin.write("sent\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == digest.hexdigest()
    finally:
        if sender is not None:
            sender.close()
        if cache is not None:
            cache.close()
        with_timeout = child.communicate("\n", timeout=30)
        assert child.returncode == 0, with_timeout
