"""``ferry serve --device cuda`` end to end (CUDA only): the 8B-shaped dummy model in bf16,
decode through CUDA graphs, a chat completion and a streamed one over HTTP."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FLAGS = (
    "--model", "dummy:llama3-8b", "--device", "cuda", "--dtype", "bfloat16",
    "--max-model-len", "4096", "--kv-cache-memory-gb", "8", "--block-size", "16",
)  # fmt: skip
PROMPT = "Count from one to ten, then say each number in French and in German."
MESSAGES = [{"role": "user", "content": PROMPT}]


def _run_server(*args):
    """``run_server`` of this folder's conftest, loaded by path (its module name is shared
    with the top-level conftest)."""
    spec = importlib.util.spec_from_file_location(
        "server_tests_conftest", Path(__file__).with_name("conftest.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.run_server(*args)


@pytest.mark.parametrize(
    "topology",
    [("--aggregated",), ("--prefill", "1", "--decode", "1")],
    ids=["aggregated", "prefill-decode"],
)
def test_chat_completion_and_stream_on_cuda(tmp_path, topology):
    """Both topologies; the disaggregated one moves KV between two workers on the GPU
    over the transport ``ferry serve`` picks for CUDA (tcp)."""
    with _run_server(tmp_path / "serve.log", *FLAGS, *topology) as s:
        body = {"model": s.model, "messages": MESSAGES, "max_tokens": 32, "ignore_eos": True}
        r = httpx.post(f"{s.v1}/chat/completions", json=body, headers=s.headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32

        pieces, usage = [], None
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream(
            "POST", f"{s.v1}/chat/completions", json=stream, headers=s.headers, timeout=120
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
        assert usage["completion_tokens"] == 32 and any(pieces)
        assert "captured decode CUDA graphs" in s.log_tail(100_000)
        if "--aggregated" not in topology:  # the prompt really went through the prefill worker
            metrics = httpx.get(f"{s.base_url}/metrics", timeout=30).text
            blocks = re.search(r"^ferry_kv_transfer_blocks_total (\S+)$", metrics, re.M)
            assert blocks and float(blocks.group(1)) > 0, metrics[-3000:]
