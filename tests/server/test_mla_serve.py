"""A DeepSeek-V3 checkpoint (MLA + MoE, tiny and random, written by transformers) served
by real ``ferry serve`` processes: one prefill and one decode worker over shm and over
tcp answer token for token as the aggregated engine does, with the latent KV moved
between them; a repeated prompt is served from the cache; a restarted server restores
an MLA prefix from the file tier.

Tokens are compared through chat logprobs' ``bytes``: the checkpoint's 260 ids are the
byte tokenizer's 256 bytes and 4 special tokens, so the bytes name each token exactly.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import assert_sound
from helpers import metric, wait_for_files

QUESTIONS = [
    "Which ferry leaves first in the morning?",
    "Name the harbours along the northern coast, from west to east.",
    "What did the keeper write in the log on the stormy night?",
]
LONG = " ".join(f"Day {i}: the ferry crossed at dawn and came back at dusk." for i in range(6))
FLAGS = ("--threads", "1", "--block-size", "16")


def chat(server, content: str, max_tokens: int = 24) -> dict:
    """One greedy chat completion: each token's bytes and the usage."""
    body = {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": True}  # fmt: skip
    r = httpx.post(f"{server.v1}/chat/completions", json=body, headers=server.headers,
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    tokens = [tuple(t["bytes"]) for t in choice["logprobs"]["content"]]
    assert len(tokens) == max_tokens
    return {"tokens": tokens, "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tiny_moe_dir) -> Path:
    return tiny_moe_dir("deepseek-v3")


@pytest.fixture(scope="module")
def aggregated(folder, serve, tmp_path_factory):
    """The aggregated engine's answers (the questions, the long prompt, then the long
    prompt again), computed with a file tier whose directory the restart test reads; the
    server is stopped after."""
    root = tmp_path_factory.mktemp("mla-aggregated")
    kv_dir = root / "kv"
    flags = (*FLAGS, "--model", str(folder), "--aggregated", "--kv-dir", str(kv_dir),
             "--kv-tiers", "file")  # fmt: skip
    with serve(root / "serve.log", *flags) as s:
        answers = {q: chat(s, q) for q in [*QUESTIONS, LONG]}
        repeated = chat(s, LONG)
        wait_for_files(kv_dir, answers[LONG]["prompt_tokens"] // 16)
    return {"answers": answers, "repeated": repeated, "kv_dir": kv_dir, "flags": flags}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_prefill_decode_workers_answer_token_for_token_as_aggregated(
    transport, folder, aggregated, serve, tmp_path
):
    flags = (*FLAGS, "--model", str(folder), "--prefill", "1", "--decode", "1",
             "--kv-transport", transport, "--local-prefill-tokens", "0",
             "--kv-tiers", "none")  # fmt: skip
    with serve(tmp_path / "serve.log", *flags) as s:
        for question in QUESTIONS:
            assert chat(s, question)["tokens"] == aggregated["answers"][question]["tokens"]
        assert metric(s, "ferry_kv_transfer_blocks_total") > 0  # latents crossed over
        assert metric(s, "ferry_kv_transfer_failures_total") == 0
        again = chat(s, QUESTIONS[1])
        assert again["cached"] > 0
        assert again["tokens"] == aggregated["answers"][QUESTIONS[1]]["tokens"]
        assert_sound(s)


def test_a_repeated_prompt_is_served_from_the_cache_when_aggregated(aggregated):
    answers, again = aggregated["answers"], aggregated["repeated"]
    assert all(a["cached"] == 0 for a in answers.values())
    first = answers[LONG]
    assert again["cached"] == (first["prompt_tokens"] - 1) // 16 * 16
    assert again["tokens"] == first["tokens"]


def test_a_restarted_server_restores_the_mla_prefix_from_the_file_tier(aggregated, serve, tmp_path):
    before = aggregated["answers"][LONG]
    with serve(tmp_path / "serve.log", *aggregated["flags"]) as s:
        after = chat(s, LONG)
        file_hits = metric(s, "ferry_kv_tier_hit_tokens_total", tier="file")
        assert metric(s, "ferry_kv_file_checksum_failures_total") == 0
    assert after["cached"] == (before["prompt_tokens"] - 1) // 16 * 16
    assert file_hits == after["cached"]
    assert after["tokens"] == before["tokens"]
