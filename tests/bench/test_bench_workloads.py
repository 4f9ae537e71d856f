"""Workload generators: deterministic under a seed, exact request counts, conversations."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import pytest

from bench.load.runner import LoadConfig, request_body
from bench.load.workloads import WorkloadSpec, build_sessions, count_requests


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multiturn", "images"])
def test_same_seed_same_workload_other_seed_other_workload(kind):
    spec = WorkloadSpec(kind, num_requests=10, input_len=20, range_ratio=0.5, seed=3)
    assert build_sessions(spec) == build_sessions(spec)
    other = WorkloadSpec(kind, num_requests=10, input_len=20, range_ratio=0.5, seed=4)
    assert build_sessions(spec) != build_sessions(other)
    assert count_requests(build_sessions(spec)) == 10


def _images(spec: WorkloadSpec) -> list[list[str]]:
    return [[p["image_url"]["url"] for p in s.turns[0].messages[0]["content"][1:]]
            for s in build_sessions(spec)]  # fmt: skip


def test_images_are_pngs_of_the_size_asked_and_follow_the_image_seed_alone():
    from PIL import Image

    spec = WorkloadSpec("images", num_requests=4, input_len=6, image_width=50, image_height=30,
                        images_per_request=2, image_seed=7)  # fmt: skip
    urls = _images(spec)
    assert len(urls) == 4 and all(len(u) == 2 for u in urls)
    assert len({u for pair in urls for u in pair}) == 8  # every image its own
    head, payload = urls[0][1].split(",", 1)
    assert head == "data:image/png;base64"
    with Image.open(io.BytesIO(base64.b64decode(payload))) as image:
        image.load()  # the whole file decodes
        assert (image.size, image.mode, image.format) == ((50, 30), "RGB", "PNG")
    texts = [s.turns[0].messages[0]["content"][0]["text"] for s in build_sessions(spec)]
    assert all(len(t.split()) == 6 for t in texts)
    other_words = dataclasses.replace(spec, seed=1)
    assert _images(other_words) == urls  # the warm run: the same images, other words
    assert build_sessions(other_words) != build_sessions(spec)
    assert not set(sum(_images(dataclasses.replace(spec, image_seed=8)), [])) & set(sum(urls, []))


def test_random_lengths_stay_in_the_range():
    spec = WorkloadSpec("random", num_requests=50, input_len=100, range_ratio=0.2)
    lengths = [len(s.turns[0].messages[-1]["content"].split()) for s in build_sessions(spec)]
    assert min(lengths) >= 80 and max(lengths) <= 120 and len(set(lengths)) > 5
    assert all(s.turns[0].max_tokens == 128 for s in build_sessions(spec))


def test_shared_prefix_uses_g_system_prompts():
    spec = WorkloadSpec("shared-prefix", num_requests=40, num_prefixes=3, prefix_len=50)
    systems = {s.turns[0].messages[0]["content"] for s in build_sessions(spec)}
    assert len(systems) == 3
    assert all(len(text.split()) == 52 for text in systems)  # "Group g." + 50 words


def test_multiturn_splits_requests_into_conversations_with_think_time():
    spec = WorkloadSpec("multiturn", num_requests=10, turns=4, think_time_s=2.0)
    sessions = build_sessions(spec)
    assert [len(s.turns) for s in sessions] == [4, 4, 2]
    assert all(s.turns[0].think_time_s == 0 for s in sessions)
    assert all(t.think_time_s > 0 for s in sessions for t in s.turns[1:])
    assert all(t.messages[0]["role"] == "user" for s in sessions for t in s.turns)


def test_jsonl_trace_cycles_and_keeps_its_fields(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "temperature": 0.3},
        {"messages": [{"role": "user", "content": "b"}], "model": "x", "stream": False},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    sessions = build_sessions(WorkloadSpec(str(path), num_requests=3, output_len=7))
    turns = [s.turns[0] for s in sessions]
    assert [t.messages[0]["content"] for t in turns] == ["a", "b", "a"]
    assert [t.max_tokens for t in turns] == [5, 7, 5]
    cfg = LoadConfig(chat_url="http://x/v1/chat/completions", model="m", concurrency=1)
    body = request_body(cfg, list(turns[0].messages), turns[0].max_tokens, turns[0].extra)
    assert body["temperature"] == 0.3 and body["model"] == "m" and body["stream"] is True
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    responses = LoadConfig(chat_url="http://x/v1/chat/completions", model="m", concurrency=1,
                           endpoint="responses")  # fmt: skip
    body = request_body(responses, list(turns[0].messages), 5, {})
    assert body["input"] == list(turns[0].messages) and "messages" not in body
    assert body["max_output_tokens"] == 5 and body["ignore_eos"] is True
    assert "stream_options" not in body and body["stream"] is True


def test_jsonl_rejects_lines_without_messages(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="messages"):
        build_sessions(WorkloadSpec(str(path), num_requests=1))
