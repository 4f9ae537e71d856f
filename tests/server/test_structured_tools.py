"""server.structured without a server: request → GrammarSpec, and generated text → tool
calls, whole and streamed."""

from __future__ import annotations

import json

import pytest

from engine.sampling_params import GrammarSpec
from engine.structured import check
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.structured import (
    ReplyStream,
    ToolCallMode,
    ToolCallStream,
    constraint,
    read_reply,
    tool_calls,
)

ASK = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "b"}},
]
CALLS = '[{"name": "a", "arguments": {"s": "x\\"}{", "n": [1, {"k": 2}]}}, {"name": "b", "arguments": {}}]'  # noqa: E501


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **body})


def test_response_format_and_structured_outputs_become_specs():
    schema = {"type": "object", "properties": {"z": {}, "a": {}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    c = constraint(chat(response_format=fmt))
    assert c.grammar == GrammarSpec("json", '{"type":"object","properties":{"z":{},"a":{}}}')
    assert constraint(chat(response_format={"type": "text"})).grammar is None
    assert constraint(chat(response_format={"type": "json_object"})).grammar.kind == "json"
    c = constraint(CompletionRequest(prompt="x", structured_outputs={"choice": ["a", 'b"c']}))
    assert c.grammar == GrammarSpec("grammar", 'root ::= "a" | "b\\"c"')
    assert constraint(chat(structured_outputs={"regex": "x+"})).grammar.kind == "regex"
    assert constraint(chat(tools=TOOLS, tool_choice="auto")).grammar is None


def test_two_constraints_are_a_400():
    with pytest.raises(APIError, match="only one of") as info:
        constraint(chat(response_format={"type": "json_object"}, tools=TOOLS,
                        tool_choice="required"))  # fmt: skip
    assert info.value.status == 400


def test_forced_tool_choice_schemas():
    named = constraint(chat(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "b"}}))  # fmt: skip
    assert named.tool_calls == ToolCallMode("b")
    assert json.loads(named.grammar.value) == {"type": "object", "properties": {}}
    required = constraint(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.grammar.value)
    assert required.tool_calls == ToolCallMode() and schema["maxItems"] == 1
    names = [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]]
    assert names == ["a", "b"]


def test_tool_calls_from_the_whole_text():
    calls = tool_calls(CALLS, ToolCallMode())
    assert [c.function.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].function.arguments) == {"s": 'x"}{', "n": [1, {"k": 2}]}
    assert calls[1].function.arguments == "{}"
    assert len({c.id for c in calls}) == 2
    (only,) = tool_calls('{"q": 1}', ToolCallMode("b"))
    assert (only.function.name, only.function.arguments) == ("b", '{"q": 1}')


@pytest.mark.parametrize("step", [1, 2, 5, len(CALLS)])
def test_streamed_calls_come_whole_one_delta_per_index(step):
    stream = ToolCallStream(ToolCallMode())
    deltas = []
    for i in range(0, len(CALLS), step):
        deltas += stream.feed(CALLS[i : i + step])
    assert [d.index for d in deltas] == [0, 1]
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    whole = tool_calls(CALLS, ToolCallMode())
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


ARGUMENTS = '{"q": [1, {"r": "}"}], "s": 2}'
FIRST_CALL_END = CALLS.index("]}}") + 2  # where call a's arguments close


@pytest.mark.parametrize("mode", [ToolCallMode(), ToolCallMode("b")])
@pytest.mark.parametrize("cut", [1, 12, len(ARGUMENTS) - 1, FIRST_CALL_END, len(CALLS) - 3])
def test_a_call_cut_short_is_dropped_alike_streamed_and_not(mode, cut):
    text = CALLS[:cut] if mode.function is None else ARGUMENTS[: min(cut, len(ARGUMENTS) - 1)]
    message, finish = read_reply(text, mode, "length")
    streamed = ReplyStream(mode)
    deltas = [d for i in range(len(text)) for d in streamed.feed(text[i], False).tool_calls or []]
    assert finish == streamed.finish_reason("length") == "length"
    assert message.content is None
    calls = message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (d.function.name, d.function.arguments) for d in deltas
    ]
    assert len(calls) == (1 if mode.function is None and cut >= FIRST_CALL_END else 0)


def test_required_keeps_root_relative_refs_valid():
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Inner"},
                                               "self": {"$ref": "#"}},
              "$defs": {"Inner": inner}, "required": ["a"]}  # fmt: skip
    tools = [TOOLS[1], {"type": "function", "function": {"name": "c", "parameters": params}}]
    wanted = constraint(chat(tools=tools, tool_choice="required"))
    check(wanted.grammar)  # raised "Cannot find field '$defs'" before
    refs = json.loads(wanted.grammar.value)["items"]["anyOf"][1]["properties"]["arguments"]
    assert refs["properties"]["a"]["$ref"] == "#/items/anyOf/1/properties/arguments/$defs/Inner"
    assert refs["properties"]["self"]["$ref"] == "#/items/anyOf/1/properties/arguments"


QWEN_LIKE = "{% if tools %}... <tool_call>{...}</tool_call> ...{% endif %}"
REPLY = (
    'Let me check. <tool_call>\n{"name": "a", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<tool_call>not json</tool_call> done"
)


def test_auto_reads_the_templates_markup_only_when_it_has_one():
    req = chat(tools=TOOLS)
    assert constraint(req, QWEN_LIKE).tool_calls == ToolCallMode(markup=True)
    assert constraint(req, "{{ messages }}").tool_calls is None
    assert constraint(chat(tools=TOOLS, tool_choice="none"), QWEN_LIKE).tool_calls is None


def test_markup_calls_whole_and_streamed():
    message, finish = read_reply(REPLY, ToolCallMode(markup=True), "stop")
    assert finish == "tool_calls"
    assert message.content == "Let me check. <tool_call>not json</tool_call> done"
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("a", {"city": "Paris"})
    for step in (1, 3, 7):
        stream = ReplyStream(ToolCallMode(markup=True))
        content, calls = [], []
        for i in range(0, len(REPLY), step):
            delta = stream.feed(REPLY[i : i + step], final=i + step >= len(REPLY))
            content.append(delta.content or "")
            calls += delta.tool_calls or []
        assert "".join(content) == "Let me check. <tool_call>not json</tool_call> done"
        assert [(c.index, c.function.name) for c in calls] == [(0, "a")]
        assert stream.finish_reason("stop") == "tool_calls"
    plain, finish = read_reply("no calls <tool_", ToolCallMode(markup=True), "stop")
    assert (plain.content, plain.tool_calls, finish) == ("no calls <tool_", None, "stop")
