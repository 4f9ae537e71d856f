"""The TileLang gate/up kernel of ``kernels.moe`` against torch's grouped GEMM on a prefill's
routing, in variants.

    python -m bench.moe_gemm_probe [--out DIR] [--tokens 4096,16384]

On a CUDA machine, DeepSeek-V3's routed experts (``bench.mla_moe_speed``'s shapes and
uniform random routing). The variants differ in how a CTA learns its loop's length:
``dynamic`` (the engine's: zero steps past the last expert's blocks, a trip count TileLang
only knows at run time) or ``const`` (``fixed_steps``: the whole loop, launched on exactly
the blocks that hold rows); and in rows per block and stages. Each is checked against
torch (the valid rows of ``silu(x W_gate^T) * x W_up^T``), timed over CUDA-graph replays,
and its generated source searched for the Hopper features it uses (TMA loads, warpgroup
MMA, warp-specialised producer/consumer). torch's two grouped products are timed beside
them. (At 60c79c7 the probe also built the gate/up loop inside ``if expert < E``, which
TileLang does not build once warp-specialised, and the down kernel with the epilogue it
had then, scattering each row to its pair: 21.3 ms at 4k tokens against 4.6-4.8 written
in place; ``bench/results/moe_gemm_probe_h200.json``.)

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
FEATURES = {
    "tma": "tma_load",
    "wgmma": "wgmma",
    "warp_specialised": "warpgroup_reg_",
    "mbarrier": "barrier",
}


def build_for(name: str) -> TileLangBuild:
    mode, block_m, stages, threads = VARIANTS[name]
    args = (EXPERTS, INTER, HIDDEN, "bfloat16", block_m, 128, 64, stages, threads)
    return TileLangBuild(moe._gate_up_program, (*args, mode == "const"))


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
    # torch: its two grouped products (gate/up, down)
    order, _, offsets = moe.sort_pairs(ids, EXPERTS)
    rows = x[order // TOP_K]
    ms, _ = time_calls([lambda: torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)])
    row["torch_grouped_mm_ms"] = ms
    row["torch_grouped_mm_tflops"] = flops / ms / 1e9
    hs = torch.randn(pairs, INTER, device="cuda", dtype=BF16)
    ms, _ = time_calls([lambda: torch._grouped_mm(hs, w2.transpose(1, 2), offs=offsets)])
    row["torch_down_grouped_mm_ms"] = ms
    for name, kernel in kernels.items():
        mode, block_m, _, _ = VARIANTS[name]
        align = moe.moe_align(ids, EXPERTS, block_m)
        xs = x.index_select(0, align.sorted_ids.clamp(max=pairs - 1) // TOP_K)
        out = torch.empty(align.rows, INTER, dtype=BF16, device="cuda")
        blocks = align.block_expert.numel()
        if mode == "const":  # only the blocks that hold rows
            blocks = int((align.block_expert < EXPERTS).sum())
        n = blocks * block_m
        args = (xs[:n], w13, align.block_expert[:blocks], out[:n])
        kernel(*args)
        valid = align.sorted_ids < pairs
        valid[n:] = False
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
            for name in VARIANTS:
                cache.get(name, build_for)
    except Exception as e:  # noqa: BLE001 - the variants that fail are found again below
        print(f"a parallel build failed: {e!r}"[:300], flush=True)
    kernels = {}
    for name in VARIANTS:
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
