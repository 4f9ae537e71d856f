"""Image chat: encoding on an encode worker of its own vs inside the prefill worker, TTFT
at concurrency 1 and 16 with the embedding cache cold and warm, and the images per
second an encode worker computes; one run, each load point one ``ferry bench --workload
images`` run.

    .venv/bin/python bench/images.py [--model dummy:qwen2.5-vl-tiny] [--concurrency 1 16]
        [--num-requests 8 32] [--image-size 448x448] [--serve-flags "..."]
        [--out bench/results/images_cpu.json]

On the GPU machine: ``--model dummy:qwen2.5-vl-7b --serve-flags "--device cuda --dtype
bfloat16 ..."`` (``bench/images_gpu.sh``).

Topologies, each a fresh ``ferry serve`` (1 prefill + 1 decode worker, every prompt
prefilled on the prefill worker: ``--local-prefill-tokens 0``) with a file tier of its
own: ``encode-worker`` (``--encode 1``: the images go to an encode worker, their
embeddings from there into the prefill worker's inbox) and ``in-prefill`` (``--encode
0``: the prefill worker runs the vision tower itself). Each request is one user message:
``--input-len`` words, then one generated image. ``cold``: images no worker has seen;
``warm``: the same images again behind other words (so no prompt prefix is reused past
the chat template's: what is saved is the encoding). The prefill worker has no
embedding cache, so ``in-prefill`` encodes warm images again.

Before any load point, every server of a group answers one image chat with a time limit
of its own (``--warmup-timeout``; on CUDA the first one JIT-compiles TileLang's kernels
for the model's shapes unless their cache was restored): its answer and seconds are
``chat`` in the results, outside every measured point.

Encode throughput: the encode worker's compute seconds (``ferry_encode_compute_seconds``:
decoding, preprocessing, the tower; each image its share of its batch) over the cold
load point at the highest concurrency: images encoded / busy seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.common import machine_info
from bench.pd_serving import ROOT, _ferry, start_serving, wait_serving

TOPOLOGIES = {"encode-worker": ["--encode", "1"], "in-prefill": ["--encode", "0"]}


def bench_point(url: str, concurrency: int, requests: int, args: argparse.Namespace,
                image_seed: int, seed: int, out: Path) -> dict:  # fmt: skip
    """One ``ferry bench --workload images`` run; its summary."""
    cmd = [*_ferry(), "bench", "--url", url, "--workload", "images", "--concurrency",
           str(concurrency), "--num-requests", str(requests), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--image-size",
           args.image_size, "--image-seed", str(image_seed), "--seed", str(seed),
           "--no-progress", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def encode_counters(url: str) -> dict[str, float]:
    """The frontend's encode-pool counters (0 where the pool is absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    names = {"compute_sum": "ferry_encode_compute_seconds_sum",
             "compute_count": "ferry_encode_compute_seconds_count",
             "memory_hits": 'ferry_encode_cache_hits_total{tier="memory"}',
             "file_hits": 'ferry_encode_cache_hits_total{tier="file"}'}  # fmt: skip
    found = {}
    for key, name in names.items():
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        found[key] = float(match.group(1)) if match else 0.0
    return found


def one_chat(url: str, image_seed: int, timeout: float = 120.0) -> dict:
    """One image chat, not streamed: what the server answered (its usage and text)."""
    from bench.load.workloads import WorkloadSpec, build_sessions

    spec = WorkloadSpec("images", 1, input_len=8, image_seed=image_seed)
    messages = list(build_sessions(spec)[0].turns[0].messages)
    model = httpx.get(f"{url}/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, trust_env=False)
    answer = r.json()
    choice = (answer.get("choices") or [{}])[0]
    return {"status": r.status_code, "seconds": time.perf_counter() - started,
            "usage": answer.get("usage"), "error": answer.get("error"),
            "text": choice.get("message", {}).get("content")}  # fmt: skip


def _line(label: str, s: dict) -> str:
    if not s["completed"]:
        return f"{label}: every request failed: {s['errors']}"
    return (f"{label}: ttft p50 {s['ttft_ms']['p50']:.0f} ms, p90 {s['ttft_ms']['p90']:.0f} "
            f"ms, {s['request_throughput']:.2f} req/s, failed {s['failed']}")  # fmt: skip


def run_topology(name: str, url: str, args: argparse.Namespace, tmp: Path,
                 result: dict, save: Callable[[], None]) -> None:  # fmt: skip
    """Every load point of one server into ``result``: cold then warm at each concurrency
    (``save`` after each)."""
    base = int(time.time()) % 100_000 * 100  # image seeds no earlier run used
    bench_point(url, 1, 2, args, base + 99, 99, tmp / f"{name}-warmup.json")
    for c, n in zip(args.concurrency, args.num_requests):
        # words of their own at every point (no prompt prefix reused from another point);
        # warm: the cold point's images again
        for cache, seed in (("cold", 2 * c), ("warm", 2 * c + 1)):
            before = encode_counters(url)
            s = bench_point(url, c, n, args, base + c, seed, tmp / f"{name}-c{c}-{cache}.json")
            after = encode_counters(url)
            s["encode"] = {k: after[k] - before[k] for k in after}
            result[f"c{c}_{cache}"] = s
            print(_line(f"{name} c={c} {cache}", s), flush=True)
            save()


def summarize(results: dict, args: argparse.Namespace) -> dict:
    """Ratios within this run: TTFT p50 in-prefill / encode-worker, warm / cold."""
    out: dict = {}
    top = f"c{max(args.concurrency)}_cold"
    enc = results.get("encode-worker", {}).get(top, {}).get("encode", {})
    if enc.get("compute_sum"):
        out["encode_worker_images_per_busy_s"] = enc["compute_count"] / enc["compute_sum"]
    for c in args.concurrency:
        for cache in ("cold", "warm"):
            key = f"c{c}_{cache}"
            try:
                ttft = {t: results[t][key]["ttft_ms"]["p50"] for t in TOPOLOGIES}
            except KeyError:
                continue
            out[f"{key}_ttft_p50_ms"] = ttft
            out[f"{key}_ttft_in_prefill_over_encode_worker"] = (
                ttft["in-prefill"] / ttft["encode-worker"])  # fmt: skip
        try:
            ours = results["encode-worker"]
            out[f"c{c}_encode_worker_warm_over_cold_ttft"] = (
                ours[f"c{c}_warm"]["ttft_ms"]["p50"] / ours[f"c{c}_cold"]["ttft_ms"]["p50"])
        except KeyError:
            pass
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:qwen2.5-vl-tiny")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-requests", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument("--serve-flags", default="", help="more ferry serve flags, one string")
    parser.add_argument("--together", action="store_true",
                        help="start every topology's server at once (they run side by side)")
    parser.add_argument("--warmup-timeout", type=float, default=120.0,
                        help="seconds the first image chat of each server may take")
    parser.add_argument("--out", default="bench/results/images_cpu.json")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-images-bench-"))
    report = {**machine_info(), "args": vars(args), "topologies": {}, "errors": {}}

    def flags(topo: str) -> list[str]:
        return ["--model", args.model, "--threads", str(args.threads), "--local-prefill-tokens",
                "0", "--kv-dir", str(tmp / f"kv-{topo}"), *TOPOLOGIES[topo],
                *args.serve_flags.split()]  # fmt: skip

    def save() -> None:
        report["summary"] = summarize(report["topologies"], args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    # a time limit's SIGTERM ends the run like an error: servers stopped, results kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    groups = [args.topologies] if args.together else [[t] for t in args.topologies]
    try:
        for group in groups:
            _run_group(group, args, tmp, flags, report, save)
    finally:
        save()
        for topo in args.topologies:  # the file tiers; the servers' logs stay
            shutil.rmtree(tmp / f"kv-{topo}", ignore_errors=True)
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {args.out}")


def _run_group(group: list[str], args: argparse.Namespace, tmp: Path,
               flags: Callable[[str], list[str]], report: dict,
               save: Callable[[], None]) -> None:  # fmt: skip
    """Start the servers of ``group`` together, then measure each in turn."""
    started = time.perf_counter()
    procs = {t: start_serving(flags(t), tmp / f"{t}.log") for t in group}
    try:
        urls = {}
        for topo, proc in procs.items():
            try:  # one topology's failure: the others still run
                urls[topo] = wait_serving(proc, tmp / f"{topo}.log")[1]
                report.setdefault("ready_after_s", {})[topo] = time.perf_counter() - started
                save()
            except Exception as exc:
                _failed(report, topo, exc, tmp)
                save()
        for topo, url in list(urls.items()):  # first chats (kernels compiled): not measured
            started = time.perf_counter()
            try:
                chat = one_chat(url, int(time.time()) % 100_000 * 100 + 98, args.warmup_timeout)
            except Exception as exc:
                _failed(report, topo, exc, tmp)
                del urls[topo]
                save()
                continue
            report["topologies"].setdefault(topo, {})["chat"] = chat
            print(f"{topo}: first image chat {time.perf_counter() - started:.1f} s, HTTP "
                  f"{chat['status']}", flush=True)  # fmt: skip
            save()
        for topo, url in urls.items():
            try:
                run_topology(topo, url, args, tmp, report["topologies"].setdefault(topo, {}),
                             save)  # fmt: skip
            except Exception as exc:
                _failed(report, topo, exc, tmp)
                save()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)


def _failed(report: dict, topo: str, exc: Exception, tmp: Path) -> None:
    log = (tmp / f"{topo}.log").read_text(errors="replace")[-3000:]
    report["errors"][topo] = {"error": f"{type(exc).__name__}: {exc}"[-3000:], "server_log": log}
    print(f"{topo}: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
