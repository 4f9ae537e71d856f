"""Host time per kernel call on the GPU, and where an eager engine step's host time goes.

    python -m bench.launch_overhead --out $OUT/launch_overhead_h200.json

An eager step (every step with a prompt's chunk, and decode steps that no CUDA graph
holds) is issued from the host kernel by kernel; at the 8B shape that host time was
2-3x the device time. This measures, in one run:

- ``calls``: microseconds of host time per call, issued back to back, for the engine's
  TileLang wrappers (their argument checks, configuration key and output allocation
  included), the compiled kernel called directly, and torch ops of the same sizes;
- ``backends``: one TileLang program (the RMSNorm) built for each execution backend that
  builds here, called directly;
- ``profile``: the functions an eager decode step of ``--preset`` at batch
  ``--batch`` spends its host time in (cProfile, sorted by own time);
- ``steps``: steps with a prompt's chunk (``--steps-points``: prompt tokens + decode
  rows of 1k context each) eager and through the piecewise graphs
  (``engine.piecewise_graphs``), same runner, same KV cache: wall time per step (host
  clock to the sampled tokens), host time until the step is queued, and the logits'
  relative error against the eager step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import machine_info


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Host microseconds per call of ``fn``, called back to back (the device queue is
    drained before and its wait is not counted)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best / calls * 1e6


def calls_section(hidden: int) -> dict:
    from kernels import activation
    from kernels import norm_rope_cache as nrc
    from kernels.paged_decode_attention import paged_decode_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(4, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device=dev, dtype=dt)
    out = torch.empty_like(x)
    heads, kv_heads, dim, block = 32, 8, 128, 128
    q = torch.randn(4, heads, dim, device=dev, dtype=dt)
    k = torch.randn(4, kv_heads, dim, device=dev, dtype=dt)
    pos = torch.arange(4, device=dev)
    cos_sin = torch.randn(4096, dim, device=dev, dtype=torch.float32)
    cache = torch.zeros(64, block, 2 * kv_heads * dim, device=dev, dtype=dt)
    slots = torch.arange(4, device=dev)
    tables = torch.arange(32, device=dev, dtype=torch.int32).view(4, 8)
    lens = torch.full((4,), 1000, device=dev, dtype=torch.int32)
    gate_up = torch.randn(4, 2 * 14336, device=dev, dtype=dt)
    weight = torch.randn(hidden, hidden, device=dev, dtype=dt)

    norm_cfg = nrc.NormConfig(hidden, "bfloat16", 1e-5, residual=False)
    norm = nrc._KERNELS.get(norm_cfg, nrc.norm_build)
    nrc.rms_norm(x, w, 1e-5)
    executable = norm.adapter._get_executable()
    out_rows = {
        "torch_add_out": per_call_us(lambda: torch.add(x, res, out=out)),
        "torch_empty_like": per_call_us(lambda: torch.empty_like(x)),
        "torch_linear_4_rows": per_call_us(lambda: torch.nn.functional.linear(x, weight)),
        "rms_norm_wrapper": per_call_us(lambda: nrc.rms_norm(x, w, 1e-5)),
        "rms_norm_kernel": per_call_us(lambda: norm(x, w, out)),
        "rms_norm_executable": per_call_us(lambda: executable(x, w, out)),
        "fused_add_rms_norm_wrapper": per_call_us(
            lambda: nrc.fused_add_rms_norm(x, res, w, 1e-5)
        ),
        "rotary_wrapper": per_call_us(lambda: nrc.rotary_embedding(pos, q, k, cos_sin)),
        "write_kv_cache_wrapper": per_call_us(lambda: nrc.write_kv_cache(k, k, cache, slots)),
        "silu_and_mul_wrapper": per_call_us(lambda: activation.silu_and_mul(gate_up)),
        "paged_decode_attention_wrapper": per_call_us(
            lambda: paged_decode_attention(q, cache, tables, lens, num_kv_heads=kv_heads,
                                           scale=dim**-0.5, max_seq_len=1024)  # fmt: skip
        ),
    }
    return {
        "us_per_call": out_rows,
        "execution_backend": getattr(norm, "execution_backend", None),
        "dlpack_c_exchange": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        or hasattr(torch.Tensor, "__c_dlpack_exchange_api__"),
    }


def backends_section(hidden: int) -> dict:
    import tilelang

    from kernels import norm_rope_cache as nrc

    x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ref = nrc.rms_norm(x, w, 1e-5)
    rows: dict[str, object] = {}
    for backend in ("tvm_ffi", "cython", "nvrtc"):
        try:
            func = nrc._norm_program(hidden, "bfloat16", 1e-5, False)
            kernel = tilelang.compile(func, out_idx=None, execution_backend=backend)
            kernel(x, w, out)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            rows[backend] = {"us_per_call": per_call_us(lambda k=kernel: k(x, w, out)),
                             "max_abs_err": err}  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a backend that does not build here
            rows[backend] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    return rows


def profile_section(preset: str, batch: int, context: int, steps: int) -> dict:
    from bench.gpu_engine import Bench
    from engine.plan import ScheduledChunk, StepPlan

    bench = Bench(preset, batch * (-(-context // 128)) + 8)
    ids = bench._register(batch)
    per_seq = -(-context // 128)
    vocab = bench.config.vocab_size
    chunks = [
        ScheduledChunk(rid, [(7 + 13 * i) % vocab], context - 1,
                       list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True)
        for i, rid in enumerate(ids)
    ]  # fmt: skip
    plan = StepPlan(chunks=chunks)
    runner = bench.runner
    for _ in range(3):
        runner.execute(plan)
    torch.cuda.synchronize()
    host = []
    for _ in range(steps):
        start = time.perf_counter()
        sampled = runner.sample(plan)
        host.append(time.perf_counter() - start)
        sampled[1].to_host()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        runner.sample(plan)[1].to_host()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    host.sort()
    return {"preset": preset, "batch": batch, "context": context, "steps": steps,
            "host_ms_median": host[len(host) // 2] * 1e3, "profile": text.getvalue()}  # fmt: skip


def steps_section(preset: str, points: list[tuple[int, int]], max_tokens: int,
                  repeats: int) -> dict:  # fmt: skip
    from bench.gpu_engine import Bench, _cuda_time
    from engine.plan import ScheduledChunk, StepPlan

    context, block = 1024, 128
    per_seq = context // block
    rows = max(d for _, d in points)
    bench = Bench(preset, rows * per_seq + 8 + 2 * max_tokens // block)
    runner = bench.runner
    start = time.perf_counter()
    pieces = runner.capture_piecewise_graphs(max_tokens)
    capture_s = time.perf_counter() - start
    ids = bench._register(rows + 1)
    vocab = bench.config.vocab_size
    out = []
    for prompt, decode in points:
        chunks = [
            ScheduledChunk(rid, [(7 + 13 * i) % vocab], context - 1,
                           list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True)
            for i, rid in enumerate(ids[:decode])
        ]  # fmt: skip
        first = 1 + rows * per_seq
        tokens = [(3 + 11 * j) % vocab for j in range(prompt)]
        chunks.append(ScheduledChunk(ids[-1], tokens, 0,
                                     list(range(first, first + -(-prompt // block))), True))
        plan = StepPlan(chunks=chunks)
        row: dict[str, object] = {"prompt_tokens": prompt, "decode_rows": decode,
                                  "tokens": prompt + decode}  # fmt: skip
        logits = {}
        for mode in ("eager", "piecewise"):
            runner.pieces = pieces if mode == "piecewise" else None
            wall = _cuda_time(lambda p=plan: runner.execute(p), repeats)
            host = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                began = time.perf_counter()
                sampled = runner.sample(plan)
                host.append(time.perf_counter() - began)
                sampled[1].to_host()
            host.sort()
            with torch.inference_mode():
                logits[mode] = runner._logits(plan)[0].float()
            row[mode] = {"step_ms": wall * 1e3, "host_ms": host[len(host) // 2] * 1e3}
        err = (logits["piecewise"] - logits["eager"]).norm() / logits["eager"].norm()
        row["rel_err"] = err.item()
        row["speedup"] = row["eager"]["step_ms"] / row["piecewise"]["step_ms"]
        out.append(row)
        print(json.dumps(row), flush=True)
    runner.pieces = None
    return {"preset": preset, "max_tokens": max_tokens, "capture_s": capture_s,
            "buckets": list(pieces.sizes), "points": out}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sections", default="calls,backends,profile,steps")
    parser.add_argument("--steps-points", default="16+0,100+0,500+0,32+32,64+64,192+64,448+64",
                        help="prompt tokens + decode rows, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=512, help="the pieces' largest bucket")
    parser.add_argument("--out", default="bench/results/launch_overhead_h200.json")
    args = parser.parse_args()
    report: dict[str, object] = {"benchmark": "launch_overhead", **machine_info()}
    sections = args.sections.split(",")
    if "calls" in sections:
        report["calls"] = calls_section(args.hidden)
        print(json.dumps(report["calls"], indent=1), flush=True)
    if "backends" in sections:
        report["backends"] = backends_section(args.hidden)
        print(json.dumps(report["backends"], indent=1), flush=True)
    if "profile" in sections:
        report["profile"] = profile_section(args.preset, args.batch, args.context, args.steps)
        print(report["profile"]["profile"][:6000], flush=True)
    if "steps" in sections:
        points = [tuple(int(v) for v in p.split("+")) for p in args.steps_points.split(",")]
        report["steps"] = steps_section(args.preset, points, args.max_tokens, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
