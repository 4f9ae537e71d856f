"""Multi-turn TTFT over the KV tiers, and the file tier's throughput against ``dd``, in one run.

    .venv/bin/python -m bench.kv_tiers [--conversations 10] [--turns 8] [--threads 1]
        [--dir DIR] [--out bench/results/kv_tiers.json]

**TTFT.** The default model (SmolLM2-135M, CPU) runs in this process (``EngineCore``).
Conversations take turns: turn 1 of every conversation, then turn 2 of every one, and so
on, each turn sending the whole conversation so far (the model's greedy answers
included) plus a new user message, one request at a time. The device KV cache is small
(``--device-blocks``, about one conversation), so by the time a conversation returns its
prefix has left the device cache. Configurations, each its own engine (and file
directory), all in this process; every request runs on each engine in turn, so changes
in the machine's load hit them alike:

- ``no_cache``: prefix caching off, every prompt computed in full;
- ``device``: the device cache only;
- ``device+host``: a host-memory tier that holds every conversation (``--host-blocks``);
- ``device+file``: the file tier and no host tier, so returning prefixes come from files;
- ``device+host+file``: a host tier smaller than the conversations
  (``--small-host-blocks``) above the file tier: the deployment shape where host memory
  runs out.

TTFT is the time from ``add_request`` to the step that yields the request's first token.
Every configuration's greedy answers are compared with ``no_cache``'s.

**Throughput.** ``--io-blocks`` blocks of the default model's layout (720 KiB each) are
written through a ``FileTier`` (queue, checksum, temporary file, rename) and read back
(read, checksum, header check, copy into KV cache blocks, 32 blocks at a time) in
``--dir``, against ``dd`` writing and reading the same
number of bytes in the same directory (bs=1M). Neither syncs. Reads are measured warm (in
the page cache, right after writing) and cold (after fsync + ``POSIX_FADV_DONTNEED`` on
exactly those files). Figures are medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv_cache.tiered import block_meta
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hash
from kvstore.tiers import FileTier, TierEvents

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
_READ_BATCH = 32  # blocks read per prefix hit in the throughput test (512 tokens)

_WORD_TEXT = (
    "the harbour boat tide wind morning evening captain crew ferry island coast river "
    "bridge market town village road lantern rope sail anchor cargo fish salt bread map "
    "journey weather storm calm north south east west winter summer spring autumn light "
    "shadow stone wood iron silver letter story question answer reason plan engine wheel "
    "garden field forest mountain valley cloud rain snow sun moon star night day year "
    "friend teacher doctor farmer trader sailor child family house window door table book"
)
_WORDS = _WORD_TEXT.split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_WORDS, k=n))


def conversations(n: int, turns: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """(system prompt, user messages) of each conversation."""
    rng = random.Random(seed)
    return [
        (f"You are assistant number {i}. Background: {_text(rng, 120)}",
         [f"Turn {t}: {_text(rng, 40)}?" for t in range(turns)])
        for i in range(n)
    ]  # fmt: skip


def _engine(args, threads: int, **cache) -> EngineCore:
    config = EngineConfig(
        num_threads=threads,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.device_blocks, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096),
    )
    return EngineCore(config)


def _run_request(core: EngineCore, rid: str, prompt: list[int], sp: SamplingParams):
    start = time.perf_counter()
    err = core.add_request(EngineRequest(rid, prompt, sp))
    if err is not None:
        raise RuntimeError(err.error)
    ttft, tokens, cached = None, [], 0
    while core.has_work:
        for out in core.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return ttft, tokens, cached


class Run:
    """One configuration's engine and conversations, advanced one request at a time."""

    def __init__(self, name: str, core: EngineCore, convs, max_tokens: int) -> None:
        self.name, self.core = name, core
        self.sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.users = [users for _, users in convs]
        self.history = [[{"role": "system", "content": system}] for system, _ in convs]
        self.records: list[dict] = []

    def turn(self, c: int, turn: int) -> None:
        tok = self.core.tokenizer
        self.history[c].append({"role": "user", "content": self.users[c][turn]})
        text = tok.apply_chat_template(self.history[c], add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        ttft, tokens, cached = _run_request(self.core, f"{self.name}-{c}-{turn}", prompt, self.sp)
        self.history[c].append({"role": "assistant", "content": tok.decode(tokens)})
        self.records.append({
            "conversation": c, "turn": turn, "prompt_tokens": len(prompt),
            "cached_tokens": cached, "ttft_s": ttft, "output": tokens,
        })  # fmt: skip

    def finish(self) -> dict:
        if self.core.kv.tiers is not None:
            self.core.kv.tiers.close()
        self.core.check_integrity()
        return {"records": self.records, "stats": _tier_stats(self.core)}


def _tier_stats(core: EngineCore) -> dict:
    s = core.scheduler.stats()
    return {k: getattr(s, k) for k in (
        "prefix_query_tokens", "prefix_hit_tokens", "prefix_hit_tokens_device",
        "prefix_hit_tokens_host", "prefix_hit_tokens_file", "kv_host_evictions",
        "kv_file_bytes_read", "kv_file_bytes_written", "kv_file_writes_dropped",
    )}  # fmt: skip


def summarize(result: dict, reference: list[dict] | None) -> dict:
    recs = result["records"]
    ms = np.array([r["ttft_s"] for r in recs]) * 1000
    later = np.array([r["ttft_s"] for r in recs if r["turn"] > 0]) * 1000
    prompt = sum(r["prompt_tokens"] for r in recs)
    out = {
        "ttft_p50_ms": round(float(np.percentile(ms, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
        "ttft_mean_ms": round(float(ms.mean()), 1),
        "returning_turns_ttft_p50_ms": round(float(np.percentile(later, 50)), 1),
        "returning_turns_ttft_p99_ms": round(float(np.percentile(later, 99)), 1),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r["cached_tokens"] for r in recs),
        "cached_share": round(sum(r["cached_tokens"] for r in recs) / prompt, 3),
        **result["stats"],
    }
    if reference is not None:
        out["outputs_match_no_cache"] = all(
            a["output"] == b["output"] for a, b in zip(recs, reference, strict=True)
        )
    return out


# -- file tier throughput vs dd -------------------------------------------------------------------


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - start


def file_throughput(directory: Path, core: EngineCore, n_blocks: int) -> dict:
    meta = block_meta(core.kv_cache, core.model_config.fingerprint)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(meta.block_shape, generator=gen) for _ in range(n_blocks)]
    hashes = [block_hash(b"\0" * 16, [i]) for i in range(n_blocks)]
    nbytes = n_blocks * meta.payload_bytes
    base = directory / f"io-{os.getpid()}-{time.monotonic_ns()}"
    try:
        writer = FileTier(base, meta, 1 << 40, 3600.0, TierEvents(),
                          max_pending_bytes=2 * nbytes)  # fmt: skip
        start = time.perf_counter()
        for h, b in zip(hashes, blocks, strict=True):
            writer.put(h, b)
        writer.flush()
        write_s = time.perf_counter() - start
        writer.close()
        files = [writer.path(h) for h in hashes]

        cache = torch.empty((meta.num_layers, _READ_BATCH, *meta.block_shape[1:]))

        def read_all() -> float:
            """As prefix hits load: a batch of blocks read and verified, then copied into
            KV cache blocks, their buffers recycled for the next batch."""
            reader = FileTier(base, meta, 1 << 40, 3600.0, TierEvents())
            time.sleep(0.1)  # let its start-up scan of the directory finish
            start = time.perf_counter()
            for i in range(0, len(hashes), _READ_BATCH):
                got = [reader.load(h) for h in hashes[i : i + _READ_BATCH]]
                for j, block in enumerate(got):
                    cache[:, j].copy_(block)
                    reader.recycle(block)
            took = time.perf_counter() - start
            reader.close()
            return took

        warm_s = read_all()
        _drop_cache(files)
        cold_s = read_all()
        mb = -(-nbytes // (1 << 20))
        dd_file = base / "dd.bin"
        dd_write_s = _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={mb}"])
        dd_warm_s = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])
        _drop_cache([dd_file])
        dd_cold_s = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])
        dd_bytes = mb << 20
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gbps = lambda n, s: n / s / 1e9  # noqa: E731
    return {
        "tier_write": gbps(nbytes, write_s), "dd_write": gbps(dd_bytes, dd_write_s),
        "tier_read_warm": gbps(nbytes, warm_s), "dd_read_warm": gbps(dd_bytes, dd_warm_s),
        "tier_read_cold": gbps(nbytes, cold_s), "dd_read_cold": gbps(dd_bytes, dd_cold_s),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_tiers")
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="answer length per turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--device-blocks", type=int, default=64, help="device KV cache, in blocks")
    p.add_argument("--host-blocks", type=int, default=640, help="host tier holding everything")
    p.add_argument("--small-host-blocks", type=int, default=128)
    p.add_argument("--io-blocks", type=int, default=256, help="blocks per throughput run")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs (median)")
    p.add_argument("--dir", type=Path, default=None, help="parent of the file tiers' "
                   "directories (default: ~/.cache/ferry)")  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_tiers.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)

    parent = args.dir or Path(os.path.expanduser("~/.cache/ferry"))
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kv-tiers-bench-", dir=parent))
    convs = conversations(args.conversations, args.turns)
    try:
        probe = _engine(args, args.threads)
        per_block = probe.kv_cache.layout.bytes_per_block
        to_gb = lambda blocks: blocks * per_block / 2**30  # noqa: E731
        configs = {
            "no_cache": {"enable_prefix_caching": False},
            "device": {},
            "device+host": {"host_memory_gb": to_gb(args.host_blocks)},
            "device+file": {"kv_dir": str(work / "device+file")},
            "device+host+file": {"host_memory_gb": to_gb(args.small_host_blocks),
                                 "kv_dir": str(work / "device+host+file")},
        }  # fmt: skip
        print("file tier throughput vs dd ...", flush=True)
        runs = [file_throughput(work, probe, args.io_blocks) for _ in range(args.repeats)]
        throughput = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        del probe
        runs = [Run(name, _engine(args, args.threads, **cache), convs, args.max_tokens)
                for name, cache in configs.items()]  # fmt: skip
        for turn in range(args.turns):  # every request runs on each engine in turn, so
            for c in range(args.conversations):  # load changes hit them all alike
                for run in runs:
                    run.turn(c, turn)
            print(f"turn {turn + 1}/{args.turns} done", flush=True)
        results, reference = {}, None
        for run in runs:
            res = run.finish()
            results[run.name] = summarize(res, reference)
            reference = reference or res["records"]
            print(f"{run.name}: {json.dumps(results[run.name])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {
        **machine_info(),
        "benchmark": "kv_tiers",
        "model": "SmolLM2-135M-Instruct (default GGUF), CPU float32",
        "setup": {
            "conversations": args.conversations, "turns": args.turns,
            "max_tokens": args.max_tokens, "block_size": BLOCK_SIZE,
            "block_bytes": per_block, "device_blocks": args.device_blocks,
            "host_blocks": args.host_blocks, "small_host_blocks": args.small_host_blocks,
            "threads": args.threads, "io_blocks": args.io_blocks, "repeats": args.repeats,
            "filesystem": _filesystem(parent),
        },
        "ttft": results,
        "file_throughput_gbps": throughput,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"ttft": {k: {m: v[m] for m in ("ttft_p50_ms", "ttft_p99_ms",
                      "cached_share")} for k, v in results.items()},
                      "file_throughput_gbps": throughput}, indent=2))  # fmt: skip


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout
        return re.split(r"\s+", out.splitlines()[1])[1]
    except (OSError, IndexError):
        return "unknown"


if __name__ == "__main__":
    main()
