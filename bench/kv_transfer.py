"""KV transfer throughput of each transport backend vs a plain memcpy, in one run.

    .venv/bin/python bench/kv_transfer.py [--backends shm tcp] [--sizes-mb 1 4 16 64]
        [--repeats 5] [--out bench/results/kv_transfer_cpu.json]

The KV layout is the default model's (SmolLM2-135M: 30 layers, 3 KV heads x 64, fp32,
block 16: 720 KiB per block). For each size, as many blocks as make up that many bytes
move from a source cache in this process into a receiver's cache in a child process, at
scattered block ids, layer by layer, as a prefill worker would send them. The baseline
is ``torch`` copying the same number of bytes between two contiguous buffers in one
process (memcpy). Figures are medians of ``--repeats`` runs after a warm-up.
With ``--device cuda:0 --backends nccl`` (two GPUs: sender on cuda:0, receiver on
cuda:1) the memcpy is a device copy and the run adds torch.distributed's own NCCL
send/recv of the same bytes between the two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch

from bench.common import machine_info, median_time
from kvstore.layout import KVCache, KVCacheLayout
from kvstore.transport import KVEndpoint, get_transport

SECRET = "kv-test-secret"  # the cluster secret both ends prove

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVCacheLayout.for_attention(30, 3, 64, 16, torch.float32)
NUM_BLOCKS = 128  # 90 MiB per cache

_RECEIVER = """
import sys, msgspec, torch
from bench.kv_transfer import LAYOUT, NUM_BLOCKS
from kvstore.transport import get_transport
SECRET = "kv-test-secret"
device = sys.argv[2]
if device.startswith("cuda"):
    torch.cuda.set_device(device)
t = get_transport(sys.argv[1], secret=SECRET)
rx = t.receiver(t.allocate_cache(LAYOUT, NUM_BLOCKS, device))
rx.expect("bench", list(range(1, NUM_BLOCKS)))
print(msgspec.json.encode(rx.endpoint).decode(), flush=True)
sys.stdin.read()
rx.close()
"""


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])


def memcpy_gbps(nbytes: int, repeats: int, device: str = "cpu") -> float:
    a = torch.randn(nbytes // 4, device=device)
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)
        if a.is_cuda:
            torch.cuda.synchronize()

    return nbytes / median_time(copy, repeats) / 1e9


_DIST_PEER = """
import os, sys, torch, torch.distributed as dist
rank, repeats = int(sys.argv[1]), int(sys.argv[3])
sizes = [int(x) for x in sys.argv[2].split(",")]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=2)
for n in sizes:
    buf = torch.empty(n // 4, device="cuda")
    for i in range(repeats + 1):
        dist.barrier(); torch.cuda.synchronize()
        if rank == 0:
            import time; t0 = time.perf_counter()
            dist.send(buf, 1); torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if i: print(n, dt, flush=True)
        else:
            dist.recv(buf, 0); torch.cuda.synchronize()
dist.destroy_process_group()
"""


def dist_send_recv_gbps(sizes_bytes: list[int], repeats: int) -> dict[int, float]:
    """torch.distributed's own NCCL send/recv between two GPUs (rank 0 → rank 1)."""
    import statistics as st

    env = {**os.environ, "PYTHONPATH": _pythonpath(), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29531"}  # fmt: skip
    arg = ",".join(str(n) for n in sizes_bytes)
    procs = [
        subprocess.Popen([sys.executable, "-c", _DIST_PEER, str(r), arg, str(repeats)],
                         stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]  # fmt: skip
    out, _ = procs[0].communicate(timeout=300)
    procs[1].wait(timeout=60)
    times: dict[int, list[float]] = {}
    for line in out.splitlines():
        n, dt = line.split()
        times.setdefault(int(n), []).append(float(dt))
    return {n: n / st.median(t) / 1e9 for n, t in times.items()}


def backend_gbps(name: str, sizes: list[int], repeats: int, device: str = "cpu") -> dict:
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    peer = "cuda:1" if device.startswith("cuda") else "cpu"
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, name, peer], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)  # fmt: skip
    try:
        endpoint = msgspec.json.decode(child.stdout.readline(), type=KVEndpoint)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        src = KVCache(LAYOUT, NUM_BLOCKS, device)
        src.storage.normal_()
        sender = get_transport(name, secret=SECRET).sender(src)
        rng = np.random.default_rng(0)
        out = {}
        for blocks in sizes:
            src_ids = rng.choice(np.arange(1, NUM_BLOCKS), blocks, replace=False).tolist()
            dst_ids = rng.choice(np.arange(1, NUM_BLOCKS), blocks, replace=False).tolist()
            seconds = median_time(
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
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:0 (receiver on cuda:1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    bpb = LAYOUT.bytes_per_block
    sizes = [max(1, round(mb * 2**20 / bpb)) for mb in args.sizes_mb]
    results = {b: backend_gbps(b, sizes, args.repeats, args.device) for b in args.backends}
    baseline = {}
    if args.device.startswith("cuda"):
        baseline = dist_send_recv_gbps([n * bpb for n in sizes], args.repeats)
    rows = []
    for mb, blocks in zip(args.sizes_mb, sizes):
        nbytes = blocks * bpb
        row = {"target_mb": mb, "blocks": blocks, "bytes": nbytes,
               "memcpy_gb_s": memcpy_gbps(nbytes, args.repeats, args.device)}  # fmt: skip
        if baseline:
            row["torch_dist_send_recv_gb_s"] = baseline[nbytes]
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
