"""Overlap scheduling on vs off: decode time per step of the same engine, same requests.

``python -m bench.overlap --out bench/results/overlap_h200.json`` (CUDA). For each kind of
request and batch size, one ``EngineCore`` (dummy model at a real shape, CUDA graphs)
runs the same greedy requests with ``core.overlap`` off and on, in turns; it checks that
both give the same tokens, then reports the median decode step time of each and their
ratio (one run, so machine noise hits both alike).

Kinds (``--kinds``): ``plain``; ``penalized`` (frequency, presence and repetition
penalties and min_tokens: counted on the device under overlap); ``structured`` (a regex
grammar no output ends before the step budget: the next step's forward runs while the
host collects the step before, its sampling after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import GrammarSpec, SamplingParams

KINDS = {
    "plain": {},
    "penalized": dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1,
                      min_tokens=16),
    # no grammar end within the steps (96 tokens are well under 2,000 letters): a request
    # ending early makes the batch, and with it the kernels and their rounding, differ
    # between overlap on and off (where it ends a step later)
    "structured": dict(grammar=GrammarSpec(kind="regex", value="[a-z ]{2000,4000}")),
}  # fmt: skip


def run_once(core: EngineCore, prompts: list[list[int]], steps: int, tag: str,
             kind: str = "plain"):  # fmt: skip
    """Tokens per request, and the wall time of each step once every prompt is in."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, **KINDS[kind])
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"{tag}-{i}", p, params))
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    times = []
    while core.has_work:
        decoding = all(tokens.values())
        t0 = time.perf_counter()
        outs = core.step()
        if decoding:
            times.append(time.perf_counter() - t0)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    return list(tokens.values()), times[2:-2]  # drop the edges: pipeline fill and drain


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter's length if one is the
    other's start)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(preset: str, batch: int, context: int, steps: int, rounds: int,
            kind: str = "plain", device: str = "cuda", profile: bool = False) -> dict:  # fmt: skip
    config = EngineConfig(
        model=f"dummy:{preset}", device=device, dtype="bfloat16" if device == "cuda" else "float32",
        cache=CacheConfig(block_size=128, num_blocks=batch * (-(-(context + steps) // 128)) + 4,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=16384,
                                  max_model_len=context + steps + 8),
    )  # fmt: skip
    core = EngineCore(config)
    g = torch.Generator().manual_seed(batch)
    high = min(30000, core.runner.sampler.vocab_size)
    prompts = [torch.randint(high // 100, high, (context,), generator=g).tolist()
               for _ in range(batch)]  # fmt: skip
    # the kind's one-time costs (its grammar's compile) before the first measured round
    run_once(core, prompts[:1], 2, "warm", kind)
    step_ms: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    for r in range(rounds):
        for overlap in (False, True):
            core.overlap = overlap
            tokens, times = run_once(core, prompts, steps, f"{int(overlap)}{r}", kind)
            outputs.setdefault(overlap, tokens)
            assert tokens == outputs[overlap], "greedy tokens changed between rounds"
            step_ms[overlap] += [t * 1e3 for t in times]
    pairs = enumerate(zip(outputs[False], outputs[True]))  # the same requests, in order
    differs = [(i, first_difference(x, y)) for i, (x, y) in pairs if x != y]
    if differs:  # which requests and from which token on, to tell a near-tie from a bug
        print(f"{kind} batch {batch}: {len(differs)} requests differ, first (request, token): "
              f"{differs[:8]}", flush=True)
    off, on = (statistics.median(step_ms[m]) for m in (False, True))
    if profile:
        for overlap in (False, True):
            core.overlap = overlap
            print(f"-- {kind} batch {batch}, overlap {'on' if overlap else 'off'}: host time")
            host_profile(*(partial(run_once, core, prompts, steps, f"{tag}{int(overlap)}", kind)
                           for tag in ("p", "q")))  # fmt: skip
    del core
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"kind": kind, "preset": preset, "batch": batch, "context": context,
            "steps": steps, "same_tokens": not differs, "differs": differs[:64],
            "step_ms_off": off, "step_ms_on": on,
            "speedup": off / on}  # fmt: skip


def host_profile(call, again, top: int = 25) -> None:
    """Runs ``call`` under cProfile; prints the functions with the most time of their own,
    and the callers of the first four; on CUDA, ``again`` (the same run) under torch's
    profiler: the device's kernels and copies by their time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(top)
    stats.print_callers(4)  # who called the four costliest
    stats.print_callers("linear|compute_logits")
    report = text.getvalue()
    print(report[report.find("   ncalls"):], flush=True)
    if torch.cuda.is_available():  # the device's side: kernels and copies by their time
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            again()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="plain,penalized,structured")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="print each point's host profile")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    points = []
    for kind in args.kinds.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            points.append(measure(args.preset, batch, args.context, args.steps, args.rounds,
                                  kind, args.device, args.profile))  # fmt: skip
            p = points[-1]
            print(f"{kind:10s} batch {batch:4d}: off {p['step_ms_off']:.3f} ms  "
                  f"on {p['step_ms_on']:.3f} ms  x{p['speedup']:.3f}  "
                  f"same tokens: {p['same_tokens']}", flush=True)
    report = {"machine": machine_info(), "commit": args.commit, "points": points}
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
