"""The default topology (``ferry serve`` with no flags: frontend + 1 prefill + 1 decode
worker, the default model) stays light: its processes' RSS, read from /proc, sums to at
most 1.5 GB after it has answered requests; the frontend runs without torch."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import run_server

BOUND_MB = 1536


def _tree(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [p for c in children for p in _tree(int(c))]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_default_topology_rss_stays_under_the_bound(tmp_path):
    with run_server(tmp_path / "serve.log") as server:
        pids = _tree(server.process.pid)
        assert len(pids) == 3, f"expected frontend + 2 workers, got {pids}"
        with httpx.Client(base_url=server.v1, headers=server.headers, timeout=300) as client:
            body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 16, "temperature": 0}  # fmt: skip
            reply = client.post("/chat/completions", json=body).json()
            assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."
            for i in range(4):  # a few longer prompts, so both workers' caches are in use
                body = {"messages": [{"role": "user", "content": f"Story {i}: " + "tide " * 300}],
                        "max_tokens": 32, "temperature": 0}  # fmt: skip
                assert client.post("/chat/completions", json=body).status_code == 200
        rss = {pid: _rss_mb(pid) for pid in pids}
        assert sum(rss.values()) <= BOUND_MB, rss
        assert not _maps_torch(server.process.pid), "the frontend loaded torch"
