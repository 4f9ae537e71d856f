"""MLA attention of a chunk of new tokens: decompressed keys and values against absorbed.

    python -m bench.mla_paths --out $OUT/mla_paths_h200.json              # CUDA, V3 width
    python -m bench.mla_paths --device cpu --dtype float32 --heads 16 \\
        --contexts 1024 --queries 1,4,16,64 --out /tmp/mla_paths_cpu.json  # a dry run

One sequence with ``q`` new tokens at the end of a ``L``-token context over the paged
latent cache, DeepSeek-V3's MLA shapes (kv_lora_rank 512, rope 64, nope 128, v 128,
128-token blocks; ``--heads`` 128 by default), the engine's own MLA backend for the device
(TileLang's on CUDA): ``decompressed`` is its prefill path (``W_UK``/``W_UV`` applied to
every cached latent, then SDPA's fused attention), ``absorbed`` its decode path with each
new token a decode row of its own (``AttentionMetadata.token_rows``: what a mixed step
does for a sequence of at most ``torch_mla.absorbed_max_query`` new tokens). Both are
checked against each other, then timed as a layer of an eager step runs them (the row
metadata built once, as a step builds it once for every layer): calls back to back, the
device waited for at the end, median of ``--repeats`` rounds. The FLOP count says the
absorbed path is cheaper below ``(nope + v) * R / (2R - nope - v)`` queries (170 at V3's
shapes); this measures where it is on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import machine_info
from engine.attention import backend_for
from engine.attention.base import AttentionMetadata
from engine.config import MLAConfig
from kvstore.layout import KVCache, KVCacheLayout

MLA = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def step(heads: int, context: int, queries: int, block: int, device: str, dtype: torch.dtype):
    """The backend, its cache layer, and one sequence's q, kv_b and metadata."""
    g = torch.Generator(device=device).manual_seed(context * 1000 + queries)
    blocks = -(-context // block)
    layout = KVCacheLayout.for_mla(1, MLA.kv_lora_rank, MLA.qk_rope_head_dim, block, dtype)
    cache = KVCache(layout, blocks + 1, device)
    cache.storage.copy_(torch.randn(cache.shape, generator=g, device=device).to(dtype))
    positions = torch.arange(context - queries, context, device=device)
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, queries], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=device), block_tables=table,
        slot_mapping=(table[0, positions // block].long() * block + positions % block),
        max_query_len=queries, max_seq_len=context, query_lens_cpu=[queries],
        seq_lens_cpu=[context],
    )  # fmt: skip
    q = torch.randn(queries, heads, MLA.qk_head_dim, generator=g, device=device).to(dtype)
    kv_b = torch.randn(heads * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank,
                       generator=g, device=device).to(dtype) * MLA.kv_lora_rank**-0.5  # fmt: skip
    backend = backend_for(device, kind="mla")(cache, heads, MLA, MLA.qk_head_dim**-0.5)
    return backend, cache.layers[0], q, kv_b, meta


def seconds_per_call(fn, repeats: int, calls: int, device: str) -> float:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    sync()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def point(args: argparse.Namespace, context: int, queries: int) -> dict:
    dtype = DTYPES[args.dtype]
    backend, layer, q, kv_b, meta = step(args.heads, context, queries, args.block,
                                         args.device, dtype)  # fmt: skip
    rows = meta.token_rows(queries)

    def decompressed():
        return backend.prefill(layer, q, kv_b, meta)

    def absorbed():
        return backend.decode(layer, q, kv_b, rows.meta)

    with torch.inference_mode():
        a, b = decompressed().float(), absorbed().float()
        err = float((a - b).norm() / a.norm())
        paths = (("decompressed", decompressed), ("absorbed", absorbed))
        times = {name: seconds_per_call(fn, args.repeats, args.calls, args.device)
                 for name, fn in paths}  # fmt: skip
    return {"context": context, "queries": queries, "rel_err": err,
            "decompressed_ms": times["decompressed"] * 1e3,
            "absorbed_ms": times["absorbed"] * 1e3,
            "absorbed_speedup": times["decompressed"] / times["absorbed"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--queries", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results/mla_paths.json"))
    args = ap.parse_args()
    mla = MLA
    crossover = ((mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank
                 / (2 * mla.kv_lora_rank - mla.qk_nope_head_dim - mla.v_head_dim))  # fmt: skip
    result = {**machine_info(), "benchmark": "mla_paths",
              "args": {**vars(args), "out": str(args.out)},
              "flop_crossover_queries": crossover, "points": []}  # fmt: skip
    print(f"{'context':>8} {'queries':>7} {'decompressed ms':>16} {'absorbed ms':>12} "
          f"{'speedup':>8} {'rel err':>8}")  # fmt: skip
    for context in map(int, args.contexts.split(",")):
        for queries in map(int, args.queries.split(",")):
            if queries > context:
                continue
            p = point(args, context, queries)
            result["points"].append(p)
            print(f"{context:>8} {queries:>7} {p['decompressed_ms']:>16.3f} "
                  f"{p['absorbed_ms']:>12.3f} {p['absorbed_speedup']:>7.2f}x "
                  f"{p['rel_err']:>8.1e}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"FLOP crossover: absorbed cheaper below {crossover:.0f} queries; wrote {args.out}")


if __name__ == "__main__":
    main()
