"""ferry's default CPU serving against llama.cpp on the same GGUF, with ``ferry bench``.

    .venv/bin/python -m bench.cpu_vs_llamacpp [--concurrency 1 4 8] [--num-requests 8 16 24]
        [--input-len 128] [--output-len 64] [--ttft-len 512] [--ferry-flags "..."]
        [--out bench/results/cpu_vs_llamacpp.json]

llama-cpp-python 0.3.36 (its OpenAI server) is installed by this script into a venv of
its own, ``~/.cache/ferry/bench/llama-cpp-python-0.3.36`` (built from source: ~10 min on
2 cores, once). Both servers run side by side on the default model's GGUF: ``ferry serve``
with no flags but the port and a file tier of its own (frontend + 1 prefill + 1 decode
worker; the default file tier would serve the prompts of an earlier run, whose seeds are
the same), and llama.cpp with
``--n_threads`` = the machine's cores, ``--n_ctx`` 4096 and ``--interrupt_requests False``
(by default a request arriving while another streams ends that one: at concurrency 4 its
16 requests returned 29 tokens in all; queued, they run one at a time). The load points take turns
(ferry then llama.cpp at each concurrency), so shifting machine load hits both alike;
each point is one ``ferry bench`` run (random workload, streaming chat, ``ignore_eos``,
a seed per point so no prompt repeats between points).

Recorded per server and point: TPOT p50 (the per-stream decode speed; llama.cpp's server
ignores ``ignore_eos``, so its requests may end early and its output tok/s per request is
not comparable), output tok/s, TTFT; a 512-word prompt's TTFT (concurrency 1, output 8);
the RSS and PSS of every process of each server after the load; ferry's time to a healthy
``/health``. Ratios are ferry / llama.cpp from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import machine_info
from bench.pd_serving import ROOT, _ferry
from engine import envs
from engine.loader import default_model_path

LLAMA_CPP = "llama-cpp-python[server]==0.3.36"


def llama_venv() -> Path:
    """The venv holding llama-cpp-python's server, created and installed when missing."""
    venv = Path(envs.user_cache_dir()) / "ferry" / "bench" / "llama-cpp-python-0.3.36"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import llama_cpp.server"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return venv
    print(f"installing {LLAMA_CPP} into {venv} (builds from source, ~10 min)", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LLAMA_CPP], check=True)
    return venv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} did not come up:\n{log.read_text(errors='replace')[-3000:]}")


def start_ferry(flags: list[str], log: Path) -> tuple[subprocess.Popen, str, float]:
    """``ferry serve`` (its own process group); returns it, its URL and seconds to
    a healthy ``/health``."""
    port = _free_port()
    with log.open("wb") as f:
        cmd = [*_ferry(), "serve", "--port", str(port), "--internal-port", "0", *flags]
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return proc, url, _wait_healthy(url + "/health", proc, log, 300)


def start_llama(venv: Path, gguf: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf),
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
           "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--interrupt_requests", "False"]  # fmt: skip
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url + "/v1/models", proc, log, 300)
    return proc, url


def bench_point(url: str, concurrency: int, requests: int, input_len: int, output_len: int,
                seed: int, out: Path) -> dict:  # fmt: skip
    cmd = [*_ferry(), "bench", "--url", url, "--workload", "random",
           "--concurrency", str(concurrency), "--num-requests", str(requests),
           "--input-len", str(input_len), "--output-len", str(output_len),
           "--seed", str(seed), "--no-progress", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def process_memory(pid: int) -> list[dict]:
    """RSS and PSS (MB) of ``pid`` and every descendant, from /proc."""

    def tree(p: int) -> list[int]:
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            return []
        return [p] + [q for c in children for q in tree(int(c))]

    rows = []
    for p in tree(pid):
        fields = {}
        for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) / 1024
        cmd = Path(f"/proc/{p}/cmdline").read_text().split("\0")
        role = next((c for c in cmd if c.split(".")[0] in ("prefill", "decode", "server")), "")
        rows.append({"pid": p, "process": role or Path(cmd[0]).name,
                     "rss_mb": round(fields["Rss"], 1),
                     "pss_mb": round(fields["Pss"], 1)})  # fmt: skip
    return rows


def _summary(s: dict) -> dict:
    return {
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "output_tok_s": s["output_throughput"],
        "completed": s["completed"],
        "failed": s["failed"],
        "output_tokens": s["total_output_tokens"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--num-requests", nargs="+", type=int, default=[8, 16, 24])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-len", type=int, default=512)
    parser.add_argument("--ttft-requests", type=int, default=4)
    parser.add_argument("--ferry-flags", default="", help="more ferry serve flags, one string")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp threads (default: the machine's cores)")  # fmt: skip
    parser.add_argument("--note", default="", help="recorded as is (e.g. machine load)")
    parser.add_argument("--out", default="bench/results/cpu_vs_llamacpp.json")
    args = parser.parse_args(argv)
    venv = llama_venv()
    gguf = default_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="ferry-vs-llamacpp-"))
    report = {"benchmark": "cpu_vs_llamacpp", **machine_info(), "args": vars(args),
              "load_before": os.getloadavg(),
              "servers": {"ferry": {}, "llama.cpp": {}}}  # fmt: skip
    flags = args.ferry_flags.split()
    if "--kv-dir" not in flags:  # a file tier of its own: none of an earlier run's prompts
        flags += ["--kv-dir", str(tmp / "kv")]
    ferry, ferry_url, healthy_s = start_ferry(flags, tmp / "ferry.log")
    report["servers"]["ferry"]["healthy_after_s"] = round(healthy_s, 2)
    llama, llama_url = start_llama(venv, gguf, args.threads, tmp / "llama.log")
    urls = {"ferry": ferry_url, "llama.cpp": llama_url}
    try:
        for name, url in urls.items():  # warm both (first requests pay one-off costs)
            bench_point(url, 1, 2, args.input_len, 8, 999, tmp / f"{name}-warm.json")
        for i, (c, n) in enumerate(zip(args.concurrency, args.num_requests)):
            for name, url in urls.items():
                s = bench_point(url, c, n, args.input_len, args.output_len, 100 + i,
                                tmp / f"{name}-c{c}.json")  # fmt: skip
                report["servers"][name][f"c{c}"] = _summary(s)
                print(f"{name} c={c}: TPOT p50 {s['tpot_ms']['p50']:.1f} ms, output "
                      f"{s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} "
                      f"ms, failed {s['failed']}", flush=True)  # fmt: skip
        for name, url in urls.items():
            s = bench_point(url, 1, args.ttft_requests, args.ttft_len, 8, 200,
                            tmp / f"{name}-ttft.json")  # fmt: skip
            report["servers"][name][f"ttft_{args.ttft_len}"] = _summary(s)
            print(f"{name} TTFT ({args.ttft_len} words): p50 {s['ttft_ms']['p50']:.0f} ms")
        for name, proc in (("ferry", ferry), ("llama.cpp", llama)):
            rows = process_memory(proc.pid)
            report["servers"][name]["memory"] = rows
            report["servers"][name]["rss_total_mb"] = round(sum(r["rss_mb"] for r in rows), 1)
            report["servers"][name]["pss_total_mb"] = round(sum(r["pss_mb"] for r in rows), 1)
    finally:
        for proc in (ferry, llama):
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
    f, ll = report["servers"]["ferry"], report["servers"]["llama.cpp"]
    ratios = {}
    for c in args.concurrency:
        fc, lc = f[f"c{c}"], ll[f"c{c}"]
        ratios[f"c{c}"] = {
            "per_stream_decode (llama TPOT / ferry TPOT)": lc["tpot_p50_ms"] / fc["tpot_p50_ms"],
            "output_tok_s (ferry / llama)": fc["output_tok_s"] / lc["output_tok_s"],
        }
    key = f"ttft_{args.ttft_len}"
    ratios[key] = f[key]["ttft_p50_ms"] / ll[key]["ttft_p50_ms"]
    ratios["rss (ferry / llama)"] = f["rss_total_mb"] / ll["rss_total_mb"]
    report["ratios"] = ratios
    report["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
