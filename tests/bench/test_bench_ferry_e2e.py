"""`ferry bench` and a small sweep against a real `ferry serve` (default model)."""

from __future__ import annotations

import json

import pytest

from bench.load import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.slow


def _common(url: str) -> list[str]:
    return ["--url", url, "--num-requests", "4", "--input-len", "16", "--output-len", "8",
            "--no-progress", "--slo-ttft-ms", "60000", "--slo-itl-ms", "10000"]  # fmt: skip


def test_bench_against_ferry_serve(ferry_url, tmp_path):
    out = tmp_path / "run.json"
    assert cli.main([*_common(ferry_url), "--concurrency", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    s = record["summary"]
    assert (s["completed"], s["failed"]) == (4, 0), s["errors"]
    assert s["total_output_tokens"] == 4 * 8  # ignore_eos + max_tokens pin the length
    assert s["total_prompt_tokens"] >= 4 * 16
    assert all(len(r["itl_ms"]) >= 1 and r["ttft_ms"] > 0 for r in record["requests"])
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0 and s["output_throughput"] > 0
    assert record["model"] and record["commit"] and record["machine"]["cores"]


def test_bench_responses_endpoint_against_ferry_serve(ferry_url, tmp_path):
    out = tmp_path / "responses.json"
    args = [*_common(ferry_url), "--endpoint", "responses", "--concurrency", "2",
            "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    s = json.loads(out.read_text())["summary"]
    assert (s["completed"], s["failed"]) == (4, 0), s["errors"]
    assert s["total_output_tokens"] == 4 * 8  # ignore_eos reaches ferry's Responses API too
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0


def test_sweep_against_ferry_serve(ferry_url, tmp_path):
    out = tmp_path / "sweep.json"
    args = ["sweep", *_common(ferry_url), "--workload", "shared-prefix", "--num-prefixes", "1",
            "--prefix-len", "64", "--concurrency", "1,2", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    record = json.loads(out.read_text())
    assert [p["concurrency"] for p in record["points"]] == [1, 2]
    for point in record["points"]:
        assert point["summary"]["completed"] == 4, point["summary"]["errors"]
    assert record["points"][1]["summary"]["total_cached_tokens"] > 0  # the shared prefix
    assert len(record["plots"]) == 4
    for name in record["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
