"""GPU engine step times against the HBM and matmul rooflines (one command on the GPU).

    python -m bench.gpu_engine [--preset llama3-8b] [--out results.json] [--hf]

Runs ferry's model runner (the same ``ModelRunner.execute`` the engine calls each step)
on dummy weights at a real shape, decode steps replayed from CUDA graphs unless
``--enforce-eager``. Decode steps are timed on a KV cache laid out for B sequences of
context L (the cache holds zeros: attention reads it all the same), so no prefill has to
run first. Reported per point: step time (host clock around ``execute``, which ends with
the copy of the sampled tokens to the host: what the engine loop sees), tok/s, the
fraction of the HBM roofline ((weight bytes + KV bytes read) / copy bandwidth); the GPU
time of the forward alone (graph replays back to back, CUDA events) and the host time
``execute`` spends before it waits. Prefill: one T-token chunk, as a fraction of the bf16
matmul peak. ``engine_step``: where the host time of a whole engine step goes (schedule,
runner, update) at batch 64, the case for overlapping the next step's preparation with
this step's GPU work. ``--hf`` also times Hugging Face transformers on the same shape:
plain ``generate`` (dynamic cache) and its fastest path, a static cache with the forward
compiled by ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import machine_info
from engine.attention import build_backend
from engine.cuda_graphs import capture_graph
from engine.loader import load_model
from engine.models.llama import Linear
from engine.models.moe import QUANTIZATIONS, Fp8Experts, MoE
from engine.plan import NewRequest, ScheduledChunk, StepPlan, StepResult
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kernels.activation import silu_and_mul
from kernels.gemv import gemv, gemv_supported
from kernels.norm_rope_cache import fused_add_rms_norm, rotary_embedding, write_kv_cache
from kernels.paged_decode_attention import paged_decode_attention
from kvstore.layout import KVCache

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


def _top_kernels(fn, top: int = 15) -> list[dict]:
    """The kernels of one ``fn()`` by total time, from torch's profiler (the CPU's own
    operators in a dry run without a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        _sync()

    def us(e) -> float:
        return e.device_time_total if cuda else e.self_cpu_time_total

    rows = sorted((e for e in prof.key_averages() if us(e) > 0), key=lambda e: -us(e))
    return [{"name": e.key[:120], "calls": e.count, "ms": us(e) / 1e3} for e in rows[:top]]


def _events_ms(fn, repeats: int) -> float:
    """GPU time of one ``fn()`` in ms: ``repeats`` calls back to back between two events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time of one ``fn()`` in ms: ``calls`` of it captured in one CUDA graph, the graph
    replayed ``replays`` times between two events."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(calls)], warmups=1)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays)


class Bench:
    def __init__(
        self,
        preset: str,
        max_blocks: int,
        device: str = "cuda",
        graph_batch: int = 0,
        graph_seq_len: int = 0,
        quantization: str = "none",
    ) -> None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        loaded = load_model(f"dummy:{preset}", device=device, dtype=dtype, progress=False,
                            quantization=quantization)  # fmt: skip
        self.model, cfg = loaded.model, loaded.config
        self.config = cfg
        layout = self.model.kv_layout(BLOCK, dtype)
        self.cache = KVCache(layout, max_blocks + 1, device)
        backend = build_backend(self.cache, cfg, self.model.attention_scale, device)
        self.backend_name = type(backend).__name__
        self.runner = ModelRunner(self.model, backend, Sampler(cfg.vocab_size, device), BLOCK)
        self.kv_bytes_per_token = layout.bytes_per_block // BLOCK
        # the weights: parameters, and FP8 experts' buffers (their scales too)
        fp8 = [m for m in self.model.modules() if isinstance(m, Fp8Experts)]
        weights = [*self.model.parameters(), *(b for m in fp8 for b in m.buffers())]
        params = sum(p.numel() for p in self.model.parameters())
        params += sum(m.w13.numel() + m.w2.numel() for m in fp8)
        embed = self.model.model.embed_tokens.weight
        self.weight_bytes = sum(w.numel() * w.element_size() for w in weights) - (
            embed.numel() * embed.element_size()
        )
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        routed = sum(m.experts.w13.numel() + m.experts.w2.numel() for m in self.moe_layers)
        self.expert_params = self.expert_bytes = 0
        if self.moe_layers:
            experts = self.moe_layers[0].experts
            self.expert_params = experts.w13[0].numel() + experts.w2[0].numel()
            self.expert_bytes = sum(t[0].numel() * t.element_size() for t in experts.stacked())
        active = routed - len(self.moe_layers) * self.expert_params * (
            cfg.moe.top_k if cfg.moe else 0
        )  # the routed experts a token does not run
        self.flops_per_token = 2 * (params - embed.numel() - active)  # 2 FLOP per weight
        self.lm_head_flops = 2 * cfg.hidden_size * cfg.vocab_size  # one sampled row only
        self._ids = 0
        self.capture_s = None
        if graph_batch:
            start = time.perf_counter()
            self.runner.capture_decode_graphs(graph_batch, graph_seq_len)
            self.capture_s = time.perf_counter() - start

    def _register(self, n: int) -> list[str]:
        ids = [f"r{self._ids + i}" for i in range(n)]
        self._ids += n
        new = [NewRequest(rid, [1], GREEDY, ()) for rid in ids]
        self.runner.execute(StepPlan(new_requests=new))
        return ids

    def decode(self, batch: int, context: int, repeats: int, eager: bool = False) -> dict:
        per_seq = -(-context // BLOCK)
        ids = self._register(batch)
        vocab = self.config.vocab_size
        chunks = [  # a token of its own per row: an MoE layer routes the rows apart
            ScheduledChunk(
                rid, [(7 + 13 * i) % vocab], context - 1,
                list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True,
            )
            for i, rid in enumerate(ids)
        ]  # fmt: skip
        plan = StepPlan(chunks=chunks)
        weight_bytes = self.step_weight_bytes(plan)
        graphs, runner = self.runner.graphs, self.runner
        if eager:
            runner.graphs = None
        graphed = runner.graphs is not None and runner.graphs.accepts(chunks)
        seconds = _cuda_time(lambda: runner.execute(plan), repeats)
        host = []
        for _ in range(repeats):  # host time until execute waits for the device
            _sync()
            start = time.perf_counter()
            sampled = runner.sample(plan)
            host.append(time.perf_counter() - start)
            sampled[1].to_host()
        if graphed:
            with torch.inference_mode():
                forward_ms = _events_ms(lambda: runner.graphs.run(chunks), repeats)
        else:
            forward_ms = None
        runner.graphs = graphs
        runner.execute(StepPlan(finished_ids=ids))
        floor = (weight_bytes + batch * context * self.kv_bytes_per_token) / COPY_BW
        out = {
            "batch": batch,
            "context": context,
            "weight_bytes_read": weight_bytes,
            "kv_bytes_read": batch * context * self.kv_bytes_per_token,
            "cuda_graph": graphed,
            "step_ms": seconds * 1e3,
            "tok_s": batch / seconds,
            "roofline_ms": floor * 1e3,
            "fraction_of_roofline": floor / seconds,
            "host_ms_before_wait": statistics.median(host) * 1e3,
        }
        if forward_ms is not None:
            out["forward_gpu_ms"] = forward_ms
            out["forward_fraction_of_roofline"] = floor * 1e3 / forward_ms
        return out

    def step_weight_bytes(self, plan: StepPlan) -> int:
        """Weight bytes the decode step ``plan`` reads: every dense weight and, of each MoE
        layer's routed experts, only those its tokens chose (counted on one eager run)."""
        if not self.moe_layers:
            return self.weight_bytes
        chosen: list[int] = []
        hooks = [
            m.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[1].unique().numel()))
            for m in self.moe_layers
        ]
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            self.runner.execute(plan)
        finally:
            self.runner.graphs = graphs
            for h in hooks:
                h.remove()
        every = len(self.moe_layers) * self.moe_layers[0].experts.w13.shape[0]
        return self.weight_bytes - (every - sum(chosen)) * self.expert_bytes

    def skinny_ab(self, points, repeats: int) -> list[dict]:
        """Decode steps with the skinny GEMV kernel, then with every projection on the
        library GEMM (graphs recaptured for it): the A/B of ``kernels.gemv`` in one run."""
        graphs = self.runner.graphs
        on = [self.decode(b, c, repeats) for b, c in points]
        Linear.skinny_kernel = False
        try:
            if graphs is not None:
                self.runner.capture_decode_graphs(
                    max(b for b, _ in points), max(c for _, c in points)
                )
            off = [self.decode(b, c, repeats) for b, c in points]
        finally:
            Linear.skinny_kernel = True
            self.runner.graphs = graphs
        return [
            {
                "batch": a["batch"],
                "context": a["context"],
                "step_ms_skinny_gemv": a["step_ms"],
                "step_ms_library_gemm": b["step_ms"],
                "forward_ms_skinny_gemv": a.get("forward_gpu_ms"),
                "forward_ms_library_gemm": b.get("forward_gpu_ms"),
                "speedup": b["step_ms"] / a["step_ms"],
            }
            for a, b in zip(on, off)
        ]

    def kernels(self, batch: int, context: int) -> dict:
        """Per-kernel GPU time and achieved bandwidth at one decode shape (layer 0), each
        timed as 20 calls in a CUDA graph so that launch overhead stays out."""
        cfg = self.config
        layer = self.cache.layers[0]
        per_seq = -(-context // BLOCK)
        tables = torch.arange(1, 1 + batch * per_seq, dtype=torch.int32, device="cuda")
        tables = tables.view(batch, per_seq)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = torch.randn(batch, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device="cuda")
        qs = qkv[:, : hq * d].view(batch, hq, d)
        ks = qkv[:, hq * d : (hq + hkv) * d].view(batch, hkv, d)
        vs = qkv[:, (hq + hkv) * d :].view(batch, hkv, d)
        kv_bytes = batch * context * self.kv_bytes_per_token // cfg.num_layers
        attn = _graph_ms(
            lambda: paged_decode_attention(
                qs, layer, tables, seq_lens, num_kv_heads=hkv,
                scale=self.model.attention_scale, max_seq_len=context,
            )
        )  # fmt: skip
        x = torch.randn(batch, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        res, w = torch.randn_like(x), torch.randn(cfg.hidden_size, dtype=torch.bfloat16).cuda()
        norm = _graph_ms(lambda: fused_add_rms_norm(x, res, w, 1e-5))
        pos = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
        cos_sin = self.model.model.rotary_emb.cos_sin
        rope = _graph_ms(lambda: rotary_embedding(pos, qs, ks, cos_sin))
        slots = (tables[:, -1].long() * BLOCK + (context - 1) % BLOCK).contiguous()
        write = _graph_ms(lambda: write_kv_cache(ks, vs, layer, slots))
        gate_up = torch.randn(batch, 2 * cfg.intermediate_size, dtype=torch.bfloat16).cuda()
        act = _graph_ms(lambda: silu_and_mul(gate_up))
        out = {
            "batch": batch,
            "context": context,
            "decode_attention": {"us": attn * 1e3, "gb_s": kv_bytes / attn / 1e6},
            "fused_add_rms_norm": {"us": norm * 1e3, "gb_s": 8 * x.numel() / norm / 1e6},
            "rotary_embedding": {
                "us": rope * 1e3,
                "gb_s": 4 * (qs.numel() + ks.numel()) / rope / 1e6,
            },
            "kv_cache_write": {"us": write * 1e3, "gb_s": 8 * ks.numel() / write / 1e6},
            "silu_and_mul": {"us": act * 1e3, "gb_s": 3 * gate_up.numel() / act / 1e6},
        }
        layer0 = self.model.model.layers[0]
        weights = {
            "qkv_proj": layer0.self_attn.qkv_proj.weight,
            "o_proj": layer0.self_attn.o_proj.weight,
            "gate_up_proj": layer0.mlp.gate_up_proj.weight,
            "down_proj": layer0.mlp.down_proj.weight,
            "lm_head": self.model.lm_head.weight,
        }
        linear = torch.nn.functional.linear

        def timed(fn, weight: torch.Tensor) -> dict:
            ms = _graph_ms(fn)
            return {"us": ms * 1e3, "gb_s": weight.numel() * weight.element_size() / ms / 1e6}

        for name, w in weights.items():
            xin = torch.randn(batch, w.shape[1], dtype=torch.bfloat16, device="cuda")
            out[f"{name}_gemm"] = timed(lambda w=w, xin=xin: linear(xin, w), w)
            if gemv_supported(xin, w):
                out[f"{name}_tilelang_gemv"] = timed(lambda w=w, xin=xin: gemv(xin, w), w)
            if batch == 1:  # the matrix-vector product torch takes for 1-D inputs
                out[f"{name}_gemv"] = timed(lambda w=w, xin=xin: linear(xin[0], w), w)
        return out

    def decode_block_sweep(self, batches=(1, 64), context: int = 1024) -> list[dict]:
        """The decode kernel over a cache of 16-token blocks (the engine's default block
        size) for each tile width it can take, against the 128-token blocks used above."""
        from kernels.paged_decode_attention import default_config

        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out = []
        for block_size in (16, 128):
            per_seq = -(-context // block_size)
            blocks = max(batches) * per_seq + 1
            cache = torch.randn(blocks, block_size, 2 * hkv * d, dtype=torch.bfloat16).cuda()
            for batch in batches:
                tables = torch.randperm(blocks - 1, device="cuda")[: batch * per_seq] + 1
                tables = tables.to(torch.int32).view(batch, per_seq)
                seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
                base = default_config(hq, hkv, d, block_size, torch.bfloat16,
                                      self.model.attention_scale, batch)  # fmt: skip
                args = (q, cache, tables, seq_lens)
                for block_n in (16, 32, 64, 128):
                    kcfg = replace(base, block_n=block_n)
                    try:
                        ms = _graph_ms(
                            lambda args=args, kcfg=kcfg: paged_decode_attention(
                                *args, num_kv_heads=hkv, scale=self.model.attention_scale,
                                max_seq_len=context, config=kcfg,
                            )
                        )  # fmt: skip
                    except Exception as exc:  # a tile width the kernel cannot take
                        print(f"block {block_size} block_n {block_n}: {exc!r}"[:300])
                        continue
                    kv_bytes = batch * context * 2 * hkv * d * 2
                    out.append({
                        "block_size": block_size, "batch": batch, "context": context,
                        "block_n": block_n, "default": block_n == base.block_n,
                        "us": ms * 1e3, "gb_s": kv_bytes / ms / 1e6,
                    })  # fmt: skip
        return out

    def prefill(self, tokens: int, repeats: int, profile: bool = False) -> dict:
        cfg = self.config
        (rid,) = self._register(1)
        blocks = list(range(1, 1 + -(-tokens // BLOCK)))
        prompt = [(7 + 13 * j) % cfg.vocab_size for j in range(tokens)]  # routed apart
        plan = StepPlan(chunks=[ScheduledChunk(rid, prompt, 0, blocks, True)])
        seconds = _cuda_time(lambda: self.runner.execute(plan), repeats)
        kernels = _top_kernels(lambda: self.runner.execute(plan)) if profile else None
        self.runner.execute(StepPlan(finished_ids=[rid]))
        attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
        # every layer's weights for every token; the vocabulary projection for the last only
        flops = (self.flops_per_token - self.lm_head_flops) * tokens + self.lm_head_flops + attn
        return {
            "tokens": tokens,
            "ms": seconds * 1e3,
            "tok_s": tokens / seconds,
            "tflop_s": flops / seconds / 1e12,
            "fraction_of_matmul_peak": flops / seconds / MATMUL_PEAK,
            **({"top_kernels": kernels} if kernels else {}),
        }


def engine_step(preset: str, batch: int, context: int, steps: int, block_size: int) -> dict:
    """Host time of whole engine steps (schedule, runner, update) at steady decode."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core import EngineCore
    from engine.messages import EngineRequest

    blocks = batch * (-(-(context + steps + 8) // block_size)) + 2
    config = EngineConfig(
        model=f"dummy:{preset}", device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=block_size, num_blocks=blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192,
                                  max_model_len=context + steps + 8),
    )  # fmt: skip
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(min(300, vocab // 2), vocab, (context,), generator=g).tolist()
        refused = core.add_request(EngineRequest(f"e{i}", prompt, params))
        if refused is not None:
            raise RuntimeError(f"engine_step: request refused: {refused.error}")
    runner, sched = core.runner, core.scheduler
    phases = {"schedule": [], "runner_host": [], "wait": [], "update": [], "step": []}
    for _ in range(batch * context):  # prefill every prompt first
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        if all(c.num_tokens == 1 for c in plan.chunks) and len(plan.chunks) == batch:
            break
    else:
        raise RuntimeError("engine_step: the prompts never reached steady decode")
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        runner._sync_states(plan)
        sample_ids, sampled = runner.sample(plan)
        t2 = time.perf_counter()
        out = sampled.to_host()
        t3 = time.perf_counter()
        runner._advance(sample_ids, out.token_ids)
        sched.update(plan, StepResult(dict(zip(sample_ids, out.token_ids))))
        t4 = time.perf_counter()
        for name, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            phases[name].append(v * 1e3)
    del core
    torch.cuda.empty_cache()
    med = {k: statistics.median(v) for k, v in phases.items()}
    host = med["schedule"] + med["runner_host"] + med["update"]
    return {
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "cuda_graph": True,
        **{f"{k}_ms": v for k, v in med.items()},
        "host_ms": host,
        "host_fraction_of_step": host / med["step"],
    }


def _hf_model(cfg):
    import transformers

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
    return model


class _StepClock:
    """A logits processor that notes when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores

    def step_s(self) -> float:
        gaps = [b - a for a, b in zip(self.times[1:], self.times[2:])]  # past the prefill
        return statistics.median(gaps)


def hf_generate(model, batch: int, context: int, new_tokens: int, compiled: bool) -> dict:
    """transformers' ``generate``: median decode ms/step (prefill excluded). ``compiled``:
    static cache, forward compiled with mode="reduce-overhead" (CUDA graphs)."""
    import transformers

    ids = torch.randint(300, 30000, (batch, context), device="cuda")
    extra = {}
    if compiled:
        extra = dict(
            cache_implementation="static",
            compile_config=transformers.CompileConfig(mode="reduce-overhead", fullgraph=True),
        )
    start = time.perf_counter()
    result = None
    for attempt in range(2 if compiled else 1):  # the first compiled call compiles
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False,
                logits_processor=transformers.LogitsProcessorList([clock]), **extra,
            )  # fmt: skip
        result = clock.step_s()
        if attempt == 0:
            first_call_s = time.perf_counter() - start
    return {
        "batch": batch,
        "context": context,
        "path": "static cache + torch.compile(reduce-overhead)" if compiled else "eager",
        "step_ms": result * 1e3,
        "tok_s": batch / result,
        "first_call_s": first_call_s,
    }


def transformers_only(preset: str, points: str, out: Path) -> None:
    """Plain and compiled transformers at each BxL of ``points``; JSON list to ``out``."""
    model = _hf_model(load_model_config_for(preset))
    results = []
    for compiled in (False, True):
        for spec in points.split(","):
            b, c = (int(v) for v in spec.split("x"))
            results.append(hf_generate(model, b, c, 48, compiled))
            print(results[-1], flush=True)
            out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                        help="fp8: the routed experts in FP8 (ferry serve --quantization)")
    parser.add_argument("--hf", action="store_true", help="also time transformers")
    parser.add_argument("--hf-only", action="store_true", help="time transformers alone")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on a small preset")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--points", default="1x1024,8x1024,64x1024,256x1024,1x8192,8x8192,64x8192")
    parser.add_argument("--eager-points", default="1x1024,64x1024",
                        help="also timed without CUDA graphs, for comparison")  # fmt: skip
    parser.add_argument("--skinny-ab", default="1x1024,4x1024",
                        help="decode points timed with and without the skinny GEMV")  # fmt: skip
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="record each prefill's top GPU kernels (torch's profiler)")
    parser.add_argument("--hf-points", default="1x1024,64x1024")
    parser.add_argument("--engine-step", default="64x1024", help="BxL, or empty to skip")
    parser.add_argument("--commit", help="commit to record (default: git's, where there is one)")
    parser.add_argument("--out", default="bench/results/gpu_engine.json")
    args = parser.parse_args()
    if args.hf_only:
        transformers_only(args.preset, args.hf_points, Path(args.out))
        return

    def parse(spec: str) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in p.split("x")) for p in spec.split(",") if p]

    # 256 x 8k tokens of KV (256 GB at the 8B shape) does not fit beside the weights.
    points = parse(args.points)
    eager_points = parse(args.eager_points)
    prefill_lens = [int(t) for t in args.prefill.split(",") if t]
    max_blocks = max(
        [b * -(-c // BLOCK) for b, c in points] + [-(-t // BLOCK) for t in prefill_lens]
    )
    graph = args.device == "cuda" and not args.enforce_eager
    bench = Bench(
        args.preset,
        max_blocks,
        args.device,
        graph_batch=max(b for b, _ in points) if graph else 0,
        graph_seq_len=max(c for _, c in points) if graph else 0,
        quantization=args.quantization,
    )
    decode = [bench.decode(b, c, args.repeats) for b, c in points]
    decode_eager = [bench.decode(b, c, args.repeats, eager=True) for b, c in eager_points]
    ab_points = parse(args.skinny_ab) if args.device == "cuda" else []
    skinny_ab = bench.skinny_ab(ab_points, args.repeats) if ab_points else []
    prefill = [
        bench.prefill(t, max(2, args.repeats // 5), profile=args.profile_prefill)
        for t in prefill_lens
    ]
    gqa_cuda = args.device == "cuda" and bench.config.mla is None  # the next two index GQA
    kernel_points = [(1, 1024), (64, 1024), (64, 8192)] if gqa_cuda else []
    kernels = [bench.kernels(b, c) for b, c in kernel_points]
    block_sweep = bench.decode_block_sweep() if gqa_cuda else []
    report = {
        "benchmark": "gpu_engine",
        **machine_info(),
        "preset": args.preset,
        "quantization": args.quantization,
        "attention_backend": bench.backend_name,
        "ceilings": {"copy_bytes_per_s": COPY_BW, "bf16_flop_per_s": MATMUL_PEAK},
        "weight_bytes_read_per_step": bench.weight_bytes,
        "graph_capture_s": bench.capture_s,
        "decode": decode,
        "decode_eager": decode_eager,
        "skinny_gemv_ab": skinny_ab,
        "prefill": prefill,
        "kernels": kernels,
        "decode_block_sweep": block_sweep,
    }
    if args.commit:
        report["commit"] = args.commit
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    del bench
    torch.cuda.empty_cache()
    report["engine_step"] = [
        engine_step(args.preset, b, c, steps=40, block_size=bs)
        for b, c in (parse(args.engine_step) if args.device == "cuda" else [])
        for bs in (16, 128)
    ]
    save()
    if args.hf:  # in a process of its own: in this one, after ferry, it ran 1.3-6x slower
        roof = {(d["batch"], d["context"]): d["roofline_ms"] for d in decode}
        hf_out = out.with_name(out.stem + "_transformers.json")
        command = [sys.executable, "-m", "bench.gpu_engine", "--hf-only", "--preset",
                   args.preset, "--hf-points", args.hf_points, "--out", str(hf_out)]  # fmt: skip
        subprocess.run(command, check=False)
        report["transformers"] = json.loads(hf_out.read_text()) if hf_out.exists() else []
        for h in report["transformers"]:
            if (h["batch"], h["context"]) in roof:
                h["fraction_of_roofline"] = roof[(h["batch"], h["context"])] / h["step_ms"]
    save()
    print_report(report)


def print_report(report: dict) -> None:
    print(f"attention backend: {report['attention_backend']}; capture {report['graph_capture_s']}")
    print(f"{'batch':>6}{'context':>9}{'graph':>6}{'step ms':>9}{'fwd ms':>8}{'host ms':>8}"
          f"{'floor':>7}{'of roof':>8}{'tok/s':>9}")  # fmt: skip
    for d in report["decode"] + report["decode_eager"]:
        fwd = d.get("forward_gpu_ms")
        print(
            f"{d['batch']:>6}{d['context']:>9}{'y' if d['cuda_graph'] else 'n':>6}"
            f"{d['step_ms']:>9.2f}{(f'{fwd:.2f}' if fwd else '-'):>8}"
            f"{d['host_ms_before_wait']:>8.2f}{d['roofline_ms']:>7.2f}"
            f"{d['fraction_of_roofline']:>8.0%}{d['tok_s']:>9.0f}"
        )
    for d in report.get("skinny_gemv_ab", []):
        on, off = d["step_ms_skinny_gemv"], d["step_ms_library_gemm"]
        print(f"skinny GEMV b{d['batch']} ctx{d['context']}: step {on:.3f} ms vs library "
              f"GEMM {off:.3f} ms: x{d['speedup']:.3f}")  # fmt: skip
    for p in report["prefill"]:
        print(f"prefill {p['tokens']:>5} tokens: {p['ms']:.1f} ms, {p['tflop_s']:.0f} TFLOP/s = "
              f"{p['fraction_of_matmul_peak']:.0%} of matmul peak")  # fmt: skip
        for k in p.get("top_kernels", []):
            print(f"  {k['ms']:8.2f} ms {k['calls']:5d}x  {k['name'][:90]}")
    for k in report["kernels"]:
        cells = ", ".join(
            f"{n} {v['us']:.1f}us {v['gb_s']:.0f}GB/s" for n, v in k.items() if isinstance(v, dict)
        )
        print(f"kernels b{k['batch']} ctx{k['context']}: {cells}")
    for k in report.get("decode_block_sweep", []):
        print(f"decode kernel block {k['block_size']} b{k['batch']} ctx{k['context']} "
              f"block_n {k['block_n']}{'*' if k['default'] else ''}: {k['us']:.1f} us, "
              f"{k['gb_s']:.0f} GB/s")  # fmt: skip
    for e in report.get("engine_step", []):
        print(f"engine step b{e['batch']} ctx{e['context']} block {e['block_size']}: "
              f"step {e['step_ms']:.2f} ms, "
              f"schedule {e['schedule_ms']:.2f}, runner host {e['runner_host_ms']:.2f}, "
              f"wait {e['wait_ms']:.2f}, update {e['update_ms']:.2f}")  # fmt: skip
    for h in report.get("transformers", []):
        frac = h.get("fraction_of_roofline")
        print(f"transformers {h['path']} b{h['batch']} ctx{h['context']}: {h['step_ms']:.2f} "
              f"ms/step, {h['tok_s']:.0f} tok/s" + (f", {frac:.0%} of roofline" if frac else "")
              + f" (first call {h['first_call_s']:.0f} s)")  # fmt: skip


def load_model_config_for(preset: str):
    from engine.loader.dummy import dummy_config

    return dummy_config(preset)


if __name__ == "__main__":
    main()
