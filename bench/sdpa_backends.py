"""SDPA's fused backends on the MLA prefill's operands: first call of a shape, and after.

    python -m bench.sdpa_backends --out $OUT/sdpa_backends_h200.json

The MLA prefill (``engine.attention.torch_mla``) hands SDPA one sequence at a time: ``[1,
H, q_len, 192]`` queries and keys, values padded to 192, a lower-right causal mask (a
chunk after a cached prefix sees all of it). Every prompt has a length of its own, so
what a backend pays for the first call of a shape (cuDNN builds an execution graph per
shape) is paid by nearly every request. Per backend and (q_len, kv_len): the first
call's ms, the median of the next ``--repeats``, and the largest difference from the
float32 math backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench.common import machine_info

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=192)
    ap.add_argument("--shapes", default="1024x1024,1031x1031,2048x2048,4096x4096,4099x4099,"
                    "1024x3072,1000x3100")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sdpa_backends_h200.json"))
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for q_len, kv_len in shapes:
        gen = torch.Generator(device="cuda").manual_seed(q_len * 7 + kv_len)
        q, k, v = (
            torch.randn(1, args.heads, n, args.head_dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
            for n in (q_len, kv_len, kv_len)
        )  # fmt: skip
        mask = causal_lower_right(q_len, kv_len)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        for name, backend in BACKENDS.items():

            def call(backend=backend, operands=(q, k, v), mask=mask):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(*operands, attn_mask=mask)

            try:
                first = timed(call)
            except RuntimeError as e:
                rows.append({"backend": name, "q_len": q_len, "kv_len": kv_len,
                             "error": str(e).splitlines()[0][:200]})  # fmt: skip
                continue
            steady = statistics.median(timed(call) for _ in range(args.repeats))
            err = (call().float() - ref).abs().max().item()
            flops = 4 * args.heads * args.head_dim * (q_len * kv_len - q_len * (q_len - 1) / 2)
            rows.append({"backend": name, "q_len": q_len, "kv_len": kv_len,
                         "first_ms": first, "steady_ms": steady, "max_abs_err": err,
                         "tflops": flops / steady / 1e9})  # fmt: skip
            print(f"{name:9s} {q_len:5d}x{kv_len:<5d} first {first:8.2f} ms  steady "
                  f"{steady:7.3f} ms  {flops / steady / 1e9:6.1f} TFLOP/s  err {err:.2e}",
                  flush=True)  # fmt: skip
    out = {**machine_info(), "benchmark": "sdpa_backends", "args": {**vars(args),
           "out": str(args.out)}, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
