"""Structured output through a real ``ferry serve`` and the official ``openai`` client:
``parse`` with a pydantic model, forced tool calls (plain and streamed), regex / EBNF /
choice through ``structured_outputs``, 400s for invalid grammars, and a slow compile that
does not hold up an unconstrained request beside it."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from conftest import assert_sound
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, timeout=120, max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population_millions: int = Field(ge=0, le=50)


def test_parse_returns_a_pydantic_object(client, server):
    reply = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_returns_valid_tool_calls(client, server):
    reply = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=80,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)


def test_named_function_streams_tool_call_deltas(client, server):
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=ASK, tools=TOOLS, tool_choice=named,
            temperature=1.0, seed=3, max_tokens=40, stream=True, n=2,
        )
    )  # fmt: skip
    calls: dict[int, list] = {0: [], 1: []}
    finish = {}
    for chunk in chunks:
        for c in chunk.choices:
            calls[c.index] += c.delta.tool_calls or []
            assert not c.delta.content
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for deltas in calls.values():
        first = deltas[0]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name == "get_time"
        assert {d.index for d in deltas} == {0}
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        arguments = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(arguments), TIME)


def test_regex_grammar_and_choice_through_structured_outputs(client, server):
    regex = r"[A-Z][a-z]{2,8} is in (France|Spain|Italy)\."
    ebnf = 'root ::= "Answer: " ("yes" | "no") "!"'
    replies = [
        client.chat.completions.create(
            model=server.model, messages=ASK, temperature=1.0, seed=7, max_tokens=30,
            extra_body={"structured_outputs": so},
        )
        for so in ({"regex": regex}, {"grammar": ebnf})
    ]  # fmt: skip
    texts = [r.choices[0].message.content for r in replies]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in ("Answer: yes!", "Answer: no!")
    completion = client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}},
    )  # fmt: skip
    assert completion.choices[0].text in ("blue", "green")
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_with_n_and_logprobs(client, server):
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Give a JSON object."}],
        response_format={"type": "json_object"}, n=2, temperature=1.0, seed=1, max_tokens=40,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        tokens = "".join(t.token for t in choice.logprobs.content)
        assert tokens.startswith(choice.message.content)  # (+ the EOS token, when it stopped)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         'Unsupported type "bogus"'),
        ({"structured_outputs": {"regex": "a(b"}}, "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, 'Rule "nope" is not defined'),
        ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "exactly one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "only one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in tools"),
    ],
)  # fmt: skip
def test_invalid_grammars_are_400_with_the_reason(server, body, reason):
    payload = {"messages": ASK, "max_tokens": 4, **body}
    r = httpx.post(f"{server.v1}/chat/completions", json=payload, headers=server.headers,
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert reason in error["message"] and error["type"] == "invalid_request_error"


def _slow_schema(n: int = 300) -> dict:
    """Compiles for seconds (hundreds of distinct patterns); unique, so never cached."""
    salt = uuid.uuid4().hex[:8]
    branches = [
        {"type": "object",
         "properties": {f"k{i}{salt}": {"type": "string",
                                        "pattern": f"^x{i}[a-z]{{2,{i % 9 + 2}}}[0-9]{{1,3}}$"}},
         "required": [f"k{i}{salt}"], "additionalProperties": False}
        for i in range(n)
    ]  # fmt: skip
    return {"anyOf": branches}


def test_a_slow_compile_does_not_delay_an_unconstrained_request(server):
    done: dict[str, float] = {}
    start = time.monotonic()

    def post(name: str, extra: dict) -> None:
        payload = {"messages": ASK, "max_tokens": 4, "temperature": 0, **extra}
        r = httpx.post(f"{server.v1}/chat/completions", json=payload, headers=server.headers,
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        done[name] = time.monotonic() - start

    slow_body = {"structured_outputs": {"json": _slow_schema()}}
    slow = threading.Thread(target=post, args=("slow", slow_body))
    slow.start()
    time.sleep(0.3)
    post("plain", {})
    slow.join()
    assert list(done) == ["plain", "slow"], done
    assert_sound(server)
