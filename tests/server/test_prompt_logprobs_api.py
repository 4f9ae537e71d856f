"""Prompt logprobs over HTTP: ``echo`` + ``logprobs`` on ``/v1/completions`` (the first
token's null, as OpenAI's legacy API) and vLLM's ``prompt_logprobs`` on both endpoints,
from one engine (``ferry serve --aggregated``), equal to the logprobs the same tokens got
when they were generated; with the prompt cached too, and streamed; the default topology
(1P+1D) serves the same values. Byte-fragment tokens keep distinct texts, so no alternative is lost.
The same server checks ``--max-tokens-default``."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import run_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS_DEFAULT = 6
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    log = tmp_path_factory.mktemp("ferry-aggregated") / "serve.log"
    flags = ("--aggregated", "--threads", "1", "--max-tokens-default", str(MAX_TOKENS_DEFAULT),
             "--max-model-len", str(MAX_MODEL_LEN))  # fmt: skip
    with run_server(log, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def api_server(aggregated):
    return aggregated


def completion(http: httpx.Client, **body) -> dict:
    response = http.post("/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_scores_the_prompt_as_its_tokens_were_scored_when_generated(client, http):
    model = client.models.list().data[0].id
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                      logprobs=2)  # fmt: skip
    generated = first.choices[0].logprobs
    assert generated.tokens == [" Paris", "."]  # tokenized alike once part of the prompt
    prompt_len = first.usage.prompt_tokens
    whole = PROMPT + first.choices[0].text
    scored = client.completions.create(model=first.model, prompt=whole, max_tokens=1,
                                       temperature=0, echo=True, logprobs=2)  # fmt: skip
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(whole)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    # the tokens it generated, now part of the prompt, score as they did when generated
    assert lp.tokens[prompt_len : prompt_len + 2] == generated.tokens
    assert lp.token_logprobs[prompt_len : prompt_len + 2] == pytest.approx(
        generated.token_logprobs, abs=2e-3
    )
    for echoed, sampled in zip(lp.top_logprobs[prompt_len:], generated.top_logprobs):
        assert echoed == pytest.approx(sampled, abs=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_a_cached_prompt_is_recomputed_only_for_prompt_logprobs(http):
    text = "Water boils at one hundred degrees Celsius at sea level, and freezes at zero. " * 3
    plain = completion(http, prompt=text, max_tokens=2)
    again = completion(http, prompt=text, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    echoed = [completion(http, prompt=text, max_tokens=2, echo=True, logprobs=1)
              for _ in range(2)]  # fmt: skip
    for reply in echoed:
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert all(v is not None for v in reply["choices"][0]["logprobs"]["token_logprobs"][1:])
    first, second = (r["choices"][0]["logprobs"]["token_logprobs"] for r in echoed)
    assert first == pytest.approx(second, abs=1e-4)
    assert echoed[0]["choices"][0]["text"] == text + plain["choices"][0]["text"]


def test_vllm_prompt_logprobs_on_completions_and_chat(http):
    reply = completion(http, prompt=PROMPT, max_tokens=2, prompt_logprobs=2)
    entries = reply["choices"][0]["prompt_logprobs"]
    assert len(entries) == reply["usage"]["prompt_tokens"] and entries[0] is None
    for entry in entries[1:]:
        assert 2 <= len(entry) <= 3
        assert {1, 2} <= {v["rank"] for v in entry.values()}
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                   for v in entry.values())  # fmt: skip
    assert "prompt_logprobs" not in completion(http, prompt=PROMPT, max_tokens=2)["choices"][0]
    chat = http.post("/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2,
        "prompt_logprobs": 0, "temperature": 0})  # fmt: skip
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    streamed = http.post("/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs_streams_the_scored_prompt_first(http):
    with http.stream("POST", "/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
        "stream": True}) as response:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert all(v is not None for v in first["logprobs"]["token_logprobs"][1:])
    whole = completion(http, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1)
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"])


def test_byte_fragment_tokens_keep_every_alternative(http):
    reply = completion(http, prompt="Emoji: 🙂🙃 and 日本語", max_tokens=4, echo=True, logprobs=3)
    lp = reply["choices"][0]["logprobs"]
    fragments = [t for t in lp["tokens"] if t.startswith("bytes:\\x")]
    assert fragments, lp["tokens"]
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:]):  # fmt: skip
        assert 3 <= len(top) <= 4  # the 3 best, and the token itself when not among them
        assert top[token] == pytest.approx(value)
        assert "\ufffd" not in "".join(top)


def test_the_default_topology_serves_the_prompt_logprobs_one_engine_does(server, http):
    """Through 1P+1D: a long prompt is scored by the prefill worker (its first output
    carries them straight to the client), a short one by the decode worker itself."""
    long_text = "Water boils at one hundred degrees, and freezes at zero, at sea level. " * 2
    for prompt in (long_text, PROMPT):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
        response = httpx.post(f"{server.v1}/completions", headers=server.headers, timeout=120,
                              json=body)  # fmt: skip
        assert response.status_code == 200, response.text
        disaggregated = response.json()["choices"][0]
        one_engine = completion(http, **body)["choices"][0]
        assert disaggregated["text"] == one_engine["text"]
        got, want = disaggregated["prompt_logprobs"], one_engine["prompt_logprobs"]
        assert len(got) == len(want) and got[0] is None
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys()
            assert [g[k]["logprob"] for k in g] == pytest.approx(
                [w[k]["logprob"] for k in w], abs=1e-4)


def test_max_tokens_default_bounds_a_request_without_max_tokens(http):
    chat = {"messages": [{"role": "user", "content": "Count to fifty."}], "ignore_eos": True}
    short = http.post("/chat/completions", json=chat).json()
    assert short["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT
    assert short["choices"][0]["finish_reason"] == "length"
    room = MAX_MODEL_LEN - short["usage"]["prompt_tokens"]
    with http.stream("POST", "/chat/completions",
                     json={**chat, "max_tokens": room, "stream": True}) as ok:  # fmt: skip
        assert ok.status_code == 200  # an explicit value up to the context still goes
    over = http.post("/chat/completions", json={**chat, "max_tokens": room + 1})
    assert over.status_code == 400
    longer = http.post("/chat/completions", json={**chat, "max_tokens": 9}).json()
    assert longer["usage"]["completion_tokens"] == 9
