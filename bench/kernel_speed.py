"""GPU kernel micro-benchmark: each TileLang kernel checked, then timed, beside torch.

    python bench/kernel_speed.py [--out DIR] [--jobs N] [--quick]

On a CUDA machine with TileLang (see ../shared/gpu/README.md for the bundle). For each
kernel: compare against its torch reference on fresh random inputs (relative error in
float64 against the float32 reference), then time it with CUDA events over a CUDA-graph
replay of several calls on distinct input copies (so small problems are not served from
L2), median of many replays. Memory-bound kernels report achieved GB/s, counting the
fewest bytes the kernel must move (each input read once, each output written once),
against the measured copy ceiling; prefill reports TFLOP/s (causal: only the unmasked
half) against the measured bf16 matmul rate. torch's equivalents are timed in the same
run for the ratio. Shapes are Llama-3.1-8B's (32 q heads, 8 kv heads, head_dim 128,
hidden 4096), block size 128. Writes ``kernels_h200.json`` (with ``machine_info()``) to
--out and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info  # noqa: E402
from kernels import activation as act  # noqa: E402
from kernels import (
    fp8,  # noqa: E402
    moe,  # noqa: E402
)
from kernels import gemv as gv  # noqa: E402
from kernels import mla_decode as mla  # noqa: E402
from kernels import norm_rope_cache as nrc  # noqa: E402
from kernels import paged_decode_attention as dec  # noqa: E402
from kernels import prefill_attention as pre  # noqa: E402

HEADS, KV_HEADS, DIM, HIDDEN, BLOCK = 32, 8, 128, 4096, 128
SCALE = DIM**-0.5
BF16 = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20
DECODE_POINTS = [(b, c) for c in (1024, 8192) for b in (1, 8, 64, 256)]
PREFILL_POINTS = [(2048, 2048), (8192, 8192), (8192, 2048)]  # (context, new tokens)
SMALL_TOKENS = [1, 64, 256, 8192]
INTER = 14336
GEMV_SHAPES = {  # name: (N, K), the 8B shape's decode projections
    "qkv_proj": ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
}
GEMV_ROWS = [1, 2, 3, 4, 8]
SECTIONS = ("decode", "prefill", "small", "gemv")


# --- timing -------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], None], reps: int = 50) -> float:
    """Median of ``reps`` event-timed calls after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_calls(calls: list[Callable[[], object]]) -> tuple[float, str]:
    """ms per call: the calls (one per input copy) captured in one CUDA graph and replayed.

    Falls back to eager launches when capture fails; says which it used.
    """
    for call in calls:
        call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return _median_ms(graph.replay) / len(calls), "graph"
    except Exception:  # noqa: BLE001 - any capture failure: time eagerly instead
        torch.cuda.synchronize()
        return _median_ms(lambda: [c() for c in calls]) / len(calls), "eager"


def copies_for(nbytes: int, cap: int = 32) -> int:
    return max(1, min(cap, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def measure_ceilings() -> dict:
    """Device-to-device copy (bytes read + written) and an 8192³ bf16 matmul."""
    src = torch.randn(1 << 30, device="cuda", dtype=BF16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(partial(dst.copy_, src), reps=20)
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn_like(a)
    mm_ms = _median_ms(partial(torch.matmul, a, b), reps=20)
    return {
        "copy_GBps": 2 * (2 << 30) / copy_ms / 1e6,
        "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
    }


# --- decode -------------------------------------------------------------------------------


def decode_inputs(batch: int, ctx: int) -> dict:
    per_seq = ctx // BLOCK
    num_blocks = 1 + batch * per_seq
    cache = torch.randn(num_blocks, BLOCK, 2 * KV_HEADS * DIM, device="cuda", dtype=BF16)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, per_seq).int()
    return {
        "q": torch.randn(batch, HEADS, DIM, device="cuda", dtype=BF16),
        "cache": cache,
        "tables": tables.contiguous(),
        "lens": torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
    }


def decode_bytes(batch: int, ctx: int) -> int:
    return 2 * (batch * ctx * 2 * KV_HEADS * DIM + 2 * batch * HEADS * DIM)


def torch_decode_calls(inputs: list[dict], ctx: int) -> dict[str, list[Callable]]:
    """torch SDPA over dense [B, Hkv, L, D] (a static cache), and the engine's torch path."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_sdpa import TorchSDPABackend
    from kvstore.layout import KVCache, KVCacheLayout

    dense, engine = [], []
    for x in inputs:
        batch = x["q"].shape[0]
        kv = x["cache"][x["tables"].long()].flatten(1, 2)  # [B, L, 2*Hkv*D]
        k = kv[..., : KV_HEADS * DIM].unflatten(-1, (KV_HEADS, DIM)).transpose(1, 2).contiguous()
        v = kv[..., KV_HEADS * DIM :].unflatten(-1, (KV_HEADS, DIM)).transpose(1, 2).contiguous()
        del kv
        q4 = x["q"].unsqueeze(2)
        dense.append(
            lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
                q4, k, v, scale=SCALE, enable_gqa=True
            )
        )
        layout = KVCacheLayout.for_attention(1, KV_HEADS, DIM, BLOCK, BF16)
        kvc = KVCache(layout, 1, "cuda")
        kvc.layers[0] = x["cache"]
        backend = TorchSDPABackend(kvc, HEADS, KV_HEADS, DIM, SCALE)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
            seq_lens=x["lens"],
            block_tables=x["tables"],
            slot_mapping=torch.zeros(batch, device="cuda", dtype=torch.int64),
            max_query_len=1,
            max_seq_len=ctx,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[ctx] * batch,
        )
        kz = torch.zeros(batch, KV_HEADS, DIM, device="cuda", dtype=BF16)
        engine.append(lambda b=backend, q=x["q"], kz=kz, m=meta: b.forward(0, q, kz, kz, m))
    return {"torch_sdpa_dense": dense, "torch_engine_backend": engine}


def bench_decode(variants: dict, with_torch: bool) -> list[dict]:
    rows = [_decode_point(b, c, variants, with_torch) for b, c in DECODE_POINTS]
    torch.cuda.empty_cache()
    return rows


def _decode_point(batch: int, ctx: int, variants: dict, with_torch: bool) -> dict:
    nbytes = decode_bytes(batch, ctx)
    inputs = [decode_inputs(batch, ctx) for _ in range(copies_for(nbytes))]
    x = inputs[0]
    n_check = min(batch, 16)
    ref = dec.paged_decode_attention_ref(
        x["q"][:n_check],
        x["cache"],
        x["tables"][:n_check],
        x["lens"][:n_check],
        num_kv_heads=KV_HEADS,
        scale=SCALE,
    )
    row = {"batch": batch, "context": ctx, "bytes": nbytes, "variants": {}}
    runs = {name: partial(_run_decode, ctx=ctx, cfg=cfg) for name, cfg in variants.items()}
    if batch <= 8:  # latency-bound sizes: try more splits than the heuristic picks
        auto = dec.choose_num_splits(batch, KV_HEADS, ctx, 64)
        for mult in (2, 4):
            splits = min(auto * mult, ctx // 64)
            runs[f"n64_x{mult}splits"] = partial(
                _run_decode, ctx=ctx, cfg=variants["n64"], splits=splits
            )
    for name, run in runs.items():
        err = rel_err(run(x)[:n_check], ref)
        ms, how = time_calls([partial(run, x) for x in inputs])
        row["variants"][name] = {"rel_err": err, "ms": ms, "GBps": nbytes / ms / 1e6, "timing": how}
    if with_torch:
        row["torch"] = _time_torch(lambda: torch_decode_calls(inputs, ctx), nbytes)
    torch.cuda.empty_cache()
    return row


def _run_decode(x: dict, ctx: int, cfg, splits: int | None = None) -> torch.Tensor:
    return dec.paged_decode_attention(
        x["q"],
        x["cache"],
        x["tables"],
        x["lens"],
        num_kv_heads=KV_HEADS,
        scale=SCALE,
        max_seq_len=ctx,
        num_splits=splits,
        config=cfg,
    )


def _time_torch(make: Callable[[], dict[str, list[Callable]]], nbytes: int) -> dict:
    out = {}
    try:
        calls = make()
    except Exception as err:  # noqa: BLE001 - record, e.g. out of memory
        return {"error": repr(err)[:200]}
    for name, fns in calls.items():
        try:
            ms, how = time_calls(fns)
            out[name] = {"ms": ms, "GBps": nbytes / ms / 1e6, "timing": how}
        except Exception as err:  # noqa: BLE001
            out[name] = {"error": repr(err)[:200]}
    del calls
    torch.cuda.empty_cache()
    return out


# --- prefill ------------------------------------------------------------------------------


def prefill_inputs(ctx: int, new: int) -> dict:
    per_seq = math.ceil(ctx / BLOCK)
    cache = torch.randn(1 + per_seq, BLOCK, 2 * KV_HEADS * DIM, device="cuda", dtype=BF16)
    return {
        "q": torch.randn(new, HEADS, DIM, device="cuda", dtype=BF16),
        "cache": cache,
        "tables": (torch.randperm(per_seq, device="cuda") + 1).int().view(1, per_seq),
        "lens": torch.tensor([ctx], device="cuda", dtype=torch.int32),
        "starts": torch.tensor([0, new], device="cuda", dtype=torch.int32),
    }


def prefill_flops(ctx: int, new: int) -> float:
    """Causal: row at position p attends p+1 keys; QK and PV are 2*D flops per pair each."""
    first = ctx - new
    pairs = new * first + new * (new + 1) / 2
    return 4.0 * DIM * HEADS * pairs


def bench_prefill(variants: list[pre.PrefillConfig], with_torch: bool) -> list[dict]:
    return [_prefill_point(ctx, new, variants, with_torch) for ctx, new in PREFILL_POINTS]


def _prefill_point(ctx: int, new: int, variants: list, with_torch: bool) -> dict:
    flops = prefill_flops(ctx, new)
    x = prefill_inputs(ctx, new)
    args = (x["q"], x["cache"], x["tables"], x["lens"], x["starts"])
    ref = pre.prefill_attention_ref(*args, num_kv_heads=KV_HEADS, scale=SCALE)
    row = {"context": ctx, "new_tokens": new, "flops": flops, "variants": {}}
    for cfg in variants:
        run = partial(
            pre.prefill_attention,
            *args,
            max_query_len=new,
            num_kv_heads=KV_HEADS,
            scale=SCALE,
            config=cfg,
        )
        err = rel_err(run(), ref)
        ms, how = time_calls([run] * 4)
        row["variants"][_name(cfg)] = {
            "rel_err": err,
            "ms": ms,
            "TFLOPs": flops / ms / 1e9,
            "timing": how,
        }
    if with_torch:
        row["torch"] = _time_torch_prefill(x, ctx, new, flops)
    return row


def _time_torch_prefill(x: dict, ctx: int, new: int, flops: float) -> dict:
    """torch SDPA on dense [1, H, L, D] (causal, right-aligned), same flops counted."""
    kv = x["cache"][x["tables"][0].long()].flatten(0, 1)[:ctx]
    k = kv[:, : KV_HEADS * DIM].view(ctx, KV_HEADS, DIM).transpose(0, 1)[None].contiguous()
    v = kv[:, KV_HEADS * DIM :].view(ctx, KV_HEADS, DIM).transpose(0, 1)[None].contiguous()
    q = x["q"].transpose(0, 1)[None].contiguous()
    if new == ctx:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        rows = torch.arange(ctx - new, ctx, device="cuda")[:, None]
        mask = torch.arange(ctx, device="cuda")[None, :] <= rows
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    try:
        ms, how = time_calls([fn] * 4)
    except Exception as err:  # noqa: BLE001
        return {"error": repr(err)[:200]}
    return {"torch_sdpa_dense": {"ms": ms, "TFLOPs": flops / ms / 1e9, "timing": how}}


# --- small memory-bound kernels -----------------------------------------------------------


def bench_small() -> list[dict]:
    rows = []
    cos_sin = _cos_sin(8192)
    for tokens in SMALL_TOKENS:
        rows.append(_bench_norm(tokens))
        rows.append(_bench_rope(tokens, cos_sin))
        rows.append(_bench_cache_write(tokens))
    return rows


def _cos_sin(max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / 500000 ** (torch.arange(0, DIM, 2, device="cuda").float() / DIM)
    angles = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _bench_norm(tokens: int) -> dict:
    nbytes = 2 * (4 * tokens * HIDDEN + HIDDEN)
    sets = [
        [torch.randn(n, HIDDEN, device="cuda", dtype=BF16) for n in (tokens, tokens, 1)]
        for _ in range(copies_for(nbytes))
    ]
    sets = [(x, r, w[0]) for x, r, w in sets]
    x, r, w = (t.clone() for t in sets[0])
    ref_out, ref_sum = nrc.rms_norm_ref(x, w, 1e-5, r)
    nrc.fused_add_rms_norm(x, r, w, 1e-5)
    err = max(rel_err(x, ref_out), rel_err(r, ref_sum))
    ms, how = time_calls([lambda s=s: nrc.fused_add_rms_norm(*s, 1e-5) for s in sets])

    def torch_norm(s):
        s[1].add_(s[0])
        return F.rms_norm(s[1], (HIDDEN,), s[2], 1e-5)

    torch_ms, _ = time_calls([lambda s=s: torch_norm(s) for s in sets])
    return _small_row("fused_add_rms_norm", tokens, nbytes, err, ms, how, torch_ms)


def _bench_rope(tokens: int, cos_sin: torch.Tensor) -> dict:
    nbytes = 2 * 2 * tokens * (HEADS + KV_HEADS) * DIM + tokens * (8 + 4 * DIM)
    sets = []
    for _ in range(copies_for(nbytes)):
        q = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=BF16)
        k = torch.randn(tokens, KV_HEADS, DIM, device="cuda", dtype=BF16)
        sets.append((torch.randint(0, 8192, (tokens,), device="cuda"), q, k))
    pos, q, k = sets[0]
    q_ref, k_ref = nrc.rotary_embedding_ref(pos, q, k, cos_sin)
    nrc.rotary_embedding(pos, q, k, cos_sin)
    err = max(rel_err(q, q_ref), rel_err(k, k_ref))
    ms, how = time_calls([lambda s=s: nrc.rotary_embedding(*s, cos_sin) for s in sets])

    def torch_rope(pos, q, k):
        cos, sin = cos_sin[pos].unsqueeze(1).to(q.dtype).chunk(2, dim=-1)
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    torch_ms, _ = time_calls([lambda s=s: torch_rope(*s) for s in sets])
    return _small_row("rotary_embedding", tokens, nbytes, err, ms, how, torch_ms)


def _bench_cache_write(tokens: int) -> dict:
    width = KV_HEADS * DIM
    nbytes = 2 * 2 * tokens * 2 * width + 8 * tokens
    num_blocks = math.ceil(tokens / BLOCK) + 1
    sets = []
    for _ in range(copies_for(nbytes)):
        k = torch.randn(tokens, KV_HEADS, DIM, device="cuda", dtype=BF16)
        cache = torch.randn(num_blocks, BLOCK, 2 * width, device="cuda", dtype=BF16)
        slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]
        sets.append((k, torch.randn_like(k), cache, slots))
    k, v, cache, slots = sets[0]
    expected = cache.clone()
    nrc.write_kv_cache_ref(k, v, expected, slots)
    nrc.write_kv_cache(k, v, cache, slots)
    err = 0.0 if torch.equal(cache, expected) else math.inf
    ms, how = time_calls([lambda s=s: nrc.write_kv_cache(*s) for s in sets])

    def torch_write(k, v, cache, slots):
        flat = cache.view(-1, cache.shape[-1])
        flat[slots] = torch.cat((k.flatten(1), v.flatten(1)), dim=1)

    torch_ms, _ = time_calls([lambda s=s: torch_write(*s) for s in sets])
    return _small_row("write_kv_cache", tokens, nbytes, err, ms, how, torch_ms)


def _small_row(name, tokens, nbytes, err, ms, how, torch_ms) -> dict:
    return {
        "kernel": name,
        "tokens": tokens,
        "bytes": nbytes,
        "rel_err": err,
        "ms": ms,
        "GBps": nbytes / ms / 1e6,
        "timing": how,
        "torch_ms": torch_ms,
        "torch_GBps": nbytes / torch_ms / 1e6,
    }


# --- skinny linear -------------------------------------------------------------------------


def bench_gemv() -> list[dict]:
    """The decode projections at M rows: the TileLang GEMV (M <= its limit) beside
    torch's F.linear, both reading the weight once per call (bytes = weight + x + y)."""
    rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        for m in GEMV_ROWS:
            nbytes = 2 * (n * k + m * k + m * n)
            sets = [
                (torch.randn(m, k, device="cuda", dtype=BF16),
                 torch.randn(n, k, device="cuda", dtype=BF16) / math.sqrt(k))
                for _ in range(copies_for(nbytes, cap=8))
            ]  # fmt: skip
            torch_ms, _ = time_calls([lambda s=s: F.linear(*s) for s in sets])
            row = {"kernel": "gemv", "proj": name, "m": m, "n": n, "k": k, "bytes": nbytes,
                   "torch_ms": torch_ms, "torch_GBps": nbytes / torch_ms / 1e6}  # fmt: skip
            if gv.gemv_supported(*sets[0]):
                row["rel_err"] = rel_err(gv.gemv(*sets[0]), gv.gemv_ref(*sets[0]))
                ms, how = time_calls([lambda s=s: gv.gemv(*s) for s in sets])
                row.update(ms=ms, GBps=nbytes / ms / 1e6, timing=how)
            rows.append(row)
            del sets
    return rows


# --- compile ahead, in parallel -----------------------------------------------------------


def _name(cfg) -> str:
    if isinstance(cfg, dec.DecodeConfig):
        return f"n{cfg.block_n}_s{cfg.num_stages}_t{cfg.threads}"
    return f"m{cfg.block_m}_n{cfg.block_n}_s{cfg.num_stages}_t{cfg.threads}"


def _build(cfg) -> float:
    start = time.perf_counter()
    builder = {
        dec.DecodeConfig: dec.decode_build,
        pre.PrefillConfig: pre.prefill_build,
        nrc.NormConfig: nrc.norm_build,
        nrc.RopeConfig: nrc.rope_build,
        nrc.CacheWriteConfig: nrc.cache_write_build,
        gv.GemvConfig: gv.gemv_build,
        act.SiluMulConfig: act.silu_mul_build,
        mla.MLADecodeConfig: mla.mla_decode_build,
        moe.GroupedGemmConfig: moe.grouped_gemm_build,
        fp8.QuantizeRowsConfig: fp8.quantize_rows_build,
    }[type(cfg)]
    builder(cfg).build()
    return time.perf_counter() - start


def compile_all(configs: list, jobs: int) -> dict:
    """Fill TileLang's disk cache from ``jobs`` processes; the timed process then loads."""
    times, failures = {}, {}
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(_build, cfg): cfg for cfg in configs}
        for fut, cfg in futures.items():
            try:
                times[repr(cfg)] = fut.result()
            except Exception:  # noqa: BLE001 - report and carry on with the others
                failures[repr(cfg)] = traceback.format_exc()[-1500:]
    return {"seconds": times, "failures": failures}


def configs() -> tuple[dict, list, list]:
    """Decode variants by name (None: the wrapper's own choice), prefill variants, others."""
    n64 = dec.default_config(HEADS, KV_HEADS, DIM, BLOCK, BF16, SCALE, batch=1)
    decode = {"auto": None, "n64": n64, "n128": replace(n64, block_n=128)}
    base_pre = pre.default_config(HEADS, KV_HEADS, DIM, BLOCK, BF16, SCALE)
    prefill = [
        base_pre,
        replace(base_pre, block_n=64),
        replace(base_pre, threads=128),
    ]
    small = [
        nrc.NormConfig(HIDDEN, "bfloat16", 1e-5, True),
        nrc.RopeConfig(HEADS, KV_HEADS, DIM, "bfloat16"),
        nrc.CacheWriteConfig(KV_HEADS, DIM, BLOCK, "bfloat16"),
    ]
    return decode, prefill, small


def gemv_configs() -> list[gv.GemvConfig]:
    return [
        gv.GemvConfig(m, n, k, "bfloat16")
        for n, k in GEMV_SHAPES.values()
        for m in GEMV_ROWS
        if m <= gv.MAX_ROWS
    ]


def decode_builds(variants: dict) -> list:
    """Every compiled form the decode variants can take (with and without the combine)."""
    cfgs = [c for c in variants.values() if c is not None]
    return [replace(c, combine=flag) for c in cfgs for flag in (True, False)]


# --- report -------------------------------------------------------------------------------


def best(variants: dict, key: str) -> tuple[str, dict]:
    ok = {k: v for k, v in variants.items() if v["rel_err"] <= 1e-2}
    pool = ok or variants
    name = max(pool, key=lambda k: pool[k][key])
    return name, pool[name]


def table(result: dict) -> str:
    ceil = result["ceilings"]
    bw, peak = ceil["copy_GBps"], ceil["matmul_TFLOPs"]
    lines = [f"ceilings: copy {bw:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s"]
    lines.append(
        "decode Hq32/Hkv8/D128/bs128  B   ctx  auto-us   GB/s  %copy  err      "
        "best-variant     us  torch-dense-us  x  torch-engine-us  x"
    )
    for r in result.get("decode", []):
        v = r["variants"]["auto"]
        name, top = best(r["variants"], "GBps")
        t = r.get("torch", {})
        td, te = t.get("torch_sdpa_dense", {}), t.get("torch_engine_backend", {})
        lines.append(
            f"  {r['batch']:>4} {r['context']:>5} {v['ms'] * 1e3:8.1f} {v['GBps']:6.0f} "
            f"{100 * v['GBps'] / bw:5.1f}%  {v['rel_err']:.1e}  {name:<14} "
            f"{top['ms'] * 1e3:6.1f} {_us(td)} {_ratio(td, v)}  {_us(te)} {_ratio(te, v)}"
        )
    lines.append(
        "prefill (causal)  ctx  new   best-variant        ms   TFLOP/s  %peak  err      torch-ms  x"
    )
    for r in result.get("prefill", []):
        name, v = best(r["variants"], "TFLOPs")
        td = r.get("torch", {}).get("torch_sdpa_dense", {})
        torch_ms = f"{td['ms']:8.3f}" if "ms" in td else "       -"
        ratio = f"{td['ms'] / v['ms']:4.2f}" if "ms" in td else "   -"
        lines.append(
            f"  {r['context']:>5} {r['new_tokens']:>5}  {name:<20} {v['ms']:7.3f} "
            f"{v['TFLOPs']:7.0f} {100 * v['TFLOPs'] / peak:5.1f}%  {v['rel_err']:.1e}  "
            f"{torch_ms} {ratio}"
        )
    lines.append("gemv proj        M     us    GB/s  %copy  err      torch-us  torch-GB/s  x")
    for r in result.get("gemv", []):
        if "ms" in r:
            pct = 100 * r["GBps"] / bw
            mine = f"{r['ms'] * 1e3:7.1f} {r['GBps']:7.0f} {pct:5.1f}%  {r['rel_err']:.1e}"
        else:
            mine = f"{'-':>7} {'-':>7} {'-':>6}  {'-':>7}"
        ratio = f"{r['torch_ms'] / r['ms']:5.2f}" if "ms" in r else "    -"
        lines.append(
            f"  {r['proj']:<14} {r['m']:>2} {mine}  {r['torch_ms'] * 1e3:7.1f} "
            f"{r['torch_GBps']:10.0f} {ratio}"
        )
    lines.append("small kernels   tokens     us    GB/s  %copy  err      torch-us  x")
    for r in result.get("small", []):
        lines.append(
            f"  {r['kernel']:<20} {r['tokens']:>5} {r['ms'] * 1e3:7.1f} {r['GBps']:7.0f} "
            f"{100 * r['GBps'] / bw:5.1f}%  {r['rel_err']:.1e}  {r['torch_ms'] * 1e3:7.1f} "
            f"{r['torch_ms'] / r['ms']:5.2f}"
        )
    return "\n".join(lines)


def _us(t: dict) -> str:
    return f"{t['ms'] * 1e3:9.1f}" if "ms" in t else "        -"


def _ratio(t: dict, v: dict) -> str:
    return f"{t['ms'] / v['ms']:5.2f}" if "ms" in t else "    -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="which to run (the others keep their last figures)")  # fmt: skip
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    decode_cfgs, prefill_cfgs, small_cfgs = configs()
    result = machine_info()
    if args.commit:
        result["commit"] = args.commit
    by_section = {
        "decode": decode_builds(decode_cfgs),
        "prefill": prefill_cfgs,
        "small": small_cfgs,
        "gemv": gemv_configs(),
    }
    builds = [cfg for name in sections for cfg in by_section[name]]
    result["compile"] = compile_all(builds, args.jobs)
    result["ceilings"] = measure_ceilings()
    result["configs"] = {
        "decode": {k: c and asdict(c) for k, c in decode_cfgs.items()},
        "prefill": [asdict(c) for c in prefill_cfgs],
    }
    for section, fn in [
        ("decode", lambda: bench_decode(decode_cfgs, not args.no_torch)),
        ("prefill", lambda: bench_prefill(prefill_cfgs, not args.no_torch)),
        ("small", bench_small),
        ("gemv", bench_gemv),
    ]:
        if section not in sections:
            continue
        try:
            result[section] = fn()
        except Exception:  # noqa: BLE001 - keep the other sections
            result[section] = []
            result.setdefault("errors", {})[section] = traceback.format_exc()[-3000:]
            print(result["errors"][section], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernels_h200.json"
    if sections != set(SECTIONS) and path.exists():
        result = {**json.loads(path.read_text()), **result}  # keep the sections not rerun
    path.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
