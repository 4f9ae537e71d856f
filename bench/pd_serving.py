"""TTFT and ITL of the disaggregated topology (1 prefill + 1 decode) vs the aggregated
engine, measured with ``ferry bench`` at concurrency 1 and 16, in one run.

    .venv/bin/python bench/pd_serving.py [--model default] [--concurrency 1 16]
        [--num-requests 8 32] [--input-len 256] [--output-len 32] [--threads 1]
        [--serve-flags "..."] [--out bench/results/pd_vs_aggregated_cpu.json]

On the GPU machine: ``--model dummy:llama3-8b --topologies aggregated pd-ipc pd-tcp
--serve-flags "--device cuda --dtype bfloat16 ..."`` (shm needs CPU caches; on one GPU
the two workers move KV device to device over CUDA IPC, or over tcp through host memory).

Each topology is a fresh ``ferry serve`` on a free port (``--aggregated`` vs the
default with ``--kv-transport`` shm and tcp); each load point is one ``ferry bench``
run (random workload, streaming chat, ``ignore_eos``), whose summary is kept.

``--baseline DIR`` also serves from another checkout (an older commit, e.g. made with
``git worktree add DIR <commit>``): both servers of a topology run side by side and every
load point is measured on the baseline and then on this checkout, so the two are
compared in one run on the same machine state. Results then go under ``baseline`` and
``current``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine_info, stop_process

ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"ferry: serving (\S+) on (http://\S+)")


def _ferry() -> list[str]:
    script = Path(sys.executable).parent / "ferry"
    return [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]


def serve(flags: list[str], log: Path, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``ferry serve`` from the checkout at ``root``, on a free port."""
    return wait_serving(start_serving(flags, log, root), log)


def start_serving(flags: list[str], log: Path, root: Path = ROOT) -> subprocess.Popen:
    """``ferry serve`` started (``wait_serving``: until it serves)."""
    command = _ferry() if root == ROOT else [sys.executable, "-m", "server.cli"]
    with log.open("wb") as f:
        return subprocess.Popen([*command, "serve", "--port", "0", *flags], stdout=f,
                                stderr=subprocess.STDOUT, cwd=root)  # fmt: skip


def wait_serving(proc: subprocess.Popen, log: Path) -> tuple[subprocess.Popen, str]:
    """The server and its URL once it serves; it is killed if it does not within 300 s."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = _READY.search(log.read_text(errors="replace"))
        if match:
            return proc, match.group(2)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"ferry serve did not start:\n{log.read_text()[-3000:]}")


def bench_point(
    url: str, concurrency: int, requests: int, lens: tuple[int, int], out: Path
) -> dict:
    """One ``ferry bench`` run of ``lens`` = (input, output) tokens; its summary."""
    cmd = [*_ferry(), "bench", "--url", url, "--workload", "random",
           "--concurrency", str(concurrency), "--num-requests", str(requests),
           "--input-len", str(lens[0]), "--output-len", str(lens[1]),
           "--seed", "0", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def _line(label: str, s: dict) -> str:
    """One load point's summary; the errors when no request completed."""
    if not s["completed"]:
        return f"{label}: every request failed: {s['errors']}"
    prompt = s["total_prompt_tokens"] / s["completed"]
    return (f"{label}: ttft p50 {s['ttft_ms']['p50']:.0f} ms, itl p50 {s['itl_ms']['p50']:.1f} "
            f"ms, output {s['output_throughput']:.0f} tok/s, prompt {prompt:.0f} tokens, "
            f"failed {s['failed']}")  # fmt: skip


def _commit(root: Path) -> str:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-requests", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--workloads", nargs="+", default=[],
                        help="INxOUT token lengths, each measured at every concurrency "
                             "(instead of --input-len/--output-len)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--topologies", nargs="+", default=["aggregated", "pd-shm", "pd-tcp"])
    parser.add_argument("--serve-flags", default="", help="more ferry serve flags, one string")
    parser.add_argument("--commit", help="commit to record (default: git's)")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout to measure side by side (an older commit)")
    parser.add_argument("--out", default="bench/results/pd_vs_aggregated_cpu.json")
    parser.add_argument("--logs", type=Path,
                        help="keep each server's log in this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    flags = {
        "aggregated": ["--aggregated"],
        "pd-shm": ["--kv-transport", "shm"],
        "pd-tcp": ["--kv-transport", "tcp"],
        "pd-ipc": [],  # the default on CUDA: cuda_ipc (server.serve.kv_transport)
    }
    workloads = [((args.input_len, args.output_len), "")]  # (lens, tag of the result key)
    if args.workloads:
        workloads = [(tuple(int(v) for v in w.split("x")), f"{w}_") for w in args.workloads]
    points = list(zip(args.concurrency, args.num_requests))
    tmp = Path(tempfile.mkdtemp(prefix="ferry-pd-bench-"))
    report = {**machine_info(), "args": vars(args), "topologies": {}}
    if args.commit:
        report["commit"] = args.commit
    roots = {"current": ROOT} if args.baseline is None else {
        "baseline": args.baseline.resolve(), "current": ROOT}  # fmt: skip
    if args.baseline is not None:
        report["baseline_commit"] = _commit(args.baseline)
    results: dict[str, dict] = {name: {} for name in roots}
    logs = args.logs or tmp
    logs.mkdir(parents=True, exist_ok=True)
    for topo in args.topologies:
        common = ["--model", args.model, "--threads", str(args.threads), *args.serve_flags.split()]
        servers = {name: serve([*common, *flags[topo]], logs / f"{name}-{topo}.log", root)
                   for name, root in roots.items()}  # fmt: skip
        try:
            for name in roots:
                results[name][topo] = {}
            for (lens, tag), (c, n) in itertools.product(workloads, points):
                for name, (_, url) in servers.items():
                    s = bench_point(url, c, n, lens, tmp / f"{name}-{topo}-{tag}c{c}.json")
                    results[name][topo][f"{tag}c{c}"] = s
                    print(_line(f"{name} {topo} {tag}c={c}", s), flush=True)
                    _save(report, results, args)  # after every point: a cut run keeps them
        finally:
            for proc, _ in servers.values():
                stop_process(proc, 60)
    _save(report, results, args)
    print(f"wrote {args.out}")


def _save(report: dict, results: dict, args) -> None:
    if args.baseline is None:
        report["topologies"] = results["current"]
    else:
        report.pop("topologies", None)
        report.update(results)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
