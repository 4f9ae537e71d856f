"""Where a MoE prefill's time goes: the engine's grouped-GEMM path, stage by stage.

    python -m bench.moe_prefill_parts [--out DIR] [--commit SHA] [--tokens 4096,16384]

On a CUDA machine. DeepSeek-V3's routed experts (256 experts, top-8, hidden 7168, width
2048) under uniform random routing. Times, each over CUDA-graph replays
(``bench.kernel_speed.time_calls``): the whole ``kernels.moe.grouped_mm_moe``; its
stages alone (sorting the pairs with their inverse order, ``moe.sort_pairs``; gathering
their rows, the gate/up grouped GEMM, SiLU, mul and the routing weight in one kernel
(torch's three ops beside it), the down grouped GEMM, gathering the pairs back in order
and summing (beside it the way before: weighting the outputs and writing them back by
index)); one dense GEMM of the same FLOPs as each grouped one (what the matrix units give at that
shape without groups). Floors: the FLOPs at the measured matmul peak, and the experts'
weights (every expert is chosen at these token counts) at the copy ceiling.

Then the two grouped GEMMs alone under what decides their speed (``tiles``): the routing's
spread (uniform random as above, against exactly the mean number of rows for every expert)
and torch's tile choice, which follows the mean rows per expert (64x128 tiles up to 128,
128x256 above: its rows are padded with rows in no group to cross that line). Each is
checked against the unpadded product.

Writes ``moe_prefill_parts_h200.json`` to --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info  # noqa: E402
from bench.kernel_speed import measure_ceilings, time_calls  # noqa: E402
from bench.mla_moe_speed import EXPERTS, HIDDEN, INTER, TOP_K, moe_weights, routing  # noqa: E402
from kernels import moe  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402

BF16 = torch.bfloat16


def stages(x, ids, weights, w13, w2) -> dict:
    """Each stage of ``grouped_mm_moe`` as a call on inputs prepared by the ones before."""
    tokens, top_k = ids.shape
    order, inverse, offsets = moe.sort_pairs(ids, EXPERTS)
    token_of = order // top_k
    rows = x[token_of]
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    w = weights.flatten()[order, None].to(BF16)
    w32 = weights.flatten()[order].float()
    h = silu_and_mul(gate_up, row_scale=w32)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)

    def back():
        per_pair = y.index_select(0, inverse)
        return per_pair.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(BF16)

    def back_by_index_put():  # the path before: weight the outputs, write them back by index
        per_pair = torch.empty_like(y)
        per_pair[order] = y * w
        return per_pair.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(BF16)

    pairs = tokens * top_k
    a_gu = torch.randn(pairs, HIDDEN, device="cuda", dtype=BF16)
    b_gu = torch.randn(HIDDEN, 2 * INTER, device="cuda", dtype=BF16)
    a_d = torch.randn(pairs, INTER, device="cuda", dtype=BF16)
    b_d = torch.randn(INTER, HIDDEN, device="cuda", dtype=BF16)
    return {
        "sort": partial(moe.sort_pairs, ids, EXPERTS),
        "gather": lambda: x[token_of],
        "gate_up_grouped_mm": lambda: torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets),
        "silu_mul_weight": lambda: silu_and_mul(gate_up, row_scale=w32),
        "silu_mul_weight_torch": lambda: torch.nn.functional.silu(gate).mul_(up).mul_(w),
        "down_grouped_mm": lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets),
        "unsort_sum": back,
        "weight_unsort_sum_by_index_put": back_by_index_put,
        "dense_mm_like_gate_up": lambda: a_gu @ b_gu,
        "dense_mm_like_down": lambda: a_d @ b_d,
    }


def balanced_offsets(pairs: int) -> torch.Tensor:
    """Every expert the same number of rows (the mean; the last takes what is left)."""
    per = pairs // EXPERTS
    offsets = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * per
    offsets[-1] = pairs
    return offsets


def wide_tile_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` followed by rows in no group, enough that torch's grouped GEMM takes its
    128x256 tile (it picks by the mean rows per group: above 128)."""
    need = 129 * EXPERTS - rows.shape[0]
    return rows if need <= 0 else torch.cat([rows, rows.new_zeros(need, rows.shape[1])])


def tiles(tokens: int, w13, w2) -> dict:
    """ms of the gate/up and the down grouped GEMM by routing spread and tile choice."""
    pairs = tokens * TOP_K
    ids, _ = routing(tokens)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    routed = counts.cumsum(0, dtype=torch.int32)
    b_gu, b_d = w13.transpose(1, 2), w2.transpose(1, 2)
    a_gu = torch.randn(pairs, HIDDEN, device="cuda", dtype=BF16)
    a_d = torch.randn(pairs, INTER, device="cuda", dtype=BF16)
    out = {"rows_per_expert": {"mean": pairs / EXPERTS, "max": int(counts.max()),
                               "over_128": int((counts > 128).sum())}}  # fmt: skip
    for spread, offs in (("random", routed), ("balanced", balanced_offsets(pairs))):
        for name, a, b in (("gate_up", a_gu, b_gu), ("down", a_d, b_d)):
            ref = torch._grouped_mm(a, b, offs=offs)
            wide = wide_tile_rows(a)
            got = torch._grouped_mm(wide, b, offs=offs)[:pairs]
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            out[f"{name}_{spread}"] = {
                "ms": time_calls([lambda a=a, b=b, o=offs: torch._grouped_mm(a, b, offs=o)])[0],
                "ms_wide_tile": time_calls([lambda w=wide, b=b, o=offs: torch._grouped_mm(
                    w, b, offs=o)])[0],
                "wide_tile_rel_err": err,
            }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--commit", default="")
    ap.add_argument("--tokens", default="2048,4096,8192,16384")
    args = ap.parse_args()
    ceilings = measure_ceilings()
    copy_gbps, peak_tflops = ceilings["copy_GBps"], ceilings["matmul_TFLOPs"]
    w13, w2 = moe_weights()
    weight_bytes = EXPERTS * 3 * HIDDEN * INTER * 2
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
        ids, weights = routing(tokens)
        flops = 2.0 * tokens * TOP_K * 3 * HIDDEN * INTER
        whole, _ = time_calls([partial(moe.grouped_mm_moe, x, ids, weights, w13, w2)])
        parts = {name: time_calls([fn])[0] for name, fn in stages(x, ids, weights, w13, w2).items()}
        gu_flops, d_flops = flops * 2 / 3, flops / 3
        row = {
            "tokens": tokens, "flops": flops, "ms": whole,
            "of_peak": flops / whole / 1e9 / peak_tflops,
            "floor_compute_ms": flops / peak_tflops / 1e9,
            "floor_weights_ms": weight_bytes / copy_gbps / 1e6,
            "parts_ms": parts,
            "tflops": {
                "gate_up_grouped_mm": gu_flops / parts["gate_up_grouped_mm"] / 1e9,
                "down_grouped_mm": d_flops / parts["down_grouped_mm"] / 1e9,
                "dense_mm_like_gate_up": gu_flops / parts["dense_mm_like_gate_up"] / 1e9,
                "dense_mm_like_down": d_flops / parts["dense_mm_like_down"] / 1e9,
            },
        }  # fmt: skip
        row["tiles"] = tiles(tokens, w13, w2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
    result = {"commit": args.commit, "machine": machine_info(), "copy_GBps": copy_gbps,
              "matmul_TFLOPs": peak_tflops, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_prefill_parts_h200.json").write_text(json.dumps(result, indent=1))
    print(f"copy {copy_gbps:.0f} GB/s, matmul {peak_tflops:.0f} TFLOP/s")
    for r in rows:
        print(f"{r['tokens']:>6} tokens: {r['ms']:.2f} ms ({100 * r['of_peak']:.0f}% of peak); "
              f"floors {r['floor_compute_ms']:.2f} compute, "
              f"{r['floor_weights_ms']:.2f} weights")  # fmt: skip
        for name, ms in r["parts_ms"].items():
            tf = r["tflops"].get(name)
            print(f"    {name:<24} {ms:8.3f} ms" + (f"  {tf:5.0f} TFLOP/s" if tf else ""))
        for name, t in r["tiles"].items():
            print(f"    tiles {name:<18} {t}")


if __name__ == "__main__":
    main()
