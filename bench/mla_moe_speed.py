"""MLA decode and MoE expert kernels at DeepSeek-V3 width: checked, then timed beside torch.

    python -m bench.mla_moe_speed [--out DIR] [--commit SHA] [--sections mla,moe,router]

On a CUDA machine with TileLang. Shapes are DeepSeek-V3's on one GPU: 128 heads over a
576-value latent (kv_lora_rank 512 + rope 64) in 128-token blocks; 256 experts, top-8,
hidden 7168, expert width 2048. Every kernel is first compared with its torch reference
on fresh random inputs, then timed with CUDA events over CUDA-graph replays
(``bench.kernel_speed.time_calls``), median of many.

- ``mla``: batch 1/16/64/128 × context 1k/8k/32k. GB/s counts the latent KV read once
  (plus q and the output) against the measured copy ceiling; small batches also time
  forced split counts. torch's baselines: the absorbed attention as two batched matmuls
  over a dense [B, L, 576] cache (what a static cache in torch does), and the engine's
  torch MLA path (``TorchMLABackend.attend_latents``) where it fits.
- ``moe``: the routed experts at decode (1/64/256 tokens, uniform random routing) against
  the HBM roofline of the chosen experts' weights, and prefill (4k/16k tokens) against the
  bf16 matmul peak; beside ``torch._grouped_mm`` (sorted tokens, one grouped product per
  projection), the engine's per-expert loop and, at decode, the every-expert product that
  CUDA graphs ran before the kernel.
- ``router``: DeepSeek-V3's router (sigmoid, bias, grouped top-k) at the same token counts,
  to see whether it shows beside the experts.

Writes ``mla_moe_h200.json`` (with ``machine_info()``) to --out; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info  # noqa: E402
from bench.kernel_speed import compile_all, copies_for, measure_ceilings, rel_err, time_calls  # noqa: E402
from kernels import mla_decode as mla  # noqa: E402
from kernels import moe  # noqa: E402

BF16 = torch.bfloat16
HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 128
WIDTH = RANK + ROPE
SCALE = (RANK // 4 + ROPE) ** -0.5  # DeepSeek-V3's (nope 128 + rope 64) ** -0.5
MLA_POINTS = [(b, c) for c in (1024, 8192, 32768) for b in (1, 16, 64, 128)]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 7168, 2048
MOE_DECODE = (1, 64, 256)
MOE_PREFILL = (4096, 16384)
SECTIONS = ("mla", "moe", "router")


# --- MLA decode ----------------------------------------------------------------------------


def mla_inputs(batch: int, ctx: int) -> dict:
    per_seq = ctx // BLOCK
    num_blocks = 1 + batch * per_seq
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, per_seq).int()
    return {
        "q": torch.randn(batch, HEADS, WIDTH, device="cuda", dtype=BF16),
        "cache": torch.randn(num_blocks, BLOCK, WIDTH, device="cuda", dtype=BF16),
        "tables": tables.contiguous(),
        "lens": torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
    }


def mla_bytes(batch: int, ctx: int) -> int:
    return 2 * (batch * ctx * WIDTH + batch * HEADS * (WIDTH + RANK))


def mla_flops(batch: int, ctx: int) -> int:
    return 2 * batch * HEADS * ctx * (WIDTH + RANK)  # scores over R + P, output over R


def _run_mla(x: dict, ctx: int, splits: int | None = None) -> torch.Tensor:
    return mla.mla_decode(
        x["q"], x["cache"], x["tables"], x["lens"], kv_lora_rank=RANK, scale=SCALE,
        max_seq_len=ctx, num_splits=splits,
    )  # fmt: skip


def _torch_mla_calls(inputs: list[dict], ctx: int) -> dict[str, list[Callable]]:
    """Absorbed attention in torch over a dense cache, and the engine's torch MLA path."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_mla import TorchMLABackend
    from engine.config import MLAConfig
    from kvstore.layout import KVCache, KVCacheLayout

    dense, engine = [], []
    for x in inputs:
        batch = x["q"].shape[0]
        kv = x["cache"][x["tables"].long()].flatten(1, 2).contiguous()  # [B, L, 576]

        def absorbed(q=x["q"], kv=kv):
            scores = torch.bmm(q, kv.transpose(1, 2)) * SCALE  # [B, H, L]
            return torch.bmm(scores.softmax(dim=-1), kv[..., :RANK])

        dense.append(absorbed)
        if batch * ctx <= 16 * 8192:  # its padded gather and SDPA's expansion fit
            cfg = MLAConfig(kv_lora_rank=RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE,
                            v_head_dim=128)  # fmt: skip
            layout = KVCacheLayout.for_mla(1, RANK, ROPE, BLOCK, BF16)
            kvc = KVCache(layout, 1, "cuda")
            kvc.layers[0] = x["cache"]
            backend = TorchMLABackend(kvc, HEADS, cfg, SCALE)
            meta = AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                seq_lens=x["lens"], block_tables=x["tables"],
                slot_mapping=torch.zeros(batch, device="cuda", dtype=torch.int64),
                max_query_len=1, max_seq_len=ctx, query_lens_cpu=[1] * batch,
                seq_lens_cpu=[ctx] * batch,
            )  # fmt: skip
            engine.append(partial(backend.attend_latents, x["cache"], x["q"], meta))
    calls = {"torch_absorbed_dense": dense}
    if engine:
        calls["torch_engine_mla"] = engine
    return calls


def _timed(calls: list[Callable], nbytes: float, key: str) -> dict:
    try:
        ms, how = time_calls(calls)
    except Exception as err:  # noqa: BLE001 - record, e.g. out of memory
        torch.cuda.empty_cache()
        return {"error": repr(err)[:300]}
    return {"ms": ms, key: nbytes / ms / 1e6 if key == "GBps" else nbytes / ms / 1e9,
            "timing": how}  # fmt: skip


def bench_mla() -> list[dict]:
    rows = []
    for batch, ctx in MLA_POINTS:
        nbytes = mla_bytes(batch, ctx)
        inputs = [mla_inputs(batch, ctx) for _ in range(copies_for(nbytes))]
        x = inputs[0]
        n = min(batch, 4)
        ref = mla.mla_decode_ref(
            x["q"][:n], x["cache"], x["tables"][:n], x["lens"][:n], kv_lora_rank=RANK,
            scale=SCALE,
        )  # fmt: skip
        auto = mla.choose_num_splits(batch, HEADS, ctx)
        row = {"batch": batch, "context": ctx, "bytes": nbytes, "auto_splits": auto,
               "variants": {}}  # fmt: skip
        runs = {"auto": None}
        if batch <= 16:
            runs.update({f"splits{s}": s for s in SPLITS if s <= ctx // 64 and s != auto})
        for name, splits in runs.items():
            err = rel_err(_run_mla(x, ctx, splits)[:n], ref)
            timed = _timed([partial(_run_mla, x, ctx, splits) for x in inputs], nbytes, "GBps")
            if "ms" in timed:
                timed["TFLOPs"] = mla_flops(batch, ctx) / timed["ms"] / 1e9
            row["variants"][name] = {"rel_err": err, **timed}
        try:
            calls = _torch_mla_calls(inputs, ctx)
            row["torch"] = {k: _timed(v, nbytes, "GBps") for k, v in calls.items()}
            del calls
        except Exception as err:  # noqa: BLE001
            row["torch"] = {"error": repr(err)[:300]}
        rows.append(row)
        print(f"mla b{batch} ctx{ctx}: {row['variants']['auto']}", flush=True)
        del inputs, x
        torch.cuda.empty_cache()
    return rows


# --- MoE -----------------------------------------------------------------------------------


def moe_weights() -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=BF16) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=BF16) / INTER**0.5
    return w13, w2


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k (every expert equally likely), weights summing to 2.5."""
    ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, device="cuda")
    return ids, weights / weights.sum(-1, keepdim=True) * 2.5


def _moe_variants(tokens: int, decode: bool) -> dict[str, Callable]:
    from engine.models.moe import moe_experts_dense, moe_experts_sorted

    variants: dict[str, Callable] = {"kernel": moe.fused_moe, "engine": moe.moe_experts_cuda}
    for bm in (16, 64, 128):
        if bm != moe.block_m_for(tokens * TOP_K, EXPERTS) and (decode or bm >= 64):
            variants[f"kernel_bm{bm}"] = partial(moe.fused_moe, block_m=bm)
    variants["torch_grouped_mm"] = moe.grouped_mm_moe
    variants["torch_sorted_loop"] = moe_experts_sorted
    if decode:
        variants["torch_every_expert"] = moe_experts_dense
    return variants


def bench_moe(decode_tokens=MOE_DECODE, prefill_tokens=MOE_PREFILL) -> dict:
    w13, w2 = moe_weights()
    expert_bytes = 3 * HIDDEN * INTER * 2
    out = {"decode": [], "prefill": []}
    for tokens in (*decode_tokens, *prefill_tokens):
        decode = tokens in decode_tokens
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=BF16)
        ids, weights = routing(tokens)
        touched = int(ids.unique().numel())
        nbytes = touched * expert_bytes + 2 * 2 * tokens * HIDDEN
        flops = 2.0 * tokens * TOP_K * 3 * HIDDEN * INTER
        check = slice(0, min(tokens, 512))
        ref = moe.fused_moe_ref(x[check], ids[check], weights[check], w13, w2)
        row = {"tokens": tokens, "experts_touched": touched, "bytes": nbytes, "flops": flops,
               "block_m": moe.block_m_for(tokens * TOP_K, EXPERTS), "variants": {}}  # fmt: skip
        for name, fn in _moe_variants(tokens, decode).items():
            call = partial(fn, x, ids, weights, w13, w2)
            try:
                err = rel_err(call()[check], ref)
            except Exception as exc:  # noqa: BLE001 - e.g. a torch op this build lacks
                row["variants"][name] = {"error": repr(exc)[:300]}
                continue
            timed = _timed([call], nbytes if decode else flops, "GBps" if decode else "TFLOPs")
            row["variants"][name] = {"rel_err": err, **timed}
        out["decode" if decode else "prefill"].append(row)
        print(f"moe {tokens} tokens: {row['variants']['kernel']}", flush=True)
        del x
        torch.cuda.empty_cache()
    return out


def bench_router(decode_tokens=MOE_DECODE, prefill_tokens=MOE_PREFILL) -> list[dict]:
    from engine.loader.dummy import dummy_config
    from engine.models.moe import Router

    cfg = dummy_config("deepseek-v3")
    router = Router(cfg.hidden_size, cfg.moe).cuda()
    with torch.no_grad():
        router.weight.normal_(0, cfg.hidden_size**-0.5)
        router.e_score_correction_bias.normal_(0, 0.01)
    rows = []
    for tokens in (*decode_tokens, *prefill_tokens):
        x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=BF16)
        with torch.inference_mode():
            ms, how = time_calls([partial(router, x)])
        rows.append({"tokens": tokens, "ms": ms, "timing": how})
    return rows


# --- report --------------------------------------------------------------------------------


def _cell(v: dict, key: str, width: int = 7) -> str:
    return f"{v[key]:{width}.0f}" if key in v else f"{'err':>{width}}"


def table(result: dict) -> str:
    ceil = result["ceilings"]
    bw, peak = ceil["copy_GBps"], ceil["matmul_TFLOPs"]
    lines = [f"ceilings: copy {bw:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s"]
    lines.append("mla decode H128 576/512 bs128   B    ctx  splits     us    GB/s  %copy  err"
                 "      best         us  torch-dense-us  x    TFLOP/s")  # fmt: skip
    for r in result.get("mla", []):
        v = r["variants"]["auto"]
        ok = {k: x for k, x in r["variants"].items() if "GBps" in x and x["rel_err"] <= 1e-2}
        best = max(ok, key=lambda k: ok[k]["GBps"]) if ok else "auto"
        td = r.get("torch", {}).get("torch_absorbed_dense", {})
        ratio = f"{td['ms'] / v['ms']:5.2f}" if "ms" in td and "ms" in v else "    -"
        lines.append(
            f"  {r['batch']:>30} {r['context']:>6} {r['auto_splits']:>6} "
            f"{v.get('ms', math.nan) * 1e3:6.1f} {_cell(v, 'GBps')} "
            f"{100 * v.get('GBps', math.nan) / bw:5.1f}%  {v.get('rel_err', math.nan):.1e}  "
            f"{best:<10} {r['variants'][best].get('ms', math.nan) * 1e3:6.1f} "
            f"{td.get('ms', math.nan) * 1e3:15.1f} {ratio} "
            f"{v.get('TFLOPs', math.nan):8.0f}"
        )
    moe_rows = result.get("moe", {})
    names = ["kernel", "engine", "torch_grouped_mm", "torch_sorted_loop", "torch_every_expert"]
    lines.append("moe decode  tokens experts  floor-us   " + "  ".join(f"{n:>18}" for n in names))
    for r in moe_rows.get("decode", []):
        cells = []
        for name in names:
            v = r["variants"].get(name, {})
            cells.append(f"{v['ms'] * 1e3:9.0f}us {100 * v['GBps'] / bw:4.0f}%" if "ms" in v
                         else f"{'-':>18}")  # fmt: skip
        floor = r["bytes"] / bw / 1e3
        lines.append(f"  {r['tokens']:>14} {r['experts_touched']:>7} {floor:9.0f}   "
                     + "  ".join(cells))  # fmt: skip
    lines.append("moe prefill tokens        floor-ms   " + "  ".join(f"{n:>18}" for n in names[:4]))
    for r in moe_rows.get("prefill", []):
        cells = []
        for name in names[:4]:
            v = r["variants"].get(name, {})
            cells.append(f"{v['ms']:8.2f}ms {100 * v['TFLOPs'] / peak:4.0f}%" if "ms" in v
                         else f"{'-':>18}")  # fmt: skip
        floor = r["flops"] / peak / 1e9
        lines.append(f"  {r['tokens']:>14} {'':>7} {floor:9.2f}   " + "  ".join(cells))
    for r in result.get("router", []):
        lines.append(f"router {r['tokens']:>6} tokens: {r['ms'] * 1e3:.1f} us")
    return "\n".join(lines)


def builds() -> list:
    """Every kernel config the sections use (compiled ahead, in parallel)."""
    base = mla.default_config(HEADS, RANK, ROPE, BLOCK, BF16, SCALE)
    from dataclasses import replace

    cfgs: list = [replace(base, combine=flag) for flag in (True, False)]
    for bm in (16, 64, 128):
        cfgs += moe.kernel_configs(EXPERTS, HIDDEN, INTER, BF16, bm)
    return cfgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument(
        "--moe-decode-tokens",
        default=",".join(map(str, MOE_DECODE)),
        help="token counts timed against the weights' floor (the MoE section)",
    )
    parser.add_argument(
        "--moe-prefill-tokens",
        default=",".join(map(str, MOE_PREFILL)),
        help="token counts timed against the matmul peak ('' for none)",
    )
    args = parser.parse_args()
    tokens = [[int(t) for t in arg.split(",") if t]
              for arg in (args.moe_decode_tokens, args.moe_prefill_tokens)]  # fmt: skip
    sections = args.sections.split(",")
    result = machine_info()
    if args.commit:
        result["commit"] = args.commit
    result["compile"] = compile_all(builds(), args.jobs)
    result["ceilings"] = measure_ceilings()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mla_moe_h200.json"
    for section, fn in [("mla", bench_mla), ("moe", partial(bench_moe, *tokens)),
                        ("router", partial(bench_router, *tokens))]:  # fmt: skip
        if section not in sections:
            continue
        try:
            result[section] = fn()
        except Exception:  # noqa: BLE001 - keep the other sections
            result.setdefault("errors", {})[section] = traceback.format_exc()[-3000:]
            print(result["errors"][section], flush=True)
        path.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    print(table(result))


if __name__ == "__main__":
    main()
