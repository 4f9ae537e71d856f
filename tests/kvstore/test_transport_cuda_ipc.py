"""The CUDA IPC transport: blocks written device to device into a receiver process's GPU
cache land at the given block ids, byte for byte; the protocol checks shm and tcp make
(layout, block ids, peer death) hold. The CUDA tests are skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import torch
import xxhash

from kvstore.layout import KVCache, KVCacheLayout
from kvstore.transport import TRANSPORTS, KVEndpoint, TransferError, get_transport

SECRET = "kv-test-secret"
LAYOUTS = {
    "gqa": KVCacheLayout.for_attention(4, 8, 128, 16, torch.bfloat16),
    "mla": KVCacheLayout.for_mla(3, 512, 64, 128, torch.bfloat16),
}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_RECEIVER = """
import json, sys, msgspec, torch, xxhash
from kvstore.layout import KVCacheLayout
from kvstore.transport import get_transport
lay = {"gqa": KVCacheLayout.for_attention(4, 8, 128, 16, torch.bfloat16),
       "mla": KVCacheLayout.for_mla(3, 512, 64, 128, torch.bfloat16)}[sys.argv[1]]
t = get_transport("cuda_ipc", secret="kv-test-secret")
cache = t.allocate_cache(lay, 48, "cuda")
rx = t.receiver(cache)
print(msgspec.json.encode(rx.endpoint).decode(), flush=True)
for line in sys.stdin:
    ids = json.loads(line)
    torch.cuda.synchronize()
    h = xxhash.xxh3_64()
    for layer in cache.layers:
        h.update(layer[ids].cpu().view(torch.uint8).numpy().tobytes())
    print(h.hexdigest(), flush=True)
"""


def _digest(cache: KVCache, ids: list[int]) -> str:
    h = xxhash.xxh3_64()
    for layer in cache.layers:
        h.update(layer[ids].cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _child(kind: str) -> tuple[subprocess.Popen, KVEndpoint]:
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, kind], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    return child, msgspec.json.decode(child.stdout.readline(), type=KVEndpoint)


def _source(layout: KVCacheLayout) -> KVCache:
    src = KVCache(layout, 32, "cuda")
    src.storage.normal_()
    return src


def test_cuda_ipc_is_registered_and_refuses_a_cpu_cache():
    assert "cuda_ipc" in TRANSPORTS
    with pytest.raises(ValueError, match="CUDA cache"):
        get_transport("cuda_ipc", secret=SECRET).allocate_cache(LAYOUTS["gqa"], 8, "cpu")


@CUDA
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_cuda_ipc_round_trip_into_another_processes_cache(kind):
    child, endpoint = _child(kind)
    src = _source(LAYOUTS[kind])
    sender = get_transport("cuda_ipc", secret=SECRET).sender(src)
    rng = np.random.default_rng(2)
    try:
        for t in range(4):
            n = int(rng.integers(1, 20))
            src_ids = rng.choice(np.arange(1, 32), n, replace=False).tolist()
            dst_ids = rng.choice(np.arange(1, 48), n, replace=False).tolist()
            stats = sender.send(endpoint, f"t{t}", src_ids, dst_ids)
            assert stats.num_bytes == n * LAYOUTS[kind].bytes_per_block
            child.stdin.write(json.dumps(dst_ids) + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == _digest(src, src_ids)
        sender.close()
    finally:
        child.stdin.close()
        child.kill()


@CUDA
def test_cuda_ipc_round_trip_within_one_process():
    layout = LAYOUTS["mla"]
    transport = get_transport("cuda_ipc", secret=SECRET)
    dst = transport.allocate_cache(layout, 48, "cuda")
    receiver = transport.receiver(dst)
    src = _source(layout)
    sender = transport.sender(src)
    sender.send(receiver.endpoint, "t", [3, 9, 4], [40, 1, 7])
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(b[[40, 1, 7]], a[[3, 9, 4]])
    assert receiver.landed("t")
    sender.close()
    receiver.close()


@CUDA
def test_cuda_ipc_layout_mismatch_and_bad_block_ids_are_refused():
    transport = get_transport("cuda_ipc", secret=SECRET)
    receiver = transport.receiver(transport.allocate_cache(LAYOUTS["gqa"], 16, "cuda"))
    try:
        with pytest.raises(TransferError, match="layout"):
            transport.sender(_source(LAYOUTS["mla"])).send(receiver.endpoint, "x", [1], [1])
        sender = transport.sender(_source(LAYOUTS["gqa"]))
        with pytest.raises(TransferError, match="out of range"):
            sender.send(receiver.endpoint, "x", [1], [16])
        tcp = KVEndpoint("tcp", "127.0.0.1:1", receiver.endpoint.layout, 16, os.getpid())
        with pytest.raises(TransferError, match="tcp endpoint"):
            sender.send(tcp, "x", [1], [1])
        sender.close()
    finally:
        receiver.close()


@CUDA
def test_cuda_ipc_peer_death_is_detected():
    child, endpoint = _child("gqa")
    sender = get_transport("cuda_ipc", secret=SECRET).sender(_source(LAYOUTS["gqa"]))
    try:
        sender.send(endpoint, "t", [1, 2], [1, 2])  # the peer is alive: fine
        child.kill()
        child.wait()
        started = time.monotonic()
        with pytest.raises(TransferError, match="gone"):
            sender.send(endpoint, "t", [1, 2], [1, 2], timeout=5)
        assert time.monotonic() - started < 5
        sender.close()
    finally:
        child.kill()
