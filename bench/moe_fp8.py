"""The MoE layer with FP8 expert weights against the bf16 path, decode and prefill, in one run.

    python -m bench.moe_fp8 [--out DIR] [--commit SHA] [--tokens 1,64,256,4096,16384]

On an H100/H200. DeepSeek-V3's routed experts (256 experts, top-8, hidden 7168, width 2048)
under uniform random routing, as ``bench.mla_moe_speed``. Arms, each the engine's own
function:

- ``bf16``: ``kernels.moe.moe_experts_cuda`` (the TileLang grouped GEMM at decode sizes,
  torch's ``_grouped_mm`` for prefills);
- ``fp8``: ``kernels.moe.fp8_grouped_moe``, what ``--quantization fp8`` runs (experts as
  e4m3 rows with a scale per output channel, the tokens and SiLU-and-mul's output
  quantized per row by TileLang kernels, ``torch._scaled_grouped_mm`` with fast
  accumulation);
- ``fp8_torch_quant`` (prefills): the same products with both quantizations in torch ops,
  the previous version of the FP8 path.

For each token count: ms, the relative error (Frobenius) against the float32 layer on the
unquantized weights; for prefills the FLOPs as a share of the bf16 matmul peak, and the
FP8 path's stages alone; for decode the chosen experts' weight bytes (each arm its own
format) as a share of the copy rate. Ceilings measured in the same run. Writes
``moe_fp8_h200.json`` to --out; a table last.
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
from kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from kernels.fp8 import quantize_rows, quantize_rows_ref  # noqa: E402

BF16 = torch.bfloat16
PREFILL_FROM = 1024  # tokens: a prefill (FLOP-bound) from here, a decode batch below


def fp8_torch_quant(hidden, topk_ids, topk_weights, w13q, w13s, w2q, w2s):
    """``fp8_grouped_moe`` with both quantizations in torch ops (and SiLU-and-mul rounded
    to bf16 between): the FP8 path as first measured."""
    top_k = topk_ids.shape[1]
    order, inverse, offsets = moe.sort_pairs(topk_ids, w13q.shape[0])
    xq, xs = quantize_rows_ref(hidden)
    token_of = order // top_k
    gate_up = torch._scaled_grouped_mm(
        xq[token_of], w13q.transpose(1, 2), xs[token_of], w13s, offs=offsets,
        out_dtype=BF16, use_fast_accum=True,
    )  # fmt: skip
    hq, hs = quantize_rows_ref(silu_and_mul(gate_up, row_scale=topk_weights.flatten()[order]))
    y = torch._scaled_grouped_mm(hq, w2q.transpose(1, 2), hs, w2s, offs=offsets,
                                 out_dtype=BF16, use_fast_accum=True)  # fmt: skip
    return moe.sum_pairs(y, inverse, top_k, hidden.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def stages(x, ids, weights, fp8) -> dict:
    """The FP8 path's stages alone at this size, each on what the stages before made."""
    w13q, w13s, w2q, w2s = fp8
    xq, xs = quantize_rows(x)
    order, _, offsets = moe.sort_pairs(ids, EXPERTS)
    token_of = order // TOP_K
    rows_q, rows_s = xq[token_of], xs[token_of]
    gate_up = torch._scaled_grouped_mm(rows_q, w13q.transpose(1, 2), rows_s, w13s,
                                       offs=offsets, out_dtype=BF16, use_fast_accum=True)
    routing_weights = weights.flatten()[order].float()
    hq, hs = silu_and_mul_fp8(gate_up, routing_weights)
    calls = {
        "quantize_x": partial(quantize_rows, x),
        "quantize_x_torch": partial(quantize_rows_ref, x),
        "sort_and_gather": lambda: moe.sort_pairs(ids, EXPERTS)[0],
        "gate_up": partial(torch._scaled_grouped_mm, rows_q, w13q.transpose(1, 2), rows_s,
                           w13s, offs=offsets, out_dtype=BF16, use_fast_accum=True),
        "silu_and_mul_fp8": partial(silu_and_mul_fp8, gate_up, routing_weights),
        "silu_and_mul_then_torch_quant": lambda: quantize_rows_ref(
            silu_and_mul(gate_up, row_scale=routing_weights)),
        "down": partial(torch._scaled_grouped_mm, hq, w2q.transpose(1, 2), hs, w2s,
                        offs=offsets, out_dtype=BF16, use_fast_accum=True),
    }  # fmt: skip
    return {name: time_calls([call])[0] for name, call in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tokens", default="1,64,256,4096,16384")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    peak, copy = ceilings["matmul_TFLOPs"], ceilings["copy_GBps"]
    w13, w2 = moe_weights()
    fp8 = (*quantize_rows_ref(w13), *quantize_rows_ref(w2))
    expert_bytes = {"bf16": 3 * HIDDEN * INTER * 2,
                    "fp8": 3 * HIDDEN * INTER + 4 * (2 * INTER + HIDDEN)}  # fmt: skip
    result = {"commit": args.commit, "machine": machine_info(), **ceilings, "rows": []}
    for tokens in map(int, args.tokens.split(",")):
        prefill = tokens >= PREFILL_FROM
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
        ids, weights = routing(tokens)
        check = slice(0, min(tokens, 512))
        ref = moe.fused_moe_ref(x[check], ids[check], weights[check], w13, w2)
        arms = {
            "bf16": partial(moe.moe_experts_cuda, x, ids, weights, w13, w2),
            "fp8": partial(moe.fp8_grouped_moe, x, ids, weights, *fp8),
        }
        if prefill:
            arms["fp8_torch_quant"] = partial(fp8_torch_quant, x, ids, weights, *fp8)
        row: dict = {"tokens": tokens, "ms": {}, "err": {}}
        for name, call in arms.items():
            row["err"][name] = rel_err(call()[check], ref)
            row["ms"][name], row.setdefault("timed", {})[name] = time_calls([call])
        if prefill:
            flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
            row["of_bf16_peak"] = {k: flops / (ms * 1e9) / peak for k, ms in row["ms"].items()}
            row["fp8_stages_ms"] = stages(x, ids, weights, fp8)
        else:
            touched = int(ids.unique().numel())
            row["experts_touched"] = touched
            row["of_copy_rate"] = {
                k: touched * expert_bytes[k[:4] if k.startswith("fp8") else "bf16"]
                / (ms * 1e6) / copy for k, ms in row["ms"].items()
            }  # fmt: skip
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del x, ref
        torch.cuda.empty_cache()
    out = Path(args.out) / "moe_fp8_h200.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"copy {copy:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    for row in result["rows"]:
        share = row.get("of_bf16_peak") or row["of_copy_rate"]
        what = "of bf16 peak" if "of_bf16_peak" in row else "of copy rate"
        print(f"{row['tokens']} tokens: " + ", ".join(
            f"{k} {ms:.3f} ms ({share[k]:.0%} {what}, err {row['err'][k]:.4f})"
            for k, ms in row["ms"].items()))  # fmt: skip
        if "fp8_stages_ms" in row:
            parts = row["fp8_stages_ms"].items()
            print("   stages: " + ", ".join(f"{k} {v:.2f}" for k, v in parts))


if __name__ == "__main__":
    main()
