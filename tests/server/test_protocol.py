"""Request schemas: what validates, what is rejected, and what responses look like."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from server.body import validate
from server.errors import APIError, validation_error
from server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    OtherPart,
    TextPart,
)
from server.responses_protocol import ResponsesRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_stop_accepts_a_string_or_up_to_four_and_drops_empty_ones():
    assert ChatCompletionRequest(messages=MESSAGES, stop="x").stop_strings == ["x"]
    assert ChatCompletionRequest(messages=MESSAGES, stop=["a", ""]).stop_strings == ["a"]
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MESSAGES, stop=list("abcde"))


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest(messages=MESSAGES, max_tokens=5, max_completion_tokens=3)
    assert req.max_new_tokens == 3
    assert ChatCompletionRequest(messages=MESSAGES).max_new_tokens is None
    assert CompletionRequest(prompt="x").max_new_tokens == 16


def test_logprobs_fields_map_to_the_engine_count():
    assert ChatCompletionRequest(messages=MESSAGES).num_logprobs is None
    assert ChatCompletionRequest(messages=MESSAGES, logprobs=True).num_logprobs == 0
    req = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=3)
    assert req.num_logprobs == 3
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MESSAGES, top_logprobs=3)
    assert CompletionRequest(prompt="x", logprobs=2).num_logprobs == 2


def test_content_parts_are_chosen_by_type():
    msg = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "input_audio", "input_audio": {}}]}]
    ).messages[0]  # fmt: skip
    assert isinstance(msg.content[0], TextPart) and isinstance(msg.content[1], OtherPart)
    # an image part without its url is an error about that field, not an unknown part
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}])  # fmt: skip
    error = validation_error(info.value.errors())
    assert error.status == 400 and error.param == "messages.0.content.1.image_url.url"


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_empty_prompts_are_rejected(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_logit_bias_keys_must_be_token_ids():
    assert ChatCompletionRequest(messages=MESSAGES, logit_bias={"42": 1.0}).logit_bias
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=MESSAGES, logit_bias={"the": 1.0})
    error = validation_error(info.value.errors())
    assert error.status == 400 and error.param == "logit_bias"


def test_unknown_fields_are_ignored_and_n_is_bounded():
    assert ChatCompletionRequest(messages=MESSAGES, frobnicate=1).n == 1
    for n in (0, 129):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=MESSAGES, n=n)


def test_finishing_chunk_has_an_empty_delta_and_null_fields():
    chunk = ChatCompletionChunk(
        id="chatcmpl-1", created=1, model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="stop")],
    )  # fmt: skip
    body = json.loads(chunk.model_dump_json(exclude={"usage"}))
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    assert "usage" not in body


def test_each_unknown_field_is_logged_once_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="ferry.server")
    for _ in range(3):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "zz_unknown_a": 1,
                                              "zz_unknown_b": 2, "max_tokens": 3})  # fmt: skip
    CompletionRequest.model_validate({"prompt": "x", "zz_unknown_a": 1})
    lines = [r.getMessage() for r in caplog.records if "zz_unknown" in r.getMessage()]
    assert lines == [
        "ChatCompletionRequest: ignoring unknown field 'zz_unknown_a'",
        "ChatCompletionRequest: ignoring unknown field 'zz_unknown_b'",
        "CompletionRequest: ignoring unknown field 'zz_unknown_a'",
    ]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "zz_unknown" in r.getMessage())


def test_stream_options_need_stream_and_messages_need_content():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=MESSAGES, stream_options={"include_usage": True})
    assert validation_error(info.value.errors()).param == "stream_options"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user"}])
    assert validation_error(info.value.errors()).param == "messages.0.content"
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ChatCompletionRequest(messages=[*MESSAGES, {"role": "assistant", "tool_calls": calls}])


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
     "messages.1.tool_calls.0.function"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": 3, "arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]},
     "messages.1.tool_calls.0.type"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]},
     "messages.1.tool_calls.0.id"),
    ({"role": "tool", "content": "done"}, "messages.1.tool_call_id"),
])  # fmt: skip
def test_a_malformed_tool_call_or_tool_message_names_the_field(message, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[*MESSAGES, message])
    assert validation_error(info.value.errors()).param == param


def test_tool_calls_sent_back_reach_the_template_as_sent():
    from server.serving import _template_message

    # content null beside calls, no type, and arguments that are not JSON: all as OpenAI takes
    call = {"id": "c", "function": {"name": "f", "arguments": "{not json"}}
    req = ChatCompletionRequest(messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "done"}])  # fmt: skip
    assert [_template_message(m, i) for i, m in enumerate(req.messages)][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "type": "function"}]},
        {"role": "tool", "content": "done", "tool_call_id": "c"},
    ]


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(("model", "body", "param", "problem"), [
    (ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": "required"},
     "tool_choice", "tool_choice requires tools"),
    (ChatCompletionRequest, {"messages": MESSAGES, "tools": TOOLS,
                             "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "tool_choice names function 'g', not in tools"),
    (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 2},
     "top_logprobs", "top_logprobs requires logprobs to be true"),
    (CompletionRequest, {"prompt": ["a"] * 16, "n": 64}, "n", "would start 1024 sequences"),
    (CompletionRequest, {"prompt": ["a"] * 129}, "prompt", "would start 129 sequences"),
])  # fmt: skip
def test_a_rule_across_fields_names_the_field_it_is_about(model, body, param, problem):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error(info.value.errors())
    message = error.message  # the check's own words, after the field it names
    assert error.param == param and message.startswith(f"{param}: ") and problem in message
    assert "Value error" not in message, message


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_content_chunk_from_its_template_is_what_the_model_renders(include_usage):
    import random
    import types

    from server.serving import ChatRenderer, Job

    rng = random.Random(0)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "/", "é", "€", "😀", "\u2028",
                "a", " ", "<", "&", "'", "\ufffd"]  # fmt: skip
    request = ChatCompletionRequest(messages=MESSAGES, stream=True,
                                    stream_options={"include_usage": include_usage})  # fmt: skip
    job = Job(request_id="chatcmpl-x", model='m"odel\\', prompts=[], choices=[])
    renderer = ChatRenderer(types.SimpleNamespace(tokenizer=None), job, request)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        index = rng.randint(0, 2)
        full = renderer._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text))])
        assert renderer.content_chunk(index, text) == full
        assert json.loads(full[len("data: "):])["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("model, field, value, expected", [
    (ChatCompletionRequest, "stream", "yes", "expected a boolean, got a string"),
    (ChatCompletionRequest, "logprobs", 1, "expected a boolean, got an integer"),
    (ChatCompletionRequest, "max_tokens", "5", "expected an integer, got a string"),
    (ChatCompletionRequest, "n", True, "expected an integer, got a boolean"),
    (ChatCompletionRequest, "max_tokens", 5.5, "expected an integer, got a number with a fraction"),
    (ChatCompletionRequest, "temperature", "0.5", "expected a number, got a string"),
    (CompletionRequest, "echo", "true", "expected a boolean, got a string"),
    (ResponsesRequest, "max_output_tokens", "5", "expected an integer, got a string"),
    (ResponsesRequest, "stream", "false", "expected a boolean, got a string"),
])  # fmt: skip
def test_a_body_value_of_another_json_type_is_400_naming_the_field(model, field, value,
                                                                     expected):  # fmt: skip
    body = {"messages": MESSAGES, "prompt": "hi", "input": "hi", field: value}
    with pytest.raises(APIError) as info:
        validate(json.dumps(body).encode(), model)
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message == f"{field}: {expected}"


def test_json_true_false_and_whole_numbers_pass_the_strict_check():
    body = {"messages": MESSAGES, "stream": True, "logprobs": False, "temperature": 1,
            "top_p": 1, "max_tokens": 5.0, "n": 2, "logit_bias": {"7": 1}}  # fmt: skip
    request = validate(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.stream is True and request.logprobs is False
    assert request.temperature == 1.0 and isinstance(request.temperature, float)
    assert request.max_tokens == 5 and isinstance(request.max_tokens, int)
    prompt = validate(b'{"prompt": [1.0, 2], "stream": false}', CompletionRequest).prompt
    assert prompt == [1, 2] and all(type(t) is int for t in prompt)


def test_malformed_json_says_so_once():
    with pytest.raises(APIError) as info:
        validate(b'{"messages": [1,,]}', ChatCompletionRequest)
    message = info.value.message
    assert message.startswith("Invalid JSON body: ") and message.count("Invalid JSON") == 1
    assert "line 1 column" in message
