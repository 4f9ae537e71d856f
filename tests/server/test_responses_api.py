"""``/v1/responses`` as the official ``openai`` client uses it, against a real ``ferry
serve``: text and message input with instructions, streamed events that add up to the
non-streamed response, ``responses.parse`` / ``responses.stream`` with a pydantic
``text_format``, a function call round trip (whole input and ``previous_response_id``),
stored responses (``GET``, ``DELETE``, ``store: false``), usage with cached tokens,
logprobs, ``max_output_tokens``, and 400s that name the unsupported fields."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import assert_sound
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def create(client: openai.OpenAI, server, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 24)
    return client.responses.create(model=server.model, **kwargs)


def test_text_input_answers_like_chat(client, server):
    reply = create(client, server, input="What is the capital of France?")
    assert reply.object == "response" and reply.status == "completed"
    assert reply.id.startswith("resp_")
    assert "Paris" in reply.output_text
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    chat = client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    usage = reply.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_and_message_items(client, server):
    parts = [{"type": "input_text", "text": "Capital of Italy?"}]
    reply = create(client, server, instructions="Answer with one word.",
                   input=[{"role": "user", "content": parts}])  # fmt: skip
    assert reply.instructions == "Answer with one word."
    assert reply.output_text.strip()


def test_stream_events_add_up_to_the_response(client, server):
    events = list(create(client, server, input="Write a haiku about the sea.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 24
    whole = create(client, server, input="Write a haiku about the sea.")
    assert whole.output_text == text and whole.status == "incomplete"


def test_parse_and_stream_with_a_pydantic_text_format(client, server):
    reply = client.responses.parse(model=server.model, input="Describe Paris as JSON.",
                                   text_format=City, temperature=0, max_output_tokens=60)
    assert isinstance(reply.output_parsed, City)
    with client.responses.stream(model=server.model, input="Describe Paris as JSON.",
                                 text_format=City, temperature=0, max_output_tokens=60) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    assert streamed.output_parsed == reply.output_parsed


def test_function_call_round_trip(client, server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = create(client, server, input=ask, tools=[WEATHER], tool_choice="required",
                   max_output_tokens=40)  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and json.loads(call.arguments)["city"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}
    whole = create(client, server, input=[*ask, *first.output, result], tools=[WEATHER])
    chained = create(client, server, input=[result], tools=[WEATHER],
                     previous_response_id=first.id)  # fmt: skip
    assert whole.status == chained.status  # the small model may run to max_output_tokens
    assert whole.output_text == chained.output_text and whole.output_text
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == whole.usage.input_tokens
    named = create(client, server, input=ask, tools=[WEATHER], max_output_tokens=40,
                   tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    done = [e for e in named if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["function_call"]
    assert json.loads(done[0].item.arguments)["city"]


def test_previous_response_id_continues_the_conversation_from_the_cache(client, server):
    first = create(client, server, input="My name is Ada. Say hello to me.")
    second = create(client, server, input="What is my name?", previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_stored_responses_can_be_deleted_and_store_false_keeps_none(client, server, http):
    kept = create(client, server, input="Hi", max_output_tokens=2)
    assert http.get(f"/responses/{kept.id}").json()["id"] == kept.id
    client.responses.delete(kept.id)
    assert http.get(f"/responses/{kept.id}").status_code == 404
    assert http.delete(f"/responses/{kept.id}").status_code == 404
    unkept = create(client, server, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    assert http.get(f"/responses/{unkept.id}").status_code == 404
    gone = http.post("/responses", json={"input": "Hi", "previous_response_id": unkept.id})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"


def test_logprobs_when_included(client, server):
    reply = create(client, server, input="Hi", max_output_tokens=4, top_logprobs=2,
                   include=["message.output_text.logprobs"])  # fmt: skip
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == reply.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_a_forced_call_cut_short_is_incomplete_without_the_call(client, server):
    for stream in (False, True):
        reply = create(client, server, input="Weather in Paris?", tools=[WEATHER],
                       tool_choice="required", max_output_tokens=4, stream=stream)  # fmt: skip
        if stream:
            events = list(reply)
            assert not [e for e in events if e.type.startswith("response.output_item")]
            reply = events[-1].response
        assert reply.status == "incomplete" and reply.output == []
        after = create(client, server, input="Hi", previous_response_id=reply.id,
                       max_output_tokens=2)  # a conversation goes on from an empty reply
        assert after.previous_response_id == reply.id


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": {"type": "web_search"}, "tools": [WEATHER]}, "tool_choice"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2**63}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "other"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
     "input.0.name"),
    ({"temperature": 5}, "temperature"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content"),
])  # fmt: skip
def test_unsupported_fields_are_400_naming_them(http, body, param):
    response = http.post("/responses", json={"input": "Hi", "max_output_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_hints_and_unknown_fields_are_accepted(http):
    body = {"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v"}, "user": "u",
            "service_tier": "auto", "prompt_cache_key": "p", "reasoning": {"effort": None},
            "frobnicate": 1}  # fmt: skip
    response = http.post("/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"k": "v"}


def test_a_stream_left_early_frees_its_request(client, server, http):
    events = create(client, server, input="Tell me a long story about the sea.", stream=True,
                    max_output_tokens=200)  # fmt: skip
    for event in events:
        if event.type == "response.output_text.delta":
            break
    events.close()
    after = create(client, server, input="Hi", max_output_tokens=2)
    assert after.status in ("completed", "incomplete")
    assert_sound(server)
