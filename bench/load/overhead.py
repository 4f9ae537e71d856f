"""The load generator's own cost, measured against the fake server (``fake_server.py``).

    python -m bench.load.overhead [--out bench/results/bench_overhead.json]

The fake server runs in a subprocess on one CPU, the generator on another (when the
machine has two). Two measurements:

- *timing error*: the server waits exactly ``itl_ms`` between chunks and sends the first
  at once, so any measured TTFT and any ITL above ``itl_ms`` is the generator's (and
  the loopback's) doing; reported as p50/p99 excess per concurrency and per
  ``streams_per_client`` (one shared client vs a pool);
- *ceiling*: the server sends as fast as it can (``itl_ms=0``); the generator's chunk
  rate is then its maximum, i.e. the CPU it spends per streamed chunk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.load.runner import LoadConfig, run_load
from bench.load.stats import summarize
from bench.load.workloads import WorkloadSpec, build_sessions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fake_server(itl_ms: float, cpu: int | None = None) -> Iterator[str]:
    """A fake server subprocess (pinned to ``cpu`` if given); yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.load.fake_server", "--port", str(port)]
    cmd += ["--itl-ms", str(itl_ms)]
    proc = subprocess.Popen(cmd, preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu
                            is not None else None)  # fmt: skip
    try:
        _wait_port(port)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"fake server did not listen on port {port}")


def measure(url: str, concurrency: int, per_client: int, n: int, out_len: int) -> dict:
    spec = WorkloadSpec("random", num_requests=n, input_len=32, output_len=out_len)
    cfg = LoadConfig(
        chat_url=f"{url}/chat/completions", model="fake-model", concurrency=concurrency,
        streams_per_client=per_client, progress=False,
    )  # fmt: skip
    run = run_load(build_sessions(spec), cfg)
    s = summarize(run.results, run.duration_s)
    chunks = sum(len(r.itl_s) + 1 for r in run.results if r.ok)
    return {
        "concurrency": concurrency, "streams_per_client": per_client,
        "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"], "failed": s["failed"],
        "chunks_per_s": chunks / run.duration_s,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description="measure the load generator's own overhead")
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    two_cpus = len(os.sched_getaffinity(0)) >= 2
    if two_cpus:
        os.sched_setaffinity(0, {0})
    rows = []
    with fake_server(args.itl_ms, 1 if two_cpus else None) as url:
        for c, per in ((1, 16), (16, 16), (64, 16), (64, 64)):
            rows.append({"itl_ms_set": args.itl_ms, **measure(url, c, per, max(8, 4 * c), 32)})
            _show(rows[-1])
    with fake_server(0.0, 1 if two_cpus else None) as url:
        for c in (1, 16):
            rows.append({"itl_ms_set": 0.0, **measure(url, c, 16, max(32, 4 * c), 128)})
            _show(rows[-1])
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def _show(r: dict) -> None:
    print(
        f"itl_set={r['itl_ms_set']:>4g}ms c={r['concurrency']:>3} per_client="
        f"{r['streams_per_client']:>3}  TTFT p50/p99 {r['ttft_ms']['p50']:7.2f}/"
        f"{r['ttft_ms']['p99']:7.2f} ms  ITL p50/p99 {r['itl_ms']['p50']:7.2f}/"
        f"{r['itl_ms']['p99']:7.2f} ms  {r['chunks_per_s']:8.0f} chunks/s"
    )


if __name__ == "__main__":
    main()
