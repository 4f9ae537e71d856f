"""GPU engine step times against the HBM and matmul rooflines (one command on the GPU).

    python -m bench.gpu_engine [--preset llama3-8b] [--out results.json] [--hf]

Runs ferry's model runner (the same ``ModelRunner.execute`` the engine calls each step)
on dummy weights at a real shape. Decode steps are timed on a KV cache laid out for B
sequences of context L (the cache holds random bytes: attention reads it all the same),
so no prefill has to run first. Reported per point: step time, tok/s, and the fraction
of the HBM roofline ((weight bytes + KV bytes read) / copy bandwidth). Prefill: one T-token
chunk, as a fraction of the bf16 matmul peak. ``--hf`` also times Hugging Face
transformers' ``generate`` on the same shape (eager, dynamic cache) at batch 1 and 64.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import machine_info
from engine.attention import backend_for
from engine.kv_cache.layout import KVCache
from engine.loader import load_model
from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

COPY_BW = 4.24e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
MATMUL_PEAK = 777e12  # bf16 FLOP/s, measured on the H200
BLOCK = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cuda_time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - start) / repeats


class Bench:
    def __init__(self, preset: str, max_blocks: int, device: str = "cuda") -> None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        loaded = load_model(f"dummy:{preset}", device=device, dtype=dtype, progress=False)
        self.model, cfg = loaded.model, loaded.config
        self.config = cfg
        layout = self.model.kv_layout(BLOCK, dtype)
        self.cache = KVCache(layout, max_blocks + 1, device)
        backend = backend_for(device)(
            self.cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.model.attention_scale
        )
        self.backend_name = type(backend).__name__
        self.runner = ModelRunner(self.model, backend, Sampler(cfg.vocab_size, device), BLOCK)
        self.kv_bytes_per_token = layout.bytes_per_block // BLOCK
        params = sum(p.numel() for p in self.model.parameters())
        embed = self.model.model.embed_tokens.weight
        self.weight_bytes = (params - embed.numel()) * embed.element_size()
        self.flops_per_token = 2 * (params - embed.numel()) // 1  # 2 FLOP per weight
        self._ids = 0

    def _register(self, n: int) -> list[str]:
        ids = [f"r{self._ids + i}" for i in range(n)]
        self._ids += n
        new = [NewRequest(rid, [1], GREEDY, ()) for rid in ids]
        self.runner.execute(StepPlan(new_requests=new))
        return ids

    def decode(self, batch: int, context: int, repeats: int) -> dict:
        per_seq = -(-context // BLOCK)
        ids = self._register(batch)
        chunks = [
            ScheduledChunk(
                rid, [7], context - 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True
            )
            for i, rid in enumerate(ids)
        ]
        plan = StepPlan(chunks=chunks)
        seconds = _cuda_time(lambda: self.runner.execute(plan), repeats)
        self.runner.execute(StepPlan(finished_ids=ids))
        floor = (self.weight_bytes + batch * context * self.kv_bytes_per_token) / COPY_BW
        return {
            "batch": batch,
            "context": context,
            "step_ms": seconds * 1e3,
            "tok_s": batch / seconds,
            "roofline_ms": floor * 1e3,
            "fraction_of_roofline": floor / seconds,
        }

    def prefill(self, tokens: int, repeats: int) -> dict:
        cfg = self.config
        (rid,) = self._register(1)
        blocks = list(range(1, 1 + -(-tokens // BLOCK)))
        plan = StepPlan(chunks=[ScheduledChunk(rid, [7] * tokens, 0, blocks, True)])
        seconds = _cuda_time(lambda: self.runner.execute(plan), repeats)
        self.runner.execute(StepPlan(finished_ids=[rid]))
        attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
        flops = self.flops_per_token * tokens + attn
        return {
            "tokens": tokens,
            "ms": seconds * 1e3,
            "tok_s": tokens / seconds,
            "tflop_s": flops / seconds / 1e12,
            "fraction_of_matmul_peak": flops / seconds / MATMUL_PEAK,
        }


def hf_generate(preset_config, batch: int, context: int, new_tokens: int) -> dict:
    """transformers' generate (eager, dynamic cache): decode ms/step excluding prefill."""
    import transformers

    cfg = preset_config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    ids = torch.randint(300, 30000, (batch, context), device="cuda")

    def run(n):
        return lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False,
        )  # fmt: skip

    with torch.inference_mode():
        t1 = _cuda_time(run(1), 1)
        tn = _cuda_time(run(new_tokens + 1), 1)
    step = (tn - t1) / new_tokens
    return {"batch": batch, "context": context, "step_ms": step * 1e3, "tok_s": batch / step}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on a small preset")
    parser.add_argument("--points", default="1x1024,8x1024,64x1024,256x1024,1x8192,8x8192,64x8192")
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--out", default="bench/results/gpu_engine.json")
    args = parser.parse_args()

    # 256 x 8k tokens of KV (256 GB at the 8B shape) does not fit beside the weights.
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    prefill_lens = [int(t) for t in args.prefill.split(",")]
    max_blocks = max(
        [b * -(-c // BLOCK) for b, c in points] + [-(-t // BLOCK) for t in prefill_lens]
    )
    bench = Bench(args.preset, max_blocks, args.device)
    decode = [bench.decode(b, c, args.repeats) for b, c in points]
    prefill = [bench.prefill(t, max(2, args.repeats // 3)) for t in prefill_lens]
    report = {
        "benchmark": "gpu_engine",
        **machine_info(),
        "preset": args.preset,
        "attention_backend": bench.backend_name,
        "ceilings": {"copy_bytes_per_s": COPY_BW, "bf16_flop_per_s": MATMUL_PEAK},
        "weight_bytes_read_per_step": bench.weight_bytes,
        "decode": decode,
        "prefill": prefill,
    }
    if args.hf:
        del bench
        torch.cuda.empty_cache()
        report["transformers_generate"] = [
            hf_generate(load_model_config_for(args.preset), b, 1024, 32) for b in (1, 64)
        ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"attention backend: {report['attention_backend']}")
    print(f"{'batch':>6}{'context':>9}{'step ms':>10}{'floor ms':>10}{'of roof':>9}{'tok/s':>10}")
    for d in decode:
        print(
            f"{d['batch']:>6}{d['context']:>9}{d['step_ms']:>10.2f}{d['roofline_ms']:>10.2f}"
            f"{d['fraction_of_roofline']:>9.0%}{d['tok_s']:>10.0f}"
        )
    for p in prefill:
        print(f"prefill {p['tokens']:>5} tokens: {p['tflop_s']:.0f} TFLOP/s = "
              f"{p['fraction_of_matmul_peak']:.0%} of matmul peak")  # fmt: skip
    for h in report.get("transformers_generate", []):
        print(f"transformers generate b{h['batch']} ctx{h['context']}: {h['step_ms']:.2f} ms/step")


def load_model_config_for(preset: str):
    from engine.loader.dummy import dummy_config

    return dummy_config(preset)


if __name__ == "__main__":
    main()
