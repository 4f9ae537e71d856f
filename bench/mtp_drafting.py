"""Decode steps with MTP drafts: wall time per step against the device's time.

    python -m bench.mtp_drafting --out bench/results/mtp_drafting_h200.json   (CUDA)

``dummy:deepseek-v3-4l`` with one MTP layer at DeepSeek-V3's width (random weights: the
drafts are all rejected, so every step verifies the same number and yields one token per
request), a fixed verify length K, and the same engine without drafts (``none``); greedy
requests of short prompts, CUDA graphs and overlap scheduling as served. Per batch: the
median wall time of a decode step, and the median device time of one (forward,
verification, drafting: CUDA events), whose difference is what the device waits for the
host around a step. Run the same command over two trees (``PYTHONPATH``, from outside
the repository) to compare engines in one session.

``--draft MODEL`` measures a draft model instead (``--base llama3-8b --draft
dummy:llama3.2-1b``: random weights too, so every draft is rejected), its arm ``draft``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.loader import dummy
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from engine.spec.manager import SpecDecoding


def with_mtp(base: str) -> str:
    """A dummy preset: ``base`` with one MTP layer."""
    name = f"{base}-mtp"
    dummy.PRESETS[name] = dataclasses.replace(
        dummy.PRESETS[base], name=f"dummy-{name}", num_mtp_layers=1
    )
    return name


def measure(core: EngineCore, batch: int, prompt_len: int, steps: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        vocab = core.model_config.vocab_size
        prompt = torch.randint(vocab // 4, vocab // 2, (prompt_len,), generator=g).tolist()
        if core.add_request(EngineRequest(f"{tag}-{i}", prompt, params)) is not None:
            raise RuntimeError("a request was refused")
    finish, device = core.runner.finish, []

    def timed(launched):
        result = finish(launched)
        if result.timing is not None and launched is not None and launched.plan.is_decode:
            t = result.timing
            device.append(t.forward_s + t.sample_s + t.draft_s)
        return result

    core.runner.finish = timed
    walls, tokens = [], 0
    try:
        while core.has_work:
            decoding = core.scheduler.running and not core.scheduler.waiting
            start = time.perf_counter()
            outs = core.step()
            if decoding:
                walls.append(time.perf_counter() - start)
            tokens += sum(len(o.new_token_ids) for o in outs)
    finally:
        core.runner.finish = finish
    edge = min(4, len(walls) // 4)  # the edges: pipeline fill and drain
    walls, device = walls[edge : len(walls) - edge], device[edge : len(device) - edge]
    wall_ms = 1e3 * statistics.median(walls)
    device_ms = 1e3 * statistics.median(device) if device else float("nan")  # CUDA events only
    return {"batch": batch, "steps": len(walls), "tokens": tokens,
            "step_ms": round(wall_ms, 3), "device_ms": round(device_ms, 3),
            "host_wait_ms": round(wall_ms - device_ms, 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--label", default="")
    ap.add_argument("--base", default="deepseek-v3-4l", help="the dummy preset, less MTP")
    ap.add_argument("--draft", default="", help="a draft model in place of the MTP layer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    method = "draft" if args.draft else "mtp"
    model = args.base if args.draft else with_mtp(args.base)
    config = EngineConfig(
        model=f"dummy:{model}", device=args.device, dtype=args.dtype,
        cache=CacheConfig(block_size=128, memory_gb=8.0, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=4096,
                                  max_model_len=4096),
        speculative=SpeculativeConfig(method=method, draft_model=args.draft,
                                      num_speculative_tokens=args.k, schedule="fixed"),
    )  # fmt: skip
    core = EngineCore(config)
    drafting = (core.scheduler.spec, core.runner.drafter)
    plain = (SpecDecoding(SpeculativeConfig()), None)
    points = []
    for batch in batches:
        for arm, (spec, drafter) in ((method, drafting), ("none", plain)):
            core.scheduler.spec, core.runner.drafter = spec, drafter
            measure(core, batch, args.prompt_len, 16, f"warm{arm}{batch}")
            points.append({"arm": arm, **measure(core, batch, args.prompt_len, args.steps,
                                                 f"{arm}{batch}")})  # fmt: skip
            p = points[-1]
            print(f"{args.label} {arm:5s} batch {batch:3d}: step {p['step_ms']:.3f} ms, device "
                  f"{p['device_ms']:.3f} ms, host wait {p['host_wait_ms']:.3f} ms", flush=True)
    report = {"machine": machine_info(), "label": args.label, "model": config.model,
              "draft": args.draft, "k": args.k, "points": points}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
