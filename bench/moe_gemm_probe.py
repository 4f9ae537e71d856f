"""Why the TileLang grouped GEMM's warpgroup (64/128-row) configurations run slowly: the
gate/up kernel of ``kernels.moe`` in variants, on a prefill's routing.

    python -m bench.moe_gemm_probe [--out DIR] [--tokens 4096,16384]

On a CUDA machine, DeepSeek-V3's routed experts (``bench.mla_moe_speed``'s shapes and
uniform random routing). The variants differ in how a CTA learns its loop's length:
``dynamic`` (the kernel's own: zero steps past the last expert's blocks, a trip count
TileLang only knows at run time), ``guard`` (a constant trip count inside ``if expert <
E``), ``const`` (a constant trip count and no guard, launched on exactly the blocks that
hold rows: the main loop alone); and in rows per block, stages and threads. Each is
checked against torch (the valid rows of ``silu(x W_gate^T) * x W_up^T``), timed over
CUDA-graph replays, and its generated source searched for the Hopper features it uses
(TMA loads, warpgroup MMA, warp-specialised producer/consumer). torch's grouped GEMM and
the SiLU-and-mul after it are timed beside them.

Writes ``moe_gemm_probe_h200.json`` to --out and prints a table.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info  # noqa: E402
from bench.kernel_speed import time_calls  # noqa: E402
from bench.mla_moe_speed import EXPERTS, HIDDEN, INTER, TOP_K, moe_weights, routing  # noqa: E402
from kernels import moe  # noqa: E402
from kernels._tl import KernelCache, TileLangBuild, parallel_builds  # noqa: E402

BF16 = torch.bfloat16

# name: (mode, block_m, stages, threads)
VARIANTS = {
    "dynamic_bm128_s3": ("dynamic", 128, 3, 256),
    "const_bm128_s3": ("const", 128, 3, 256),
    "const_bm128_s4": ("const", 128, 4, 256),
    "const_bm64_s4": ("const", 64, 4, 128),
}
# the down kernel: its epilogue scatters each row to its pair (``kernels.moe``'s), or
# writes the block's rows in place (contiguous stores; the pairs are gathered back after)
DOWN_VARIANTS = {"down_scatter_bm128": ("scatter", 128), "down_rows_bm128": ("rows", 128),
                 "down_rows_bm128_s4": ("rows4", 128)}  # fmt: skip
FEATURES = {
    "tma": "tma_load",
    "wgmma": "wgmma",
    "warp_specialised": "warpgroup_reg_",
    "mbarrier": "barrier",
}


def gate_up_variant(experts, inter, hidden, dtype, block_m, block_n, block_k, stages, threads,
                    mode):  # fmt: skip
    """``kernels.moe._gate_up_program`` with the loop's length decided by ``mode``."""
    import tilelang.language as T

    accum = "float32"
    rows = T.dynamic("rows")
    m_blocks = T.dynamic("m_blocks")
    n_tiles = inter // block_n

    @T.prim_func
    def main(
        X: T.Tensor([rows, hidden], dtype),
        W13: T.Tensor([experts, 2 * inter, hidden], dtype),
        block_expert: T.Tensor([m_blocks], "int32"),
        Out: T.Tensor([rows, inter], dtype),
    ):
        with T.Kernel(m_blocks * n_tiles, threads=threads) as bid:
            a_s = T.alloc_shared([block_m, block_k], dtype)
            wg_s = T.alloc_shared([block_n, block_k], dtype)
            wu_s = T.alloc_shared([block_n, block_k], dtype)
            acc_g = T.alloc_fragment([block_m, block_n], accum)
            acc_u = T.alloc_fragment([block_m, block_n], accum)
            h = T.alloc_fragment([block_m, block_n], dtype)

            mb, nb = moe._tile_of(bid, m_blocks, n_tiles)
            expert = block_expert[mb]
            e = T.min(expert, experts - 1)
            if mode == "dynamic":
                steps = T.if_then_else(expert < experts, hidden // block_k, 0)
                T.clear(acc_g)
                T.clear(acc_u)
                for k in T.Pipelined(steps, num_stages=stages):
                    T.copy(X[mb * block_m, k * block_k], a_s)
                    T.copy(W13[e, nb * block_n, k * block_k], wg_s)
                    T.copy(W13[e, inter + nb * block_n, k * block_k], wu_s)
                    T.gemm(a_s, wg_s, acc_g, transpose_B=True)
                    T.gemm(a_s, wu_s, acc_u, transpose_B=True)
                for i, j in T.Parallel(block_m, block_n):
                    h[i, j] = T.cast(acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j],
                                     dtype)  # fmt: skip
                T.copy(h, Out[mb * block_m, nb * block_n])
            elif mode == "guard":
                if expert < experts:
                    T.clear(acc_g)
                    T.clear(acc_u)
                    for k in T.Pipelined(hidden // block_k, num_stages=stages):
                        T.copy(X[mb * block_m, k * block_k], a_s)
                        T.copy(W13[e, nb * block_n, k * block_k], wg_s)
                        T.copy(W13[e, inter + nb * block_n, k * block_k], wu_s)
                        T.gemm(a_s, wg_s, acc_g, transpose_B=True)
                        T.gemm(a_s, wu_s, acc_u, transpose_B=True)
                    for i, j in T.Parallel(block_m, block_n):
                        h[i, j] = T.cast(
                            acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j], dtype
                        )
                    T.copy(h, Out[mb * block_m, nb * block_n])
            else:
                T.clear(acc_g)
                T.clear(acc_u)
                for k in T.Pipelined(hidden // block_k, num_stages=stages):
                    T.copy(X[mb * block_m, k * block_k], a_s)
                    T.copy(W13[e, nb * block_n, k * block_k], wg_s)
                    T.copy(W13[e, inter + nb * block_n, k * block_k], wu_s)
                    T.gemm(a_s, wg_s, acc_g, transpose_B=True)
                    T.gemm(a_s, wu_s, acc_u, transpose_B=True)
                for i, j in T.Parallel(block_m, block_n):
                    h[i, j] = T.cast(acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j],
                                     dtype)  # fmt: skip
                T.copy(h, Out[mb * block_m, nb * block_n])

    return main


def down_variant(experts, hidden, inter, dtype, block_m, block_n, block_k, stages, threads, mode):
    """``kernels.moe._down_program`` with its epilogue chosen by ``mode``."""
    import tilelang.language as T

    accum = "float32"
    rows = T.dynamic("rows")
    m_blocks = T.dynamic("m_blocks")
    num_pairs = T.dynamic("num_pairs")
    n_tiles = hidden // block_n

    @T.prim_func
    def main(
        Hs: T.Tensor([rows, inter], dtype),
        W2: T.Tensor([experts, hidden, inter], dtype),
        block_expert: T.Tensor([m_blocks], "int32"),
        sorted_ids: T.Tensor([rows], "int32"),
        pair_weights: T.Tensor([num_pairs], accum),
        Y: T.Tensor([num_pairs, hidden], dtype),
        Ys: T.Tensor([rows, hidden], dtype),
    ):
        with T.Kernel(m_blocks * n_tiles, threads=threads) as bid:
            a_s = T.alloc_shared([block_m, block_k], dtype)
            w_s = T.alloc_shared([block_n, block_k], dtype)
            acc = T.alloc_fragment([block_m, block_n], accum)
            out = T.alloc_fragment([block_m, block_n], dtype)

            mb, nb = moe._tile_of(bid, m_blocks, n_tiles)
            expert = block_expert[mb]
            e = T.min(expert, experts - 1)
            steps = T.if_then_else(expert < experts, inter // block_k, 0)
            T.clear(acc)
            for k in T.Pipelined(steps, num_stages=stages):
                T.copy(Hs[mb * block_m, k * block_k], a_s)
                T.copy(W2[e, nb * block_n, k * block_k], w_s)
                T.gemm(a_s, w_s, acc, transpose_B=True)
            if mode == "scatter":
                for i, j in T.Parallel(block_m, block_n):
                    pair = sorted_ids[mb * block_m + i]
                    if pair < num_pairs:
                        Y[pair, nb * block_n + j] = T.cast(acc[i, j] * pair_weights[pair], dtype)
            else:
                for i, j in T.Parallel(block_m, block_n):
                    out[i, j] = T.cast(acc[i, j], dtype)
                T.copy(out, Ys[mb * block_m, nb * block_n])

    return main


def build_down(name: str) -> TileLangBuild:
    mode, block_m = DOWN_VARIANTS[name]
    stages = 4 if mode == "rows4" else 3
    return TileLangBuild(down_variant, (EXPERTS, HIDDEN, INTER, "bfloat16", block_m, 128, 64,
                                        stages, 256, mode))  # fmt: skip


def build_for(name: str) -> TileLangBuild:
    if name in DOWN_VARIANTS:
        return build_down(name)
    mode, block_m, stages, threads = VARIANTS[name]
    return TileLangBuild(gate_up_variant, (EXPERTS, INTER, HIDDEN, "bfloat16", block_m, 128, 64,
                                           stages, threads, mode))  # fmt: skip


def features(kernel) -> dict:
    try:
        source = kernel.get_kernel_source()
    except Exception as e:  # noqa: BLE001 - the source is a diagnostic only
        return {"error": repr(e)}
    return {name: needle in source for name, needle in FEATURES.items()}


def probe(tokens: int, w13: torch.Tensor, w2: torch.Tensor, kernels: dict) -> dict:
    ids, _ = routing(tokens)
    pairs = tokens * TOP_K
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
    flops = 2.0 * pairs * HIDDEN * 2 * INTER
    row = {"tokens": tokens, "variants": {}}
    # torch: the engine's grouped GEMM and its SiLU-and-mul
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    offsets = torch.bincount(flat, minlength=EXPERTS).cumsum(0, dtype=torch.int32)
    rows = x[order // TOP_K]
    ms, _ = time_calls([lambda: torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)])
    row["torch_grouped_mm_ms"] = ms
    row["torch_grouped_mm_tflops"] = flops / ms / 1e9
    hs = torch.randn(pairs, INTER, device="cuda", dtype=BF16)
    ms, _ = time_calls([lambda: torch._grouped_mm(hs, w2.transpose(1, 2), offs=offsets)])
    row["torch_down_grouped_mm_ms"] = ms
    weights = torch.rand(pairs, device="cuda")
    for name, kernel in kernels.items():
        if name not in DOWN_VARIANTS:
            continue
        align = moe.moe_align(ids, EXPERTS, 128)
        h = hs.index_select(0, align.sorted_ids.clamp(max=pairs - 1))
        y = torch.zeros(pairs, HIDDEN, device="cuda", dtype=BF16)
        ys = torch.zeros(align.rows, HIDDEN, device="cuda", dtype=BF16)
        args = (h, w2, align.block_expert, align.sorted_ids, weights, y, ys)
        kernel(*args)
        ref = torch._grouped_mm(hs[order], w2.transpose(1, 2), offs=offsets).float()
        if DOWN_VARIANTS[name][0] == "scatter":
            got = y[order].float() / weights[order, None]
        else:
            valid = align.sorted_ids < pairs
            got = torch.empty_like(ref)
            got[torch.argsort(order)[align.sorted_ids[valid].long()]] = ys[valid].float()
        err = ((got - ref).norm() / ref.norm()).item()
        ms, how = time_calls([lambda args=args, kernel=kernel: kernel(*args)])
        row["variants"][name] = {"ms": ms, "tflops": flops / 2 / ms / 1e9, "rel_err": err,
                                 "timing": how, **features(kernel)}  # fmt: skip
        print(name, row["variants"][name], flush=True)
    for name, kernel in kernels.items():
        if name in DOWN_VARIANTS:
            continue
        _, block_m, _, _ = VARIANTS[name]
        align = moe.moe_align(ids, EXPERTS, block_m)
        xs = x.index_select(0, align.sorted_ids.clamp(max=pairs - 1) // TOP_K)
        out = torch.empty(align.rows, INTER, dtype=BF16, device="cuda")
        used = int((align.block_expert < EXPERTS).sum()) if VARIANTS[name][0] == "const" else None
        args = (xs, w13, align.block_expert, out)
        if used is not None:  # only the blocks that hold rows
            args = (xs[: used * block_m], w13, align.block_expert[:used], out[: used * block_m])
        kernel(*args)
        valid = align.sorted_ids < pairs
        if used is not None:
            valid[used * block_m :] = False
        ref_rows = _reference(xs[valid], w13, align, valid, block_m)
        err = ((out[valid].float() - ref_rows).norm() / ref_rows.norm()).item()
        ms, how = time_calls([lambda args=args, kernel=kernel: kernel(*args)])
        row["variants"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err,
                                 "timing": how, **features(kernel)}  # fmt: skip
        print(name, row["variants"][name], flush=True)
    return row


def _reference(xs, w13, align, valid, block_m):
    """silu(x W_gate^T) * x W_up^T of the valid rows, expert by expert, in float32."""
    experts = align.block_expert.repeat_interleave(block_m)[valid].long()
    out = torch.empty(xs.shape[0], INTER, device="cuda")
    for e in experts.unique().tolist():
        sel = experts == e
        gu = xs[sel].float() @ w13[e].float().T
        out[sel] = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--commit", default="")
    ap.add_argument("--tokens", default="4096,16384")
    args = ap.parse_args()
    cache = KernelCache()
    try:
        with parallel_builds():
            for name in [*VARIANTS, *DOWN_VARIANTS]:
                cache.get(name, build_for)
    except Exception as e:  # noqa: BLE001 - the variants that fail are found again below
        print(f"a parallel build failed: {e!r}"[:300], flush=True)
    kernels = {}
    for name in [*VARIANTS, *DOWN_VARIANTS]:
        try:
            kernels[name] = cache.get(name, build_for)
        except Exception as e:  # noqa: BLE001 - a variant that does not build is a finding
            print(f"{name}: does not build: {e!r}"[:400], flush=True)
    w13, w2 = moe_weights()
    rows = [probe(int(t), w13, w2, kernels) for t in args.tokens.split(",")]
    result = {"commit": args.commit, "machine": machine_info(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_gemm_probe_h200.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{r['tokens']} tokens: torch grouped_mm {r['torch_grouped_mm_ms']:.2f} ms "
              f"({r['torch_grouped_mm_tflops']:.0f} TFLOP/s), down "
              f"{r['torch_down_grouped_mm_ms']:.2f} ms")  # fmt: skip
        for name, v in r["variants"].items():
            feats = " ".join(k for k in FEATURES if v.get(k))
            print(f"  {name:<20} {v['ms']:7.2f} ms {v['tflops']:5.0f} TFLOP/s "
                  f"err {v['rel_err']:.1e}  [{feats}]")  # fmt: skip


if __name__ == "__main__":
    main()
