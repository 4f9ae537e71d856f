"""Structured output at the HTTP edge.

``constraint(req)`` turns what a request asks for — OpenAI's ``response_format``, vLLM's
``structured_outputs``, or a forced tool call (``tool_choice`` ``required`` or a named
function) — into one ``GrammarSpec`` for the engine; ``check_constraint`` parses it off
the event loop so an invalid schema or grammar is a 400 before anything is sent.

Forced tool calls are generated as JSON and come back as OpenAI ``tool_calls``:

- a named function: the generated text is the call's arguments object;
- ``required``: the text is ``[{"name": ..., "arguments": {...}}, ...]`` (one element
  when ``parallel_tool_calls`` is false), each name one of the tools'.

``ToolCallStream`` follows that text as it grows and yields OpenAI's tool-call deltas
(the first per call with ``id``, ``type`` and the name, then argument text).
``tool_choice="auto"`` (or no tool_choice) and ``"none"`` constrain nothing: the tools go
to the chat template. With ``auto``, when the template has a tool-call markup
(``server.tool_markup``) the reply is read for calls in it; otherwise it is plain text.
``read_reply`` and ``ReplyStream`` give a choice's message and deltas in every case.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import GrammarSpec
from engine.structured import JSON_OBJECT_SCHEMA, GrammarError, check, json_spec
from server import tool_markup
from server.errors import invalid_request
from server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    SamplingFields,
    ToolCall,
    ToolCallDelta,
)

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallMode:
    """How generated text maps to tool calls. Forced: ``function`` set → the text is that
    function's arguments; None → the text is a JSON array of ``{name, arguments}``.
    ``markup``: calls may appear in the chat template's markup, the rest is content."""

    function: str | None = None
    markup: bool = False

    @property
    def forced(self) -> bool:
        return not self.markup


@dataclass(frozen=True)
class Constraint:
    grammar: GrammarSpec | None = None
    tool_calls: ToolCallMode | None = None
    param: str | None = None  # the request field it came from (for error messages)


def constraint(req: SamplingFields, template: str | None = None) -> Constraint:
    """What ``req`` asks the generated text to be; raises a 400 on a contradiction.
    ``template``: the chat template, whose tool-call markup ``tool_choice="auto"`` reads."""
    found = [c for c in (_from_response_format(req), _from_structured_outputs(req),
                         _from_tool_choice(req)) if c.grammar is not None]  # fmt: skip
    if len(found) > 1:
        names = " and ".join(str(c.param) for c in found)
        raise invalid_request(f"only one of {names} may constrain the output", found[1].param)
    if found:
        return found[0]
    auto = isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none"
    if auto and tool_markup.template_has_markup(template):
        return Constraint(tool_calls=ToolCallMode(markup=True), param="tool_choice")
    return Constraint()


async def check_constraint(c: Constraint) -> None:
    """Parse the grammar in a worker thread; a 400 with xgrammar's reason if it is invalid."""
    if c.grammar is None:
        return
    try:
        await asyncio.to_thread(check, c.grammar)
    except GrammarError as exc:
        raise invalid_request(f"Invalid {c.grammar.kind} for {c.param}: {exc}", c.param) from exc


def _from_response_format(req: SamplingFields) -> Constraint:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return Constraint()
    if fmt.type == "json_object":
        return Constraint(GrammarSpec("json", JSON_OBJECT_SCHEMA), param="response_format")
    schema = fmt.json_schema.json_schema  # type: ignore[union-attr]  # checked by the model
    return Constraint(json_spec(schema), param="response_format.json_schema.schema")


def _from_structured_outputs(req: SamplingFields) -> Constraint:
    so = req.structured_outputs
    if so is None:
        return Constraint()
    if so.json_ is not None:
        try:
            spec = json_spec(so.json_)
        except json.JSONDecodeError as exc:
            raise invalid_request(f"structured_outputs.json is not JSON: {exc}") from exc
        return Constraint(spec, param="structured_outputs.json")
    if so.regex is not None:
        return Constraint(GrammarSpec("regex", so.regex), param="structured_outputs.regex")
    if so.grammar is not None:
        return Constraint(GrammarSpec("grammar", so.grammar), param="structured_outputs.grammar")
    if so.choice is not None:
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        return Constraint(GrammarSpec("grammar", f"root ::= {rule}"), param="structured_outputs")
    return Constraint(GrammarSpec("json", JSON_OBJECT_SCHEMA), param="structured_outputs")


def _from_tool_choice(req: SamplingFields) -> Constraint:
    if not isinstance(req, ChatCompletionRequest) or not req.tools:
        return Constraint()
    params = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return Constraint(json_spec(params[name]), ToolCallMode(name), "tool_choice")
    if choice != "required":
        return Constraint()
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(name, schema) for name, schema in params.items()]},
    }
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return Constraint(json_spec(calls), ToolCallMode(), "tool_choice")


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---- generated text → tool calls -----------------------------------------------------------


@dataclass
class _Call:
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None


def _scan_calls(text: str) -> list[_Call]:
    """The calls in a (possibly unfinished) ``[{"name": ..., "arguments": ...}, ...]``:
    each name once its string is complete, and where its arguments' text lies."""
    calls: list[_Call] = []
    depth, key, string_start, last_string = 0, None, -1, ""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                last_string = text[string_start : i + 1]
                if depth == 2 and key == "name" and calls:
                    calls[-1].name = json.loads(last_string)
            continue
        pending = calls and calls[-1].arguments_start is None
        if pending and depth == 2 and key == "arguments" and not ch.isspace():
            calls[-1].arguments_start = i
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "[{":
            depth += 1
            if depth == 2:
                calls.append(_Call())
                key = None
        elif ch in "]}":
            depth -= 1
            if depth == 2 and key == "arguments" and calls:
                calls[-1].arguments_end = i + 1
        elif ch == ":" and depth == 2:
            key = json.loads(last_string)
        elif ch == "," and depth == 2:
            key = None
    return calls


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(text: str, mode: ToolCallMode) -> list[ToolCall]:
    """The calls in a finished generation (the grammar guarantees their shape)."""
    if mode.function is not None:
        return [ToolCall(id=_new_call_id(), function=FunctionCall(name=mode.function,
                                                                   arguments=text))]  # fmt: skip
    return [
        ToolCall(id=_new_call_id(), function=FunctionCall(name=call.name or "", arguments=args))
        for call, args in _arguments(text, _scan_calls(text))
    ]


def _arguments(text: str, calls: list[_Call]) -> list[tuple[_Call, str]]:
    return [
        (c, text[c.arguments_start : c.arguments_end or len(text)])
        for c in calls
        if c.arguments_start is not None
    ]


@dataclass
class ToolCallStream:
    """Tool-call deltas from the generated text, as it grows."""

    mode: ToolCallMode
    text: str = ""
    _ids: list[str] = field(default_factory=list)
    _sent: list[int] = field(default_factory=list)  # argument characters sent, per call

    def feed(self, delta: str) -> list[ToolCallDelta]:
        self.text += delta
        out = []
        for index, (name, arguments) in enumerate(self._calls()):
            if index == len(self._ids):
                if name is None:
                    break
                self._ids.append(_new_call_id())
                self._sent.append(0)
                head = FunctionCallDelta(name=name, arguments="")
                out.append(ToolCallDelta(index=index, id=self._ids[index], type="function",
                                         function=head))  # fmt: skip
            new = arguments[self._sent[index] :]
            if new:
                self._sent[index] = len(arguments)
                out.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=new)))
        return out

    def _calls(self) -> list[tuple[str | None, str]]:
        if self.mode.function is not None:
            return [(self.mode.function, self.text)]
        calls = _scan_calls(self.text)
        args = {id(c): a for c, a in _arguments(self.text, calls)}
        return [(c.name, args.get(id(c), "")) for c in calls]


def read_reply(
    text: str, mode: ToolCallMode | None, finish: str | None
) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish reason (``tool_calls`` when it made calls
    and stopped by itself, as OpenAI reports them)."""
    if mode is None:
        return AssistantMessage(content=text), finish
    if mode.markup:
        content, calls = tool_markup.parse(text)
    elif finish == "stop":
        content, calls = None, tool_calls(text, mode)
    else:  # cut short: the JSON is incomplete
        content, calls = text, []
    reason = "tool_calls" if calls and finish == "stop" else finish
    return AssistantMessage(content=content, tool_calls=calls or None), reason


class ReplyStream:
    """One streamed choice: content and tool-call deltas from its text deltas."""

    def __init__(self, mode: ToolCallMode | None) -> None:
        self._forced = ToolCallStream(mode) if mode and mode.forced else None
        self._markup = tool_markup.MarkupStream() if mode and mode.markup else None
        self._made_calls = False

    def feed(self, text: str, final: bool) -> ChatDelta:
        if self._forced is not None:
            content, calls = "", self._forced.feed(text)
        elif self._markup is not None:
            content, calls = self._markup.feed(text, final)
        else:
            content, calls = text, []
        self._made_calls |= bool(calls)
        return ChatDelta(content=content or None, tool_calls=calls or None)

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if self._made_calls and finish == "stop" else finish
