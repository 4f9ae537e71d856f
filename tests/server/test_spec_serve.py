"""``ferry serve --speculative ...``: real processes, the tiny Llama (byte tokens), greedy.

Aggregated with prompt lookup and 1P+1D with a draft model (the decode worker drafts)
answer exactly as a server without speculation: whole replies, streamed ones (several
tokens may come in one chunk), a stop string and max_tokens in the middle of a step's
kept drafts, and a request that opts out. ``/metrics`` shows the drafts by position, the
verify budget and the verify policy's estimate errors.
A bad temperature list is refused at start with a clear message.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server, assert_sound
from helpers import ferry_command, metric

FLAGS = ("--threads", "1", "--block-size", "16", "--kv-tiers", "none")
PROMPTS = [
    "abc abc abc abc abc abc abc abc",
    "The ferry left at dawn. The ferry left at dawn. The ferry",
    "one two three four five six",
]


def complete(server, prompt: str, stream: bool = False, **extra) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}  # fmt: skip
    if not stream:
        r = httpx.post(f"{server.v1}/completions", json=body, headers=server.headers, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{server.v1}/completions", json=body, headers=server.headers,
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def answers(server) -> dict:
    out = {}
    for p in PROMPTS:
        out[p] = complete(server, p)
        out[("stream", p)] = complete(server, p, stream=True)
        out[("short", p)] = complete(server, p, max_tokens=5)
    whole = out[PROMPTS[0]]
    out["stop"] = complete(server, PROMPTS[0], stop=[whole[7:10]])
    out["opt-out"] = complete(server, PROMPTS[1], speculative=False)
    return out


@pytest.fixture(scope="module")
def model(tiny_moe_dir) -> Path:
    return tiny_moe_dir("llama")


@pytest.fixture(scope="module")
def expected(model, serve, tmp_path_factory) -> dict:
    log = tmp_path_factory.mktemp("spec-plain") / "serve.log"
    with serve(log, *FLAGS, "--model", str(model), "--aggregated") as s:
        return answers(s)


@pytest.fixture(scope="module", params=["aggregated", "1p1d", "aggregated-dynamic"])
def speculative(request, model, serve, tmp_path_factory) -> Iterator[tuple[Server, dict, str]]:
    """A speculative server of each topology (the fixed schedule; the aggregated one with
    the dynamic schedule too), its answers (``answers``) and its schedule, the server
    kept running for the tests to read."""
    if request.param.startswith("aggregated"):
        flags = ("--aggregated", "--speculative", "ngram")
    else:
        flags = ("--prefill", "1", "--decode", "1", "--local-prefill-tokens", "0",
                 "--speculative", f"draft:{model}")  # fmt: skip
    schedule = "dynamic" if request.param.endswith("dynamic") else "fixed"
    log = tmp_path_factory.mktemp(f"spec-{request.param}") / "serve.log"
    with serve(log, *FLAGS, "--model", str(model), *flags, "--num-speculative-tokens", "4",
               "--spec-schedule", schedule) as s:  # fmt: skip
        yield s, answers(s), schedule


def test_speculative_server_answers_as_one_without(speculative, expected):
    s, got, _ = speculative
    assert got == expected
    assert got["stop"] != got[PROMPTS[0]]  # the stop string cut the reply
    assert metric(s, "ferry_spec_draft_tokens_verified_total", position="1") > 0
    assert metric(s, "ferry_spec_draft_tokens_accepted_total", position="1") > 0
    assert metric(s, "ferry_spec_mean_acceptance_length") > 1.0
    assert_sound(s)


def test_metrics_show_drafts_proposed_the_verify_budget_and_the_estimates_errors(speculative):
    """After speculative requests: drafts proposed at every position, a mean verify budget
    per step above 0, the acceptance estimates' error above 0, and the step-cost model's
    relative error: 0 under the fixed schedule, which predicts no step time; under the
    dynamic one above 0 and below 1 (1 is what predicting nothing would give: the gauge is
    the summed |predicted - measured| over the summed measured step times)."""
    s, _, schedule = speculative
    proposed = [metric(s, "ferry_spec_draft_tokens_proposed_total", position=str(p))
                for p in range(1, 5)]  # fmt: skip
    assert all(v > 0 for v in proposed), proposed
    body = httpx.get(f"{s.base_url}/metrics", timeout=30).text
    assert 'ferry_spec_draft_tokens_proposed_total{position="5"}' not in body  # K = 4
    budget = metric(s, "ferry_spec_mean_verify_budget")
    assert 0 < budget <= 4, budget  # one request at a time, 4 drafts at most
    acceptance = metric(s, "ferry_spec_acceptance_estimate_error")
    assert math.isfinite(acceptance) and acceptance > 0, acceptance
    step_time = metric(s, "ferry_spec_step_time_estimate_error")
    if schedule == "fixed":
        assert step_time == 0
    else:
        assert 0 < step_time < 1, step_time


def test_a_temperature_list_of_the_wrong_length_is_refused_at_start(model):

    run = subprocess.run(
        [*ferry_command(), "serve", "--model", str(model), "--speculative", "ngram",
         "--num-speculative-tokens", "4", "--spec-confidence-temperatures", "1.0,0.8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "2 confidence temperatures for 4 draft positions" in run.stderr
    assert "Traceback" not in run.stderr
