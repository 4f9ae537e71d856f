"""Start-up of ``ferry serve --decode-ep N``: the time from the command to ``/ready``, and
each decode rank's own start split into phases.

    python -m bench.ep_startup [--ranks 1,2,4] [--model dummy:deepseek-v3-tiny] [--device cpu]

For each N, ``ferry serve --port 0 --decode-ep N`` (one prefill worker, one decode group)
is started twice: once cold, once again right after (what a restart costs, compiled
kernels cached). Reported per run: seconds to ``/ready`` answering 200, and from
``/health`` the slowest decode rank's phases as its ready message gives them
(``WorkerReady.startup``: ``process`` interpreter and imports, ``group`` meeting the other
ranks, ``weights``, ``compile`` the first forward's kernels, ``graphs`` CUDA graph
capture).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import machine_info, stop_process

_SERVING = re.compile(r"^ferry: serving \S+ on (http://\S+)$", re.MULTILINE)


def start_once(ranks: int, model: str, device: str, timeout: float) -> dict:
    """One start of ``ferry serve --decode-ep ranks``; stopped once measured."""
    command = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--model", model,
               "--device", device, "--decode-ep", str(ranks), "--kv-tiers", "none",
               "--threads", "1", "--no-restart-workers"]  # fmt: skip
    with tempfile.NamedTemporaryFile("w+b", suffix=".log") as log:
        started = time.monotonic()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = None
            while time.monotonic() - started < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"ferry serve exited: {Path(log.name).read_text()[-2000:]}")
                if url is None:
                    found = _SERVING.search(Path(log.name).read_text(errors="replace"))
                    url = found.group(1) if found else None
                elif httpx.get(f"{url}/ready", timeout=10).status_code == 200:
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError(f"not ready after {timeout:.0f} s")
            ready = time.monotonic() - started
            health = httpx.get(f"{url}/health", timeout=10).json()
        finally:
            stop_process(proc, 60)
    decode = [w for w in health["workers"] if w["role"] == "decode"]
    phases: dict[str, float] = {}
    for worker in decode:
        for phase, seconds in worker.get("startup", {}).items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    return {"ready_s": ready, "decode_ranks": len(decode), "slowest_rank_phases_s": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--model", default="dummy:deepseek-v3-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--commit", help="commit to record (default: git's)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    runs = []
    for ranks in (int(n) for n in args.ranks.split(",")):
        for start in ("cold", "again"):
            try:
                run = start_once(ranks, args.model, args.device, args.timeout)
            except Exception as exc:  # one failed start is reported, the others still run
                run = {"error": f"{type(exc).__name__}: {exc}"}
            runs.append({"ranks": ranks, "start": start, **run})
            print(json.dumps(runs[-1]), flush=True)
    info = machine_info()
    if args.commit:
        info["commit"] = args.commit
    record = {"benchmark": "ep_startup", **info, "model": args.model, "device": args.device,
              "runs": runs}  # fmt: skip
    out = Path(args.out or f"bench/results/ep_startup_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
