"""The NCCL transport between two GPUs (skipped without two): blocks sent from cuda:0 land
in a receiver process's cache on cuda:1 at the given block ids, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import xxhash

from kvstore.layout import KVCache, KVCacheLayout

SECRET = "kv-test-secret"  # the cluster secret both ends prove

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)

LAYOUT = KVCacheLayout.for_attention(4, 8, 128, 16, torch.bfloat16)

_RECEIVER = """
import json, sys, msgspec, torch, xxhash
from kvstore.layout import KVCacheLayout
from kvstore.transport import get_transport
SECRET = "kv-test-secret"
torch.cuda.set_device(1)
lay = KVCacheLayout.for_attention(4, 8, 128, 16, torch.bfloat16)
t = get_transport("nccl", secret=SECRET)
cache = t.allocate_cache(lay, 64, "cuda:1")
rx = t.receiver(cache)
rx.expect("t0", list(range(1, 64)))
print(msgspec.json.encode(rx.endpoint).decode(), flush=True)
for line in sys.stdin:
    ids = json.loads(line)
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


def test_nccl_round_trip_between_two_gpus():
    import msgspec

    from kvstore.transport import KVEndpoint, TransferError, get_transport

    path = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        endpoint = msgspec.json.decode(child.stdout.readline(), type=KVEndpoint)
        torch.cuda.set_device(0)
        src = KVCache(LAYOUT, 64, "cuda:0")
        src.storage.normal_()
        sender = get_transport("nccl", secret=SECRET).sender(src)
        src_ids, dst_ids = [3, 17, 40, 41, 63], [50, 2, 9, 10, 33]
        stats = sender.send(endpoint, "t0", src_ids, dst_ids)
        assert stats.num_bytes == 5 * LAYOUT.bytes_per_block
        child.stdin.write(json.dumps(dst_ids) + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == _digest(src, src_ids)
        with pytest.raises(TransferError, match="not expected"):
            sender.send(endpoint, "unknown", [1], [1])
        sender.send(endpoint, "t0", [5], [7])  # the pair survives a refusal
        sender.close()
    finally:
        child.stdin.close()
        child.kill()
