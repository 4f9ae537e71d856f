"""What a full garbage collection costs an engine process, before and after its startup
is frozen (``engine.heap.freeze_startup``, which every worker and frontend runs once up).

    PYTHONPATH=. .venv/bin/python -m bench.gc_pause --out bench/results/gc_pause_cpu.json
    python -m bench.gc_pause --device cuda --model dummy:llama3-8b --dtype bfloat16 \\
        --out $OUT/gc_pause_h200.json

One ``EngineCore`` in this process, as a worker builds it (weights, KV cache, on CUDA its
graphs and kernels), warmed up and then serving ``--requests`` greedy requests so that its
serving state exists too. Then, ``--repeats`` times each: ``gc.collect()`` of the oldest
generation as the process stands (what stops a serving loop now and then), and after
``freeze_startup``. Reported: the objects tracked and frozen, the median and max pause,
and the ratio; the decode steps' median time beside them, for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from bench.common import machine_info
from engine import heap
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import model_name
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


def full_collections(repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` full collections."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - start)
    return out


def serve(core: EngineCore, requests: int, tokens: int) -> list[float]:
    """Run ``requests`` greedy requests at once; the seconds of each engine step."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(requests):
        core.add_request(EngineRequest(f"gc-{time.monotonic_ns()}-{i}", [5 + i % 200] * 32,
                                       params))  # fmt: skip
    steps = []
    while core.has_work:
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gc_pause_cpu.json"))
    args = ap.parse_args()
    fields = {"device": args.device, "num_threads": args.threads}
    if args.model:
        fields["model"] = args.model
    if args.dtype:
        fields["dtype"] = args.dtype
    started = time.perf_counter()
    core = EngineCore(EngineConfig(**fields))
    serve(core, 2, 4)  # warm-up
    steps = serve(core, args.requests, args.tokens)
    tracked = len(gc.get_objects())
    before = full_collections(args.repeats)
    frozen = heap.freeze_startup()
    after = full_collections(args.repeats)
    result = {
        **machine_info(), "benchmark": "gc_pause", "args": {**vars(args), "out": str(args.out)},
        "model": model_name(core.config.model), "engine_s": time.perf_counter() - started,
        "objects_tracked": tracked, "objects_frozen": frozen,
        "objects_tracked_after": len(gc.get_objects(generation=2)),
        "full_collection_ms": {"before": [round(s * 1e3, 3) for s in before],
                               "after": [round(s * 1e3, 3) for s in after]},
        "median_ms": {"before": statistics.median(before) * 1e3,
                      "after": statistics.median(after) * 1e3},
        "decode_step_median_ms": statistics.median(steps[len(steps) // 2:]) * 1e3,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['model']} on {args.device}: {tracked} objects tracked; a full collection "
          f"{result['median_ms']['before']:.1f} ms (max {max(before) * 1e3:.1f}), after "
          f"freezing {frozen}: {result['median_ms']['after'] * 1e3:.0f} us; a decode step of "
          f"{args.requests} requests {result['decode_step_median_ms']:.1f} ms")


if __name__ == "__main__":
    main()
