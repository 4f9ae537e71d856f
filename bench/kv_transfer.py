"""KV transfer throughput of each transport backend vs a plain memcpy, in one run.

    .venv/bin/python bench/kv_transfer.py [--backends shm tcp] [--sizes-mb 1 4 16 64]
        [--repeats 5] [--out bench/results/kv_transfer_cpu.json]

The KV layout is the default model's (SmolLM2-135M: 30 layers, 3 KV heads x 64, fp32,
block 16: 720 KiB per block). For each size, as many blocks as make up that many bytes
move from a source cache in this process into a receiver's cache in a child process, at
scattered block ids, layer by layer, as a prefill worker would send them. The baseline
is ``torch`` copying the same number of bytes between two contiguous buffers in one
process (memcpy). Figures are medians of ``--repeats`` runs after a warm-up.
With ``--backends nccl`` (GPU) the baseline adds torch.distributed's own send/recv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from bench.common import machine_info
from engine.kv_cache.layout import KVCache, KVCacheLayout
from kvstore.transport import KVEndpoint, get_transport

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVCacheLayout.for_attention(30, 3, 64, 16, torch.float32)
NUM_BLOCKS = 128  # 90 MiB per cache

_RECEIVER = """
import sys, msgspec, torch
from bench.kv_transfer import LAYOUT, NUM_BLOCKS
from kvstore.transport import get_transport
t = get_transport(sys.argv[1])
rx = t.receiver(t.allocate_cache(LAYOUT, NUM_BLOCKS, "cpu"))
rx.expect("bench", list(range(1, NUM_BLOCKS)))
print(msgspec.json.encode(rx.endpoint).decode(), flush=True)
sys.stdin.read()
rx.close()
"""


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    a = torch.randn(nbytes // 4)
    b = torch.empty_like(a)
    return nbytes / _median(lambda: b.copy_(a), repeats) / 1e9


def backend_gbps(name: str, sizes: list[int], repeats: int) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)  # fmt: skip
    try:
        endpoint = msgspec.json.decode(child.stdout.readline(), type=KVEndpoint)
        src = KVCache(LAYOUT, NUM_BLOCKS, "cpu")
        src.storage.normal_()
        sender = get_transport(name).sender(src)
        rng = np.random.default_rng(0)
        out = {}
        for blocks in sizes:
            src_ids = rng.choice(np.arange(1, NUM_BLOCKS), blocks, replace=False).tolist()
            dst_ids = rng.choice(np.arange(1, NUM_BLOCKS), blocks, replace=False).tolist()
            seconds = _median(
                lambda s=src_ids, d=dst_ids: sender.send(endpoint, "bench", s, d), repeats
            )
            nbytes = blocks * LAYOUT.bytes_per_block
            out[blocks] = {"seconds": seconds, "gb_s": nbytes / seconds / 1e9}
        sender.close()
        return out
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["shm", "tcp"])
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/kv_transfer_cpu.json")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both ends)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    bpb = LAYOUT.bytes_per_block
    sizes = [max(1, round(mb * 2**20 / bpb)) for mb in args.sizes_mb]
    results = {b: backend_gbps(b, sizes, args.repeats) for b in args.backends}
    rows = []
    for mb, blocks in zip(args.sizes_mb, sizes):
        nbytes = blocks * bpb
        row = {"target_mb": mb, "blocks": blocks, "bytes": nbytes,
               "memcpy_gb_s": memcpy_gbps(nbytes, args.repeats)}  # fmt: skip
        for b in args.backends:
            row[f"{b}_gb_s"] = results[b][blocks]["gb_s"]
            row[f"{b}_ms"] = results[b][blocks]["seconds"] * 1e3
            row[f"{b}_vs_memcpy"] = row[f"{b}_gb_s"] / row["memcpy_gb_s"]
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)  # fmt: skip
    report = {**machine_info(), "layout": {"layers": LAYOUT.num_layers, "block_size": 16,
              "bytes_per_block": bpb, "dtype": "float32"}, "repeats": args.repeats,
              "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
