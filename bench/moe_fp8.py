"""The MoE prefill with FP8 expert weights, against the bf16 path, in one run.

    python -m bench.moe_fp8 [--out DIR] [--commit SHA] [--tokens 4096,16384]

On an H100/H200 (``torch._scaled_grouped_mm``, FP8 e4m3 with row-wise scales). DeepSeek-V3's
routed experts (256 experts, top-8, hidden 7168, width 2048) under uniform random routing,
as ``bench.moe_prefill_parts``. The weights are quantized per output channel (one float32
scale per row of each expert's gate/up and down matrices), the activations per row as they
enter each grouped product; the routing weight is applied in SiLU-and-mul, before the
down product's quantization, as in ``kernels.moe.grouped_mm_moe``.

For each token count: the bf16 path's ms (``grouped_mm_moe``), the FP8 path's (with and
without fast accumulation), its stages alone, each one's error against the float32
reference (relative Frobenius norm), and the FLOPs as a share of the bf16 matmul peak
measured in the same run. Writes ``moe_fp8_h200.json`` to --out; a table last.
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

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] as FP8 with one float32 scale per row: ``x ~ q * scale``."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale.squeeze(-1)


def fp8_moe(hidden, topk_ids, topk_weights, w13q, w13s, w2q, w2s, fast: bool):
    """``grouped_mm_moe`` with FP8 products: the same sort, gather and sum."""
    tokens, top_k = topk_ids.shape
    order, inverse, offsets = moe.sort_pairs(topk_ids, w13q.shape[0])
    xq, xs = quantize_rows(hidden)
    token_of = order // top_k
    gate_up = torch._scaled_grouped_mm(
        xq[token_of], w13q.transpose(1, 2), xs[token_of], w13s, offs=offsets,
        out_dtype=BF16, use_fast_accum=fast,
    )  # fmt: skip
    h = silu_and_mul(gate_up, row_scale=topk_weights.flatten()[order].float())
    hq, hs = quantize_rows(h)
    y = torch._scaled_grouped_mm(
        hq, w2q.transpose(1, 2), hs, w2s, offs=offsets, out_dtype=BF16, use_fast_accum=fast
    )
    per_pair = y.index_select(0, inverse)
    return per_pair.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tokens", default="4096,16384")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    peak = ceilings["matmul_TFLOPs"]
    w13, w2 = moe_weights()
    w13q, w13s = quantize_rows(w13)
    w2q, w2s = quantize_rows(w2)
    result = {"commit": args.commit, "machine": machine_info(), **ceilings, "rows": []}
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
        ids, weights = routing(tokens)
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        ref = moe.fused_moe_ref(x, ids, weights, w13, w2)
        bf16 = partial(moe.grouped_mm_moe, x, ids, weights, w13, w2)
        row = {"tokens": tokens, "flops": flops, "ms": {}, "err": {"bf16": rel_err(bf16(), ref)}}
        row["ms"]["bf16"], _ = time_calls([bf16])
        for fast in (False, True):
            name = "fp8_fast_accum" if fast else "fp8"
            call = partial(fp8_moe, x, ids, weights, w13q, w13s, w2q, w2s, fast)
            row["err"][name] = rel_err(call(), ref)
            row["ms"][name], _ = time_calls([call])
        # stages alone, on inputs the stages before made
        xq, xs = quantize_rows(x)
        order, _, offsets = moe.sort_pairs(ids, EXPERTS)
        token_of = order // TOP_K
        rows_q, rows_s = xq[token_of], xs[token_of]
        gate_up = torch._scaled_grouped_mm(rows_q, w13q.transpose(1, 2), rows_s, w13s,
                                           offs=offsets, out_dtype=BF16)  # fmt: skip
        h = silu_and_mul(gate_up, row_scale=weights.flatten()[order].float())
        hq, hs = quantize_rows(h)
        stages = {
            "quantize_x": partial(quantize_rows, x),
            "gate_up_fp8": partial(torch._scaled_grouped_mm, rows_q, w13q.transpose(1, 2),
                                   rows_s, w13s, offs=offsets, out_dtype=BF16),
            "quantize_h": partial(quantize_rows, h),
            "down_fp8": partial(torch._scaled_grouped_mm, hq, w2q.transpose(1, 2), hs, w2s,
                                offs=offsets, out_dtype=BF16),
        }  # fmt: skip
        row["parts_ms"] = {name: time_calls([call])[0] for name, call in stages.items()}
        row["of_bf16_peak"] = {k: flops / (ms * 1e9) / peak for k, ms in row["ms"].items()}
        row["weights_floor_ms"] = {
            "bf16": 2 * EXPERTS * 3 * HIDDEN * INTER / ceilings["copy_GBps"] / 1e6,
            "fp8": EXPERTS * 3 * HIDDEN * INTER / ceilings["copy_GBps"] / 1e6,
        }
        result["rows"].append(row)
        del x, ref, gate_up, h, hq, rows_q
        torch.cuda.empty_cache()
    out = Path(args.out) / "moe_fp8_h200.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    for row in result["rows"]:
        print(f"{row['tokens']} tokens: " + ", ".join(
            f"{k} {ms:.2f} ms ({row['of_bf16_peak'][k]:.0%} of bf16 peak, err "
            f"{row['err'][k]:.4f})" for k, ms in row["ms"].items()))  # fmt: skip
        print("   parts: " + ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms"].items()))


if __name__ == "__main__":
    main()
