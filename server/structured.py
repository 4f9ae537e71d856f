"""Structured output at the HTTP edge.

``constraint(req)`` turns what a request asks for — OpenAI's ``response_format``, vLLM's
``structured_outputs``, or a forced tool call (``tool_choice`` ``required`` or a named
function) — into one ``GrammarSpec`` for the engine; ``check_constraint`` parses it off
the event loop so an invalid schema or grammar is a 400 before anything is sent.

Forced tool calls are generated as JSON and come back as OpenAI ``tool_calls``:

- a named function: the generated text is the call's arguments object;
- ``required``: the text is ``[{"name": ..., "arguments": {...}}, ...]`` (one element
  when ``parallel_tool_calls`` is false), each name one of the tools'.

A tool's parameters may use root-relative ``$ref``s (``#/$defs/...``, as pydantic writes
nested models); in the ``required`` wrapper they are rebased onto where the parameters
sit. ``complete_calls`` reads the calls whose JSON is complete; a call cut short by
``max_tokens`` is dropped (finish reason ``length``), streamed or not: ``ToolCallStream``
sends each call whole (id, type, name and arguments in one delta) once it is complete.
``tool_choice="auto"`` (or no tool_choice) and ``"none"`` constrain nothing: the tools go
to the chat template. With ``auto``, when the template has a tool-call markup
(``server.tool_markup``) the reply is read for calls in it; otherwise it is plain text.
``read_reply`` and ``ReplyStream`` give a choice's message and deltas in every case.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
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
    NamedToolChoice,
    SamplingFields,
    ToolCall,
    ToolCallDelta,
)

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


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
        "items": {"anyOf": [_call_schema(name, _rebase(schema, f"#/items/anyOf/{i}/properties/"
                                                         "arguments"))
                            for i, (name, schema) in enumerate(params.items())]},
    }  # fmt: skip
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return Constraint(json_spec(calls), ToolCallMode(), "tool_choice")


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` moved to JSON pointer ``base`` of a larger schema: its root-relative
    references (``#``, ``#/$defs/...``, what pydantic writes for nested models) now
    point into it there."""
    if isinstance(schema, list):
        return [_rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _rebase(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


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


_NAMED = '[{"name": "", "arguments": '  # a named call's arguments, read as a list's one call


def complete_calls(text: str, mode: ToolCallMode) -> list[FunctionCall]:
    """The calls whose JSON is complete in a forced generation, finished or cut short; a
    call cut short is not among them (as OpenAI, who returns no partial call)."""
    if mode.function is not None:
        (call,) = _scan_calls(_NAMED + text)
        if call.arguments_end is None:
            return []
        end = call.arguments_end - len(_NAMED)
        return [FunctionCall(name=mode.function, arguments=text[:end])]
    return [
        FunctionCall(name=c.name or "", arguments=text[c.arguments_start : c.arguments_end])
        for c in _scan_calls(text)
        if c.arguments_end is not None
    ]


def tool_calls(text: str, mode: ToolCallMode) -> list[ToolCall]:
    """The complete calls of a generation, with fresh ids."""
    return [tool_markup.new_call(call) for call in complete_calls(text, mode)]


@dataclass
class ToolCallStream:
    """Tool-call deltas from the generated text, as it grows: each call whole (id, type,
    name and arguments in one delta) once its JSON is complete, so a stream cut short
    sends no partial call, exactly as the non-streamed reply has none."""

    mode: ToolCallMode
    text: str = ""
    _sent: int = 0  # calls sent

    def feed(self, delta: str) -> list[ToolCallDelta]:
        self.text += delta
        calls = complete_calls(self.text, self.mode)
        new = [tool_markup.whole_call_delta(i, c) for i, c in enumerate(calls) if i >= self._sent]
        self._sent = len(calls)
        return new


def read_reply(
    text: str, mode: ToolCallMode | None, finish: str | None
) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish reason (``tool_calls`` when it made calls
    and stopped by itself, as OpenAI reports them)."""
    if mode is None:
        return AssistantMessage(content=text), finish
    if mode.markup:
        content, calls = tool_markup.parse(text)
    else:  # forced: the complete calls; one cut short is dropped
        content, calls = None, tool_calls(text, mode)
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
