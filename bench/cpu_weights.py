"""The default model's engine on the CPU with each kind of weights, in one run.

    .venv/bin/python -m bench.cpu_weights [--weights fp32 int8 int4] [--prefill-len 512]
        [--decode-steps 32] [--rounds 5] [--out bench/results/cpu_weights.json]

One ``EngineCore`` per ``--cpu-weights`` kind on the default model (the embedded GGUF),
side by side in this process. Each round times, for every engine in turn (so shifting
machine load hits them alike): the prefill of one ``--prefill-len``-token prompt (the
prefix cache off, so every round computes it) and ``--decode-steps`` decode steps of one
sequence after it. Recorded per kind: the median prefill tok/s and decode ms per step,
and their ratios to fp32 from the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.loader import default_model_path
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


def _engine(weights: str, prefill_len: int, steps: int) -> EngineCore:
    context = prefill_len + steps + 8
    return EngineCore(EngineConfig(
        model=str(default_model_path()), cpu_weights=weights,
        cache=CacheConfig(enable_prefix_caching=False, num_blocks=2 * (-(-context // 16)) + 2),
        scheduler=SchedulerConfig(max_model_len=context, max_num_batched_tokens=max(
            prefill_len, 2048)),
    ))  # fmt: skip


def _round(core: EngineCore, rid: str, prompt: list[int], steps: int) -> tuple[float, float]:
    """Seconds of the prompt's prefill (its first step) and the median decode step."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    refused = core.add_request(EngineRequest(rid, prompt, params))
    if refused is not None:
        raise RuntimeError(refused.error)
    times = []
    while core.has_work:
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", nargs="+", default=["fp32", "int8", "int4"])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/cpu_weights.json")
    args = parser.parse_args(argv)

    engines = {w: _engine(w, args.prefill_len, args.decode_steps) for w in args.weights}
    vocab = next(iter(engines.values())).model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    samples: dict[str, dict[str, list[float]]] = {w: {"prefill": [], "decode": []}
                                                  for w in engines}  # fmt: skip
    for r in range(args.rounds + 1):  # round 0 warms every engine up
        prompt = torch.randint(100, vocab - 100, (args.prefill_len,), generator=g).tolist()
        for w, core in engines.items():
            prefill_s, step_s = _round(core, f"{w}-{r}", prompt, args.decode_steps)
            if r:
                samples[w]["prefill"].append(prefill_s)
                samples[w]["decode"].append(step_s)
    results = {
        w: {"prefill_tok_s": args.prefill_len / statistics.median(s["prefill"]),
            "decode_step_ms": 1e3 * statistics.median(s["decode"]),
            "prefill_s_runs": s["prefill"], "decode_step_s_runs": s["decode"]}
        for w, s in samples.items()
    }  # fmt: skip
    base = results.get("fp32")
    if base is not None:
        for r in results.values():
            r["prefill_vs_fp32"] = r["prefill_tok_s"] / base["prefill_tok_s"]
            r["decode_speedup_vs_fp32"] = base["decode_step_ms"] / r["decode_step_ms"]
    report = {"benchmark": "cpu_weights", **machine_info(), "args": vars(args),
              "results": results}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for w, r in results.items():
        ratios = (f", prefill {r['prefill_vs_fp32']:.2f}x fp32, decode "
                  f"{r['decode_speedup_vs_fp32']:.2f}x" if base else "")  # fmt: skip
        print(f"{w}: prefill {r['prefill_tok_s']:.0f} tok/s, decode step "
              f"{r['decode_step_ms']:.1f} ms{ratios}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
