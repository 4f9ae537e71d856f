"""The edges third-party suites hit, against a real ``ferry serve``: ``stream_options``
without ``stream``, a message without content, a malformed tool call sent back and a
tool message without ``tool_call_id`` are 400s; ``tool_choice="required"``
with a pydantic tool whose schema has ``$defs``; a forced call cut short by
``max_tokens`` comes back alike streamed and not (no call, finish reason ``length``);
streamed calls carry each index once."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Book a table for two in Paris."}]


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Booking(BaseModel):
    place: Place  # a nested model: pydantic puts it under $defs and refers to it
    people: int = Field(ge=1, le=9)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_stream_options_without_stream_is_400(http):
    chat = {"messages": ASK, "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert _error(http.post("/chat/completions", json=chat))["param"] == "stream_options"
    legacy = {"prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert _error(http.post("/completions", json=legacy))["param"] == "stream_options"
    assert http.post("/chat/completions", json={**chat, "stream": True}).status_code == 200
    assert http.post("/chat/completions", json={**chat, "stream_options": None}).status_code == 200


def test_a_message_without_content_is_400(http):
    error = _error(http.post("/chat/completions", json={"messages": [{"role": "user"}]}))
    assert error["param"] == "messages.0.content" and "needs content" in error["message"]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [*ASK, {"role": "assistant", "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}]  # fmt: skip
    ok = http.post("/chat/completions", json={"messages": history, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_malformed_tool_call_or_tool_message_is_400_naming_the_field(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "", "arguments": "{}"}}
    history = [*ASK, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}]  # fmt: skip
    error = _error(http.post("/chat/completions", json={"messages": history}))
    assert error["param"] == "messages.1.tool_calls.0.function.name", error
    history[1]["tool_calls"][0]["function"]["name"] = "f"
    del history[2]["tool_call_id"]
    error = _error(http.post("/chat/completions", json={"messages": history}))
    assert error["param"] == "messages.2.tool_call_id", error


def test_required_tool_with_defs_refs_is_called(client, server):
    tool = openai.pydantic_function_tool(Booking, name="book")
    assert "$defs" in tool["function"]["parameters"]
    reply = client.chat.completions.create(
        model=server.model, messages=ASK, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "book"
    Booking.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function":
                                                      {"name": "book"}}])  # fmt: skip
def test_a_forced_call_cut_short_is_no_call_streamed_or_not(client, server, tool_choice):
    tool = openai.pydantic_function_tool(Booking, name="book")
    common = dict(model=server.model, messages=ASK, tools=[tool], tool_choice=tool_choice,
                  temperature=0, max_tokens=6)  # fmt: skip
    whole = client.chat.completions.create(**common).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.tool_calls is None and whole.message.content is None
    chunks = list(client.chat.completions.create(**common, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.tool_calls for d in deltas) and not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_calls_carry_each_index_once_and_match_the_whole_reply(client, server):
    tools = [openai.pydantic_function_tool(Booking, name="book"),
             openai.pydantic_function_tool(Place, name="locate")]  # fmt: skip
    common = dict(model=server.model, messages=ASK, tools=tools, tool_choice="required",
                  temperature=0, max_tokens=80)  # fmt: skip
    whole = client.chat.completions.create(**common).choices[0]
    chunks = list(client.chat.completions.create(**common, stream=True))
    for chunk in chunks:
        indices = [d.index for c in chunk.choices for d in c.delta.tool_calls or []]
        assert len(indices) == len(set(indices))
    streamed = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert [d.index for d in streamed] == list(range(len(streamed)))
    assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert streamed  # complete calls are kept even when a later one is cut short
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish == whole.finish_reason in ("tool_calls", "length")
