"""Router benchmark, three parts in one run:

1. **policies**: ``ferry serve --prefill 2 --decode 2`` once per routing policy, the same
   multi-turn workload each time (``ferry bench``'s generator, greedy answers, so every
   policy sees the same conversations); prefix hit rate (cached / prompt tokens, from
   ``usage``), TTFT p50/p99, output throughput, and their ratios to round-robin measured
   in the same run. Once with the default KV tiers (host memory and the file tier, which
   every worker of the machine reads) and once with ``--kv-tiers none``.
2. **decision**: ``Router.choose`` in-process over a prefix index filled with real KV
   events (hash chains of random token sequences, some prefixes held by several
   workers): wall and CPU time p50/p99 per pool and policy for ~2k-token prompts whose
   prefixes partly hit; the time to hash a prompt; the index's size and memory.
3. **overhead**: the TTFT the frontend adds over the engine alone at concurrency 1:
   ``ferry serve`` over HTTP (streaming, one output token, the same short chat every
   time, so both sides hold the same prefix cache) against an ``EngineCore`` in this
   process stepping the same prompt, request by request in turn. Served aggregated and as
   1 prefill + 1 decode worker (the router's path), with the default model and with
   ``dummy:tiny`` (a forward of a few ms, so the frontend's share stands out). While a
   request is open, every TCP socket of the client, the server and its workers (KV TCP
   transport included) is checked for TCP_NODELAY.

    .venv/bin/python -m bench.router [--parts policies decision overhead]
        [--out bench/results/router.json]

Servers start on free ports, each with its own KV file directory, so no run loads
another's KV files.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.common import machine_info
from bench.load.stats import percentile
from bench.pd_serving import serve
from engine.messages import EngineStats
from kvstore.events import KVEvent
from kvstore.hashing import hash_chain
from router.index import PrefixIndex
from router.policies import POLICIES
from router.routing import Router

PARTS = ("policies", "decision", "overhead")
COMPARED = ("cache_aware", "load_aware", "round_robin")  # part 1; ratios are to the last


def _dist(values_s: list[float], scale: float = 1e3) -> dict[str, float]:
    """p50/p99/mean of values in seconds, scaled (ms by default)."""
    xs = [v * scale for v in values_s]
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "mean": statistics.fmean(xs)}


# -- part 2: decision time ---------------------------------------------------------------------


@dataclasses.dataclass
class FakeWorker:
    """What ``Router.choose`` reads of a worker."""

    name: str
    inflight: int = 0
    queued_tokens: int = 0
    tokens_per_s: float = 0.0
    stats: EngineStats | None = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 49152) for _ in range(n)]


def fill_index(
    index: PrefixIndex, rng: random.Random, workers: list[str], blocks_per_worker: int,
    block_size: int, seq_blocks: int, num_shared: int, shared_blocks: int,
) -> dict[str, list[list[int]]]:  # fmt: skip
    """Store hash chains of random token sequences as ``device`` KV events until each
    worker holds ``blocks_per_worker`` blocks. ``num_shared`` prefixes of
    ``shared_blocks`` blocks are held by 2-8 workers each; half of a worker's own
    sequences continue one of the shared prefixes it holds. Returns every worker's
    sequences (token lists), to build prompts from."""
    shared = [_tokens(rng, shared_blocks * block_size) for _ in range(num_shared)]
    holders = {
        i: rng.sample(workers, min(len(workers), rng.randint(2, 8))) for i in range(num_shared)
    }
    held: dict[str, list[list[int]]] = {w: [] for w in workers}
    for i, ws in holders.items():
        for w in ws:
            held[w].append(shared[i])
    for w in workers:
        mine = [i for i, ws in holders.items() if w in ws]
        seqs = list(held[w])
        count = sum(len(s) // block_size for s in seqs)
        while count < blocks_per_worker:
            n = min(seq_blocks, blocks_per_worker - count)
            if mine and rng.random() < 0.5:
                head = shared[rng.choice(mine)]
                n = max(n, shared_blocks + 1)
                seq = head + _tokens(rng, (n - shared_blocks) * block_size)
                count += n - shared_blocks
            else:
                seq = _tokens(rng, n * block_size)
                count += n
            seqs.append(seq)
        held[w] = seqs
        events = [KVEvent("stored", h) for s in seqs for h in hash_chain(s, block_size)]
        index.apply(w, events)
    return held


def make_prompts(
    rng: random.Random, held: dict[str, list[list[int]]], n: int, prompt_tokens: int,
    block_size: int,
) -> list[list[int]]:  # fmt: skip
    """Prompts of ``prompt_tokens`` tokens: a random-length prefix of a sequence some
    worker holds (none for one prompt in ten), then new tokens."""
    names = sorted(held)
    prompts = []
    for _ in range(n):
        head: list[int] = []
        if rng.random() >= 0.1:
            seq = rng.choice(held[rng.choice(names)])
            blocks = rng.randint(1, min(len(seq), prompt_tokens) // block_size)
            head = seq[: blocks * block_size]
        prompts.append(head + _tokens(rng, prompt_tokens - len(head)))
    return prompts


def _loads(rng: random.Random, names: list[str]) -> list[FakeWorker]:
    workers = []
    for name in names:
        total = 20_000
        used = rng.randint(0, total)
        stats = EngineStats(rng.randint(0, 16), rng.randint(0, 4), used, total)
        workers.append(FakeWorker(name, rng.randint(0, 8), rng.randint(0, 8) * 512,
                                  rng.uniform(800, 1200), stats))  # fmt: skip
    return workers


def _retained_by(snapshot: tracemalloc.Snapshot, files: tuple[str, ...]) -> int:
    """Bytes still allocated by code in ``files`` (the index's dicts and sets, and the block
    hashes it keeps: the events that carried them are gone)."""
    stats = snapshot.statistics("filename")
    return sum(s.size for s in stats if s.traceback[0].filename.endswith(files))


def bench_decision(
    num_workers: int = 16, blocks_per_worker: int = 10_000, prompt_tokens: int = 2048,
    num_prompts: int = 2000, block_size: int = 16, seed: int = 0,
    policies: tuple[str, ...] = tuple(POLICIES),
) -> dict[str, Any]:  # fmt: skip
    """``Router.choose`` time per pool and policy over a filled index (see the module
    docstring); also hashing time per prompt and the index's size."""
    rng = random.Random(seed)
    names = [f"w{i}" for i in range(num_workers)]
    shared_blocks = max(1, min(64, blocks_per_worker // 8, prompt_tokens // block_size // 2))
    num_shared = max(1, blocks_per_worker // shared_blocks // 4)
    seq_blocks = max(shared_blocks + 1, prompt_tokens // block_size)
    tracemalloc.start()
    index = PrefixIndex()
    held = fill_index(index, rng, names, blocks_per_worker, block_size, seq_blocks,
                      num_shared, shared_blocks)  # fmt: skip
    index_bytes = _retained_by(tracemalloc.take_snapshot(), ("router/index.py",
                                                             "kvstore/hashing.py"))  # fmt: skip
    tracemalloc.stop()
    prompts = make_prompts(rng, held, num_prompts, prompt_tokens, block_size)
    del held
    router_hashes = Router("cache_aware", block_size)
    hash_s, chains = [], []
    for p in prompts:
        t = time.perf_counter()
        chains.append(router_hashes.hashes(p))
        hash_s.append(time.perf_counter() - t)
    hit_blocks = [max(index.match(c, names).values()) for c in chains]
    result: dict[str, Any] = {
        "workers": num_workers,
        "blocks_per_worker": blocks_per_worker,
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "prompts": num_prompts,
        "shared_prefixes": {
            "count": num_shared,
            "blocks": shared_blocks,
            "holders": "2-8 workers each",
        },  # fmt: skip
        "index": {
            "distinct_blocks": index.num_blocks(),
            "worker_blocks": sum(index.num_blocks(w) for w in names),
            "memory_mb": round(index_bytes / 2**20, 1),
        },
        "prompt_hit_share": {  # of each prompt's blocks, the most any worker holds
            "mean": statistics.fmean(h / max(1, len(c)) for h, c in zip(hit_blocks, chains)),
            "full_miss": sum(h == 0 for h in hit_blocks) / len(hit_blocks),
        },
        "hash_ms": _dist(hash_s),
        # wall time (what a request waits) and this thread's CPU time (without the time
        # other processes held the core: this machine is shared)
        "choose_us": {},
        "choose_cpu_us": {},
    }
    for policy in policies:
        router = Router(policy, block_size, index=index)
        for role in ("prefill", "decode"):
            wall, cpu = [], []
            for p, c in zip(prompts, chains):
                workers = _loads(rng, names)
                t, tc = time.perf_counter(), time.thread_time()
                router.choose(role, workers, c, len(p))
                cpu.append(time.thread_time() - tc)
                wall.append(time.perf_counter() - t)
            result["choose_us"].setdefault(policy, {})[role] = _dist(wall, 1e6)
            result["choose_cpu_us"].setdefault(policy, {})[role] = _dist(cpu, 1e6)
    return result


# -- part 1: policies on multi-turn traffic ----------------------------------------------------

_SCRAPED = {  # /metrics sample -> key in the result
    "ferry_router_predicted_hit_tokens_total": "router_predicted_hit_tokens",
    "ferry_router_actual_hit_tokens_total": "router_actual_hit_tokens",
    "ferry_router_prefill_retries_total": "prefill_retries",
    "ferry_kv_transfer_blocks_total": "kv_transfer_blocks",
    "ferry_prefix_cache_queries_total": "worker_prefix_query_tokens",
    "ferry_prefix_cache_hits_total": "worker_prefix_hit_tokens",
}


def scrape(url: str) -> dict[str, Any]:
    """Router and KV figures from the server's /metrics (workers' counters are summed)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    out: dict[str, Any] = {"worker_hit_tokens_by_tier": {}}
    decisions = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _SCRAPED:
                out[_SCRAPED[s.name]] = s.value
            elif s.name == "ferry_kv_tier_hit_tokens_total":
                out["worker_hit_tokens_by_tier"][s.labels["tier"]] = s.value
            elif s.name in ("ferry_router_decision_seconds_sum",
                            "ferry_router_decision_seconds_count"):  # fmt: skip
                decisions[s.name.rsplit("_", 1)[1]] = s.value
    if decisions.get("count"):
        out["router_decision_mean_us"] = 1e6 * decisions["sum"] / decisions["count"]
    return out


def bench_policy(policy: str, tiers: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One ``ferry serve --prefill 2 --decode 2`` with ``policy`` and ``--kv-tiers tiers``,
    one multi-turn load."""
    from bench.load.cli import _first_model
    from bench.load.runner import LoadConfig
    from bench.load.stats import SLO
    from bench.load.sweep import run_point
    from bench.load.workloads import WorkloadSpec

    flags = ["--model", args.model, "--threads", str(args.threads), "--prefill", "2",
             "--decode", "2", "--router-policy", policy, "--kv-tiers", tiers]  # fmt: skip
    kv_dir = tmp / f"kv-{policy}-{tiers}"  # the file tier: no run sees another's files
    proc, url = serve([*flags, "--kv-dir", str(kv_dir)], tmp / f"{policy}-{tiers}.log")
    try:
        base = f"{url}/v1"
        spec = WorkloadSpec(
            "multiturn",
            num_requests=args.conversations * args.turns,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            turns=args.turns,
            think_time_s=args.think_time,
        )
        cfg = LoadConfig(chat_url=f"{base}/chat/completions", model=_first_model(base, None),
                         concurrency=args.concurrency, seed=args.seed, progress=False,
                         extra_body={"temperature": 0})  # fmt: skip
        point = run_point(spec, cfg, SLO(), args.warmup)
        metrics = scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    s = point.summary
    return {
        "flags": flags,
        "prefix_hit_rate": s["cache_hit_rate"],
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p99")},
        "output_throughput": s["output_throughput"],
        "failed": s["failed"],
        "summary": s,
        "metrics": metrics,  # the warm-up requests included
    }


def _ratios(runs: dict[str, dict], base: dict) -> dict[str, dict[str, float]]:
    ratio = lambda a, b: a / b if b else math.nan
    return {
        p: {
            "prefix_hit_rate": ratio(r["prefix_hit_rate"], base["prefix_hit_rate"]),
            "ttft_p50": ratio(r["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
            "ttft_p99": ratio(r["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
            "output_throughput": ratio(r["output_throughput"], base["output_throughput"]),
        }
        for p, r in runs.items()
    }


def bench_policies(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": {
            "kind": "multiturn",
            "conversations": args.conversations,
            "turns": args.turns,
            "new_message_words": args.input_len,
            "output_tokens": args.output_len,
            "think_time_s": args.think_time,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "warmup_requests": args.warmup,
            "temperature": 0,
        },  # fmt: skip
    }
    for tiers in args.kv_tiers:
        runs = {}
        for policy in args.policies:
            r = runs[policy] = bench_policy(policy, tiers, args, tmp)
            print(f"kv tiers {tiers}, {policy}: hit rate {r['prefix_hit_rate']:.3f}, TTFT p50 "
                  f"{r['ttft_ms']['p50']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, "
                  f"{r['output_throughput']:.2f} tok/s, failed {r['failed']}",
                  flush=True)  # fmt: skip
        out[f"kv_tiers={tiers}"] = variant = {"runs": runs}
        if "round_robin" in runs:
            variant["vs_round_robin"] = _ratios(runs, runs["round_robin"])
    return out


# -- part 3: frontend overhead -----------------------------------------------------------------

_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # the same on every Linux architecture


def _process_tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in pids:
            continue
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def tcp_sockets(pid: int) -> list[dict[str, Any]]:
    """Every TCP socket of process ``pid`` and its descendants, with its TCP_NODELAY
    flag, read through duplicates of their descriptors (``pidfd_getfd``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    found, seen = [], set()
    for p in _process_tree(pid):
        pidfd = libc.syscall(_SYS_PIDFD_OPEN, p, 0)
        if pidfd < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_open({p})")
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if not link.startswith("socket:") or link in seen:
                    continue  # a socket open twice (a dup, or inherited) is looked at once
                seen.add(link)
                dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
                if dup < 0:
                    raise OSError(ctypes.get_errno(), f"pidfd_getfd({p}, {fd})")
                with socket.socket(fileno=dup) as s:
                    if s.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    if s.type != socket.SOCK_STREAM:
                        continue
                    listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
                    found.append({
                        "pid": p, "local": _addr(s.getsockname()),
                        "peer": None if listening else _addr(s.getpeername()),
                        "listening": listening,
                        "nodelay": bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
                    })  # fmt: skip
        finally:
            os.close(pidfd)
    return found


def _cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``pid`` (``frontend``) and its
    descendants, summed by their module (``engine.core``, ``decode.worker``, ...)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in _process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        module = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == b"-m"]
        name = "frontend" if p == pid else (module[0].decode() if module else str(p))
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _addr(address: tuple) -> str:
    return f"{address[0]}:{address[1]}"


def _nodelay_report(sockets: list[dict[str, Any]]) -> dict[str, Any]:
    conns = [s for s in sockets if not s["listening"]]
    return {"connections": len(conns), "all_nodelay": all(s["nodelay"] for s in conns),
            "sockets": sockets}  # fmt: skip


def _serve_args(flags: list[str]) -> argparse.Namespace:
    from server.serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


async def _first_token(client, url: str, body: dict) -> tuple[float, dict]:
    """Seconds from sending ``body`` to the first chunk holding a token, and the usage.

    A chunk holds a token when it has content or a finish reason: with one output token
    the two come together, and a random-weight model's token may stream no text."""
    t0 = time.perf_counter()
    first, usage = None, {}
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or ():
                if first is None and ((c.get("delta") or {}).get("content") or
                                      c.get("finish_reason")):  # fmt: skip
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream held no token")
    return first, usage


async def _overhead_pairs(
    url: str, server_pid: int, core, messages: list[dict], prompt: list[int], args
) -> dict[str, Any]:
    """Alternate: one request over HTTP, then the same prompt stepped in-process. Then one
    more request, during which the TCP sockets of this process and its descendants (the
    client, the server and its workers) are looked at."""
    import httpx

    from bench.load.cli import _first_model
    from bench.load.runner import LoadConfig, request_body
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams

    base = f"{url}/v1"
    cfg = LoadConfig(chat_url=f"{base}/chat/completions", model=_first_model(base, None),
                     concurrency=1, extra_body={"temperature": 0})  # fmt: skip
    body = request_body(cfg, messages, args.overhead_tokens, {})
    sampling = SamplingParams(temperature=0, max_tokens=args.overhead_tokens, ignore_eos=True)
    out: dict[str, Any] = {"http": [], "engine": [], "prompt_tokens": [], "cached_tokens": []}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for i in range(args.overhead_warmup + args.overhead_repeats):
            if i == args.overhead_warmup:
                cpu = _cpu_s(server_pid)
            ttft, usage = await _first_token(client, cfg.chat_url, body)
            first = None
            start = time.perf_counter()
            if core.add_request(EngineRequest(f"o{i}", prompt, sampling)) is not None:
                raise RuntimeError("the in-process engine refused the prompt")
            while core.has_work:
                outs = core.step()
                if first is None and any(o.new_token_ids for o in outs):
                    first = time.perf_counter() - start
            if i >= args.overhead_warmup:
                out["http"].append(ttft)
                out["engine"].append(first)
                out["prompt_tokens"].append(usage.get("prompt_tokens"))
                details = usage.get("prompt_tokens_details") or {}
                out["cached_tokens"].append(details.get("cached_tokens") or 0)
        n = args.overhead_repeats
        out["cpu_ms"] = {k: (v - cpu.get(k, 0.0)) * 1e3 / n for k, v in _cpu_s(server_pid).items()}
        async with client.stream("POST", cfg.chat_url, json=body) as resp:
            out["sockets"] = tcp_sockets(os.getpid())
            await resp.aread()
    return out


TOPOLOGIES = {  # part 3: what serves the HTTP requests
    "aggregated": ["--aggregated"],  # the frontend and one engine process
    # the router's path: the frontend picks the decode worker, which computes the short
    # uncached tail itself; KV of longer prompts moves over the KV TCP transport
    "pd": ["--prefill", "1", "--decode", "1", "--kv-transport", "tcp"],
}


def _move_kv(url: str, n: int, seed: int) -> float:
    """Send ``n`` unique prompts too long for a decode worker to compute itself, so a
    prefill worker ships their KV; the KV blocks moved so far."""
    import httpx

    from bench.load.cli import _first_model

    model = _first_model(f"{url}/v1", None)
    rng = random.Random(seed)
    for i in range(n):
        words = " ".join(str(rng.randrange(10**6)) for _ in range(48))
        body = {"model": model, "max_tokens": 2,
                "messages": [{"role": "user", "content": f"{i}: {words}"}]}  # fmt: skip
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False)
        r.raise_for_status()
    return scrape(url).get("kv_transfer_blocks", 0.0)


def bench_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """TTFT over HTTP vs the same engine in this process, per model and served topology."""
    return {model: _overhead(model, args, tmp) for model in args.overhead_models}


def _overhead(model: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import asyncio

    from engine.core import EngineCore
    from server.serve import engine_config

    common = ["--model", model, "--threads", str(args.threads)]
    tag = model.replace(":", "-")
    config = engine_config(_serve_args([*common, "--kv-dir", str(tmp / f"kv-{tag}-engine")]))
    core = EngineCore(config)
    messages = [{"role": "user", "content": "Say hello."}]
    render_s = []
    for _ in range(args.overhead_repeats):
        t = time.perf_counter()
        text = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = core.tokenizer.encode(text, add_special_tokens=False)
        render_s.append(time.perf_counter() - t)
    out: dict[str, Any] = {
        "messages": messages,
        "prompt_tokens": len(prompt),
        "max_tokens": args.overhead_tokens,
        "repeats": args.overhead_repeats,
        # part of the frontend's share: the chat template and tokenizing the prompt
        "chat_template_and_tokenize_ms": _dist(render_s[1:] or render_s),
    }
    for topo in args.topologies:
        flags = [*common, *TOPOLOGIES[topo]]
        kv_dir = str(tmp / f"kv-{tag}-{topo}")
        proc, url = serve([*flags, "--kv-dir", kv_dir], tmp / f"{tag}-{topo}.log")
        try:
            moved = _move_kv(url, 3, args.seed) if "--kv-transport" in flags else None
            pairs = asyncio.run(_overhead_pairs(url, proc.pid, core, messages, prompt, args))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        if set(pairs["prompt_tokens"]) != {len(prompt)}:
            raise RuntimeError(f"served prompt: {pairs['prompt_tokens'][:3]} tokens, "
                               f"in-process: {len(prompt)}")  # fmt: skip
        http, engine = _dist(pairs["http"]), _dist(pairs["engine"])
        paired = [(h - e) * 1e3 for h, e in zip(pairs["http"], pairs["engine"])]
        out[topo] = {
            "flags": flags,
            "cached_tokens_served": statistics.median(pairs["cached_tokens"]),
            "http_ttft_ms": http,
            "engine_ttft_ms": engine,
            "added_ms_p50": http["p50"] - engine["p50"],
            "added_ms_paired_p50": percentile(paired, 50),
            # the server's own work per request (CPU clock ticks over the measured requests)
            "server_cpu_ms_per_request": pairs["cpu_ms"],
            "tcp_nodelay": _nodelay_report(pairs["sockets"]),
        }
        if moved is not None:
            out[topo]["kv_transfer_blocks"] = moved
    return out


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("policies")
    g.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(COMPARED))
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--input-len", type=int, default=64, help="words of each new user message")
    g.add_argument("--output-len", type=int, default=16)
    g.add_argument("--think-time", type=float, default=0.5)
    g.add_argument("--warmup", type=int, default=8, help="unrecorded requests (other prompts)")
    g.add_argument("--kv-tiers", nargs="+", default=["host,file", "none"],
                   help="--kv-tiers of each set of runs: with the file tier every worker can "
                        "load what any worker computed")  # fmt: skip
    g = parser.add_argument_group("decision")
    g.add_argument("--workers", type=int, default=16)
    g.add_argument("--blocks-per-worker", type=int, default=10_000)
    g.add_argument("--prompt-tokens", type=int, default=2048)
    g.add_argument("--decisions", type=int, default=2000, help="prompts routed per pool")
    g = parser.add_argument_group("overhead")
    g.add_argument("--topologies", nargs="+", choices=sorted(TOPOLOGIES), default=list(TOPOLOGIES))
    g.add_argument("--overhead-models", nargs="+", default=["default", "dummy:tiny"],
                   help="dummy:tiny: a forward of about a millisecond, so the frontend's "
                        "share is not lost in the noise of the model's")  # fmt: skip
    g.add_argument("--overhead-repeats", type=int, default=100)
    g.add_argument("--overhead-warmup", type=int, default=5)
    g.add_argument("--overhead-tokens", type=int, default=1, help="max_tokens")
    parser.add_argument("--out", default="bench/results/router.json")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-router-bench-"))
    report: dict[str, Any] = {**machine_info(), "args": vars(args)}
    try:
        if "decision" in args.parts:
            report["decision"] = d = bench_decision(
                args.workers, args.blocks_per_worker, args.prompt_tokens, args.decisions,
                seed=args.seed,
            )  # fmt: skip
            ca = d["choose_us"]["cache_aware"]
            print(f"decision (cache_aware): prefill p50 {ca['prefill']['p50']:.0f} us p99 "
                  f"{ca['prefill']['p99']:.0f} us; index {d['index']['memory_mb']} MB",
                  flush=True)  # fmt: skip
        if "overhead" in args.parts:
            report["overhead"] = o = bench_overhead(args, tmp)
            for model, topo in itertools.product(args.overhead_models, args.topologies):
                t = o[model][topo]
                print(f"{model} {topo}: the frontend adds {t['added_ms_p50']:.1f} ms (TTFT p50 "
                      f"{t['http_ttft_ms']['p50']:.1f} vs {t['engine_ttft_ms']['p50']:.1f} ms "
                      f"in-process); TCP_NODELAY on all {t['tcp_nodelay']['connections']} "
                      f"connections: {t['tcp_nodelay']['all_nodelay']}", flush=True)  # fmt: skip
        if "policies" in args.parts:
            report["policies"] = bench_policies(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from bench.load.sweep import write_json

    write_json(Path(args.out), report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
