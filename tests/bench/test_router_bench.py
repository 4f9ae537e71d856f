"""The router benchmark's in-process part (decision time over a filled prefix index) at
small sizes, through its command line, so the script cannot rot. No servers."""

from __future__ import annotations

import json

from bench import router as bench_router
from router.policies import POLICIES


def test_decision_part_writes_every_policy_and_pool(tmp_path):
    out = tmp_path / "router.json"
    sizes = ["--workers", "4", "--blocks-per-worker", "300", "--prompt-tokens", "256"]
    bench_router.main(["--parts", "decision", *sizes, "--decisions", "40", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["commit"] and report["machine"]["cores"] >= 1 and report["date"]
    d = report["decision"]
    index = d["index"]
    assert index["worker_blocks"] >= 4 * 300
    assert index["distinct_blocks"] < index["worker_blocks"]  # some prefixes are shared
    assert index["memory_mb"] > 0
    assert 0 < d["prompt_hit_share"]["mean"] < 1  # prompts hit in part
    assert set(d["choose_us"]) == set(POLICIES)
    for pools in d["choose_us"].values():
        for role in ("prefill", "decode"):
            assert 0 < pools[role]["p50"] <= pools[role]["p99"]
    assert "policies" not in report and "overhead" not in report


def test_prompts_share_prefixes_with_what_workers_hold():
    import random

    from router.index import PrefixIndex
    from router.routing import Router

    rng = random.Random(1)
    index = PrefixIndex()
    held = bench_router.fill_index(index, rng, ["a", "b", "c"], 100, 16, 8, 3, 4)
    prompts = bench_router.make_prompts(rng, held, 30, 128, 16)
    router = Router("cache_aware", 16, index=index)
    hits = [max(index.match(router.hashes(p), ["a", "b", "c"]).values()) for p in prompts]
    assert all(len(p) == 128 for p in prompts)
    assert any(0 < h < 127 // 16 for h in hits)
