"""Compile, in parallel, the TileLang kernels a GPU run will need, into TileLang's disk cache.

    python -m bench.precompile [--jobs N] [--presets deepseek-v3-4l,...] [--list]

Works on a machine without a GPU that has nvcc (set ``TILELANG_DEFAULT_TARGET`` to the
GPU's, e.g. ``{"kind":"cuda","arch":"sm_90a"}``, here and there: the target is part of the
cache key); the GPU run then loads instead of compiling, one kernel after another in
each test process (kernels/NOTES.md, "How to rerun"). The configs come from the models
themselves (built on the meta device, no weights): for every skinny projection the GEMV
at 1-4 rows, every RMSNorm, every SiLU-and-mul, the GQA attention kernels at the test
block size, and the MLA decode and grouped-GEMM MoE kernels the shapes take; plus the
fixed shapes of the MLA/MoE and FP8 kernel tests, ``bench.mla_moe_speed`` and
``bench.moe_fp8``.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BF16 = torch.bfloat16
PRESETS = "deepseek-v3-4l,deepseek-v3-tiny,qwen3-moe-tiny"
GQA_BLOCK = 16  # the engine CUDA tests' block size (tests/engine/test_cuda_graphs.py)
MLA_BLOCK = 128  # what ferry serve uses on CUDA, and the MLA kernel tests
GRAPH_BATCHES = (1, 2, 3, 4, 8, 16)


def model_configs(config) -> set:
    """The kernel configs a model of ``config`` compiles on CUDA in bf16."""
    from engine.models import build_model
    from engine.models.llama import Linear, LlamaMLP, RMSNorm
    from engine.models.moe import Experts
    from kernels import mla_decode, moe
    from kernels import paged_decode_attention as dec
    from kernels import prefill_attention as pre
    from kernels.activation import SiluMulConfig
    from kernels.gemv import MAX_ROWS, ROWS, VEC, GemvConfig
    from kernels.norm_rope_cache import CacheWriteConfig, NormConfig, RopeConfig, norm_supported

    model = build_model(config, "meta", BF16)
    out: set = set()
    for name, mod in model.named_modules():
        if name.startswith("mtp") or name.endswith("kv_b_proj"):  # never run as a Linear
            continue
        if isinstance(mod, Linear) and mod.bias is None:
            n, k = mod.weight.shape
            if k % VEC == 0 and n % ROWS == 0:
                out |= {GemvConfig(m, n, k, "bfloat16") for m in range(1, MAX_ROWS + 1)}
        elif isinstance(mod, RMSNorm) and norm_supported(mod.weight.shape[0]):  # else torch's
            out |= {NormConfig(mod.weight.shape[0], "bfloat16", mod.eps, r) for r in (True, False)}
        elif isinstance(mod, LlamaMLP):
            out.add(SiluMulConfig(mod.gate_up_proj.weight.shape[0] // 2, "bfloat16"))
        elif isinstance(mod, Experts):
            experts, two_inter, hidden = mod.w13.shape
            for block_m in (16, 64, 128):
                out |= set(moe.kernel_configs(experts, hidden, two_inter // 2, BF16, block_m))
            out |= fp8_configs(hidden, two_inter // 2)  # --quantization fp8
    scale = model.attention_scale
    if config.mla is not None:
        mla = config.mla
        if mla.kv_lora_rank % 64 == 0 and mla.qk_rope_head_dim % 16 == 0:  # else torch's
            base = mla_decode.default_config(
                config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, MLA_BLOCK, BF16, scale
            )
            out |= {replace(base, combine=flag) for flag in (True, False)}
        return out
    h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    out |= {RopeConfig(h, kv, d, "bfloat16"), CacheWriteConfig(kv, d, GQA_BLOCK, "bfloat16")}
    for batch in GRAPH_BATCHES:
        cfg = dec.default_config(h, kv, d, GQA_BLOCK, BF16, scale, batch)
        out |= {replace(cfg, combine=flag) for flag in (True, False)}
    out.add(pre.default_config(h, kv, d, GQA_BLOCK, BF16, scale))
    return out


def fp8_configs(hidden: int, inter: int) -> set:
    """The kernels of ``kernels.moe.fp8_grouped_moe`` at these widths."""
    from kernels.activation import SiluMulConfig
    from kernels.fp8 import QuantizeRowsConfig

    return {QuantizeRowsConfig(hidden, "bfloat16"), SiluMulConfig(inter, "bfloat16", True, True)}


def test_and_bench_configs() -> set:
    """The fixed shapes of tests/kernels/test_mla_moe_cuda.py, tests/engine's kernel-wide
    DeepSeek model and bench/mla_moe_speed.py."""
    from bench.mla_moe_speed import builds
    from kernels import mla_decode, moe

    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from test_cuda_mla_moe_kernels import KERNEL_WIDE

    out = set(builds()) | model_configs(KERNEL_WIDE)
    for heads, rank, rope, block in [(128, 512, 64, 128), (16, 512, 64, 64), (100, 256, 64, 128)]:
        cfg = mla_decode.default_config(heads, rank, rope, block, BF16, (rank // 4 + rope) ** -0.5)
        out |= {replace(cfg, combine=flag) for flag in (True, False)}
    for experts, hidden, inter in [(256, 7168, 2048), (128, 2048, 768), (16, 64, 32)]:
        for block_m in (16, 64, 128):
            out |= set(moe.kernel_configs(experts, hidden, inter, BF16, block_m))
        out |= fp8_configs(hidden, inter)  # tests/kernels/test_fp8_cuda.py, bench/moe_fp8.py
    return out


def build(cfg) -> str:
    from bench.kernel_speed import _build

    try:
        return f"ok {_build(cfg):.0f}s {cfg}"
    except Exception:  # noqa: BLE001 - report, compile the others
        return f"FAILED {cfg}\n{traceback.format_exc()[-2000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--list", action="store_true", help="print the configs, compile none")
    args = parser.parse_args()
    from engine.loader.dummy import dummy_config

    configs = test_and_bench_configs()
    for preset in filter(None, args.presets.split(",")):
        configs |= model_configs(dummy_config(preset))
    todo = sorted(configs, key=repr)
    print(f"{len(todo)} kernel configs", flush=True)
    if args.list:
        print("\n".join(map(repr, todo)))
        return
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(build, todo))
    failed = [r for r in results if r.startswith("FAILED")]
    print("\n".join(failed))
    print(f"{len(todo) - len(failed)} built or loaded, {len(failed)} failed, "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
