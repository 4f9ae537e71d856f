"""The file tier across real processes: ``ferry serve`` restarted on the same ``--kv-dir``
serves a long prompt's prefix from files (same greedy text, shorter TTFT), and with two
decode workers one loads what the other wrote. Tier metrics come out of /metrics."""

from __future__ import annotations

import time

import httpx
import msgspec
from conftest import assert_sound
from helpers import metric, wait_for_files

from engine.messages import EngineStats
from server.metrics import Metrics

TOPIC = (
    "Ferries have crossed the same narrow waters for centuries, carrying farmers, traders "
    "and soldiers, and every harbour along the coast kept its own records of the boats, "
    "the tides and the weather of each season. "
)
PROMPT = " ".join(f"Chapter {i}. {TOPIC}" for i in range(24)) + "\nSummarise the story:"


def complete(server, prompt: str, max_tokens: int = 12) -> dict:
    """One streamed greedy completion: text, usage and time to the first token."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, usage, ttft = "", None, None
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.v1}/completions", json=body, headers=server.headers,
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = msgspec.json.decode(line[6:])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            for choice in chunk["choices"]:
                text += choice.get("text") or ""
            usage = chunk.get("usage") or usage
    return {"text": text, "ttft": ttft, "usage": usage,
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


def test_restarted_server_serves_the_prompt_from_the_file_tier(tmp_path, serve):
    kv_dir = tmp_path / "kv"
    flags = ("--threads", "1", "--kv-dir", str(kv_dir))
    with serve(tmp_path / "cold.log", *flags) as s:
        complete(s, "Hello there", 2)  # warm-up: the first request pays one-off costs
        cold = complete(s, PROMPT)
        assert cold["cached"] == 0
        full_blocks = cold["usage"]["prompt_tokens"] // 16
        wait_for_files(kv_dir, full_blocks)
    with serve(tmp_path / "warm.log", *flags) as s:
        complete(s, "Hello there", 2)
        warm = complete(s, PROMPT)
        assert metric(s, "ferry_kv_tier_hit_tokens_total", tier="file") >= warm["cached"] - 16
        assert metric(s, "ferry_kv_tier_read_bytes_total", tier="file") > 0
        assert metric(s, "ferry_kv_file_checksum_failures_total") == 0
    assert warm["text"] == cold["text"]
    assert warm["cached"] >= (full_blocks - 1) * 16  # whole blocks, the last token recomputed
    assert warm["ttft"] < cold["ttft"], (warm["ttft"], cold["ttft"])
    assert not list(kv_dir.rglob("*.tmp"))


def test_a_decode_worker_loads_the_prefix_another_one_wrote(tmp_path, serve):
    kv_dir = tmp_path / "kv"
    # decode workers prefill everything themselves, so the only writer is the first of
    # them; round-robin sends the repeat to the other one (cache-aware would not)
    flags = ("--threads", "1", "--kv-dir", str(kv_dir), "--kv-tiers", "file", "--decode", "2",
             "--local-prefill-tokens", "100000", "--router-policy", "round_robin")  # fmt: skip
    with serve(tmp_path / "serve.log", *flags) as s:
        first = complete(s, PROMPT)  # round-robin: decode worker 0
        assert first["cached"] == 0
        wait_for_files(kv_dir, first["usage"]["prompt_tokens"] // 16)
        assert metric(s, "ferry_kv_tier_hit_tokens_total", tier="file") == 0
        second = complete(s, PROMPT)  # decode worker 1, which never saw the prompt
        file_hits = metric(s, "ferry_kv_tier_hit_tokens_total", tier="file")
        assert metric(s, "ferry_kv_tier_hit_tokens_total", tier="device") == 0
        assert_sound(s)
    assert second["cached"] > 0 and file_hits == second["cached"]
    assert second["text"] == first["text"]


def test_tier_metrics_are_exported():
    stats = EngineStats(prefix_hit_tokens_host=32, prefix_hit_tokens_file=16,
                        kv_file_bytes_written=1000, kv_file_checksum_failures=2,
                        kv_host_blocks_used=3, kv_host_blocks_total=8)  # fmt: skip
    text = Metrics(lambda: stats).render().decode()
    for line in (
        'ferry_kv_tier_hit_tokens_total{tier="host"} 32.0',
        'ferry_kv_tier_hit_tokens_total{tier="file"} 16.0',
        'ferry_kv_tier_written_bytes_total{tier="file"} 1000.0',
        "ferry_kv_file_checksum_failures_total 2.0",
        "ferry_kv_host_blocks_used 3.0",
        "ferry_kv_host_blocks_total 8.0",
    ):
        assert line in text
