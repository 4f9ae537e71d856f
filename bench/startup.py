"""How long an engine takes to start, phase by phase, and what its first requests wait.

    python -m bench.startup --model dummy:deepseek-v3-4l \\
        --serve-flags "--device cuda --dtype bfloat16 --max-model-len 4096 \\
                       --kv-cache-memory-gb 8" --out $OUT/startup.json

Each run is a fresh process building the ``EngineCore`` that ``ferry serve`` builds from
the same flags: ``cold`` with an empty TileLang kernel cache (a new machine), then
``warm`` with the cache the cold run left (every later start). Reported per run: the
engine's start-up phases (``EngineCore.startup``: weights, kernel builds, decode graphs,
warm-up), the kernels the engine's process built or loaded, by program, with their seconds
(those compiled on worker processes count in ``compile`` only), and the time to the first token
of one request after another, each a prompt of a length not seen before (``--prompt-lens``;
one repeated at the end), prefix caching off, the start-up's objects frozen out of the
garbage collector as a worker's are: what a served request waits for beyond its own
prefill when it is the first of its shape.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import machine_info


def child(args: argparse.Namespace) -> dict:
    """Build the engine in this process and time its first requests."""
    import torch

    from engine import heap
    from engine.core import EngineCore
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams
    from kernels._tl import TileLangBuild
    from server.cli import build_parser
    from server.serve import engine_config

    builds: dict[str, list[float]] = collections.defaultdict(list)
    build = TileLangBuild.build

    def timed_build(self):  # this process's builds (loads too) by program, with seconds
        started = time.perf_counter()
        kernel = build(self)
        builds[self.program.__name__].append(time.perf_counter() - started)
        return kernel

    TileLangBuild.build = timed_build
    serve_args = build_parser().parse_args(
        ["serve", "--model", args.model, "--aggregated", *shlex.split(args.serve_flags)]
    )
    config = engine_config(serve_args)
    config = config.replace(cache=config.cache.__class__(
        **{**config.cache.__dict__, "enable_prefix_caching": False}))  # fmt: skip
    started = time.perf_counter()
    core = EngineCore(config)
    total = time.perf_counter() - started
    heap.freeze_startup()  # as a worker does once started (engine.worker.shell)
    pauses = heap.GcPauses().install()
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    firsts = []
    gen = torch.Generator().manual_seed(0)
    profiled = None
    for i, length in enumerate(args.prompt_lens):
        tokens = torch.randint(3, vocab, (length,), generator=gen).tolist()
        with profiler(args.profile_first and i == 0) as prof:
            start = time.perf_counter()
            core.add_request(EngineRequest(f"first-{i}", tokens, params))
            while core.has_work:
                core.step()
            firsts.append({"prompt_len": length, "ttft_ms": (time.perf_counter() - start) * 1e3})
        if prof is not None:
            profiled = top_ops(prof)
    return {
        "startup_s": {"total": total, **core.startup},
        "kernel_builds": {
            k: {"count": len(v), "seconds": sum(v), "max_s": max(v)} for k, v in builds.items()
        },  # fmt: skip
        "first_requests": firsts,
        "first_request_top_ops": profiled,
        "gc_during_first_requests": {"collections": list(pauses.snapshot().collections),
                                     "longest_ms": pauses.snapshot().longest_s * 1e3},  # fmt: skip
    }


@contextlib.contextmanager
def profiler(enabled: bool) -> Iterator[tuple | None]:
    """torch's profiler (CPU and CUDA) and Python's around the block, or nothing."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    python = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        python.enable()
        try:
            yield prof, python
        finally:
            python.disable()


def top_ops(profiled: tuple, n: int = 15) -> dict[str, list]:
    """The ops that took the most host time (self) and the most device time, and the
    Python functions with the most time under them (what an op count cannot show: an
    import, a lazy load)."""
    prof, python = profiled
    events = prof.key_averages()

    def rows(attr: str) -> list:
        ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:n]
        return [[e.key[:80], e.count, round(getattr(e, attr) / 1e3, 2)] for e in ranked]

    stats = pstats.Stats(python).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    ranked = sorted(stats.items(), key=lambda kv: kv[1][3], reverse=True)[: 2 * n]
    functions = [[f"{Path(f).name}:{line}:{name}"[:80], nc, round(ct * 1e3, 2)]
                 for (f, line, name), (_, nc, _, ct, _) in ranked]  # fmt: skip
    return {"self_cpu_ms": rows("self_cpu_time_total"), "device_ms": rows("self_device_time_total"),
            "python_cumulative_ms": functions}  # fmt: skip


def summary(run: dict) -> str:
    phases = " ".join(f"{k} {v:.1f}" for k, v in run["startup_s"].items() if k != "total")
    builds = " ".join(f"{k} {v['count']}x {v['seconds']:.1f}s"
                      for k, v in run["kernel_builds"].items())  # fmt: skip
    firsts = " ".join(f"{f['prompt_len']}:{f['ttft_ms']:.0f}" for f in run["first_requests"])
    return (f"start {run['startup_s']['total']:.1f} s ({phases}) | builds {builds} | "
            f"first TTFT ms {firsts}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:deepseek-v3-4l")
    ap.add_argument("--serve-flags", default="--device cuda --dtype bfloat16")
    ap.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1000, 1100, 1237, 1500, 2000, 3000, 1000])  # fmt: skip
    ap.add_argument("--runs", default="cold,warm", help="cold (empty kernel cache), warm")
    ap.add_argument("--profile-first", action="store_true",
                    help="the first request's top ops by host and device time")  # fmt: skip
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/startup.json"))
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        args.child.write_text(json.dumps(child(args)))
        return
    cache_dir = tempfile.mkdtemp(prefix="ferry-startup-tl-")
    runs = {}
    for run in args.runs.split(","):
        result = Path(cache_dir) / f"{run}.json"
        env = {**os.environ, "TILELANG_CACHE_DIR": cache_dir}
        cmd = [sys.executable, "-m", "bench.startup", "--model", args.model, "--serve-flags",
               args.serve_flags, "--prompt-lens", ",".join(map(str, args.prompt_lens)),
               "--child", str(result)] + ["--profile-first"] * args.profile_first  # fmt: skip
        started = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        runs[run] = {"process_s": time.perf_counter() - started, **json.loads(result.read_text())}
        print(f"{run}: {summary(runs[run])}", flush=True)
    info = machine_info()
    out = {**info, "benchmark": "startup", "commit": args.commit or info["commit"],
           "args": {**vars(args), "out": str(args.out), "child": None}, "runs": runs}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
