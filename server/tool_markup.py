"""Tool calls written in a chat template's own markup, for ``tool_choice="auto"``.

Templates that render ``tools`` for the model (Qwen2/2.5/3, Hermes and others) teach it to
answer a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. When the
model's template mentions that tag, the reply is read for such blocks: each whose JSON
holds a name becomes an OpenAI tool call, the text around them stays the content. A block
whose JSON does not parse stays in the content, as text. Templates without the tag
(SmolLM2's) get plain text replies.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from server.protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def template_has_markup(template: str | None) -> bool:
    return bool(template) and OPEN in template


def _call(body: str) -> FunctionCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(name=value["name"], arguments=text)


def new_call(call: FunctionCall) -> ToolCall:
    """``call`` as a tool call with a fresh id."""
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=call)


def whole_call_delta(index: int, call: FunctionCall) -> ToolCallDelta:
    """One streamed delta that carries a whole call: id, type, name and arguments."""
    head = FunctionCallDelta(name=call.name, arguments=call.arguments)
    return ToolCallDelta(index=index, id=new_call(call).id, type="function", function=head)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content (None when only calls remain) and the calls of a finished reply."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(new_call(call))
        return ""

    content = _BLOCK.sub(take, text)
    if calls and not content.strip():
        return None, calls
    return (content.strip() if calls else content), calls


@dataclass
class MarkupStream:
    """Splits a streamed reply into content deltas and whole tool calls.

    Text that may be the start of ``<tool_call>`` is held back until it is known not to be;
    a call is sent (id, name and all its arguments at once) when its block closes.
    """

    buffer: str = ""
    num_calls: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_open(self.buffer)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                if final:  # an unclosed block stays text
                    content.append(self.buffer)
                    self.buffer = ""
                break
            content.append(self.buffer[:start])
            block = self.buffer[start : end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE) :]
            call = _call(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                content.append(block)
                continue
            calls.append(whole_call_delta(self.num_calls, call))
            self.num_calls += 1
        return "".join(content), calls


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
