"""``POST /v1/responses`` (OpenAI's Responses API) on top of the chat path.

A Responses request is turned into a chat request (``chat_request``) and runs exactly as
one: the same template rendering, context checks, structured output (``text.format``),
forced tool calls through the grammar path, and the same reading of the reply into
content and tool calls (``serving.collect_replies`` / ``serving.reply_deltas``). What is
its own here is the translation and the shapes: input items to chat messages; the reply
to output items (a ``message`` with one ``output_text``, then one ``function_call`` per
call); ``stream`` as typed events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ... ``response.completed`` or ``response.incomplete``, or
``response.failed`` after an ``error`` event), each with its ``sequence_number``.

Conversations: a response stored (``store``, the default) keeps the chat messages of its
input and output; ``previous_response_id`` continues from them (its ``instructions`` do
not carry over, as in OpenAI's API). A call cut short by ``max_output_tokens`` is left
out, streamed or not, and the response is ``incomplete``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError

from server.errors import APIError, invalid_request, validation_error
from server.logprobs import LogprobFormatter
from server.protocol import AssistantMessage, ChatCompletionRequest, ToolCall
from server.response_store import ResponseStore, StoredResponse
from server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionChoice,
    IncompleteDetails,
    InputPart,
    InputText,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.serving import Job, Serving, Tally, as_api_error, collect_replies, reply_deltas

MAX_TOP_LOGPROBS = 20


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request → chat ------------------------------------------------------------------------


def previous(req: ResponsesRequest, store: ResponseStore) -> StoredResponse | None:
    """The stored response ``req`` continues; 404 when there is none (never stored,
    expired, deleted, or made with ``store: false``)."""
    if req.previous_response_id is None:
        return None
    found = store.get(req.previous_response_id)
    if found is None:
        raise APIError(
            f"Previous response with id '{req.previous_response_id}' not found.",
            404, param="previous_response_id", code="previous_response_not_found",
        )  # fmt: skip
    return found


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages; consecutive function calls become one assistant message
    with several ``tool_calls``."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise invalid_request("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, i)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, i)})  # fmt: skip
        else:
            raise invalid_request(f"input item type {item.type!r} is not supported",
                                  f"input.{i}.type")  # fmt: skip
    return messages


def _text(content: str | list[InputPart], position: int) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if not isinstance(part, InputText):
            raise invalid_request(f"content part type {part.type!r} is not supported",
                                  f"input.{position}.content")  # fmt: skip
    return "\n".join(part.text for part in content)  # type: ignore[union-attr]


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that does what ``req`` asks, after the ``history`` messages."""
    unsupported = req.unsupported()
    if unsupported:
        raise invalid_request(
            f"not supported by this server: {', '.join(unsupported)}", unsupported[0]
        )
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages + history,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
        **{name: getattr(req, name) for name in req.EXTENSIONS},
    }
    if req.wants_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}  # fmt: skip
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.tool_choice not in ("auto", "none") and not req.tools:
        raise invalid_request(f"tool_choice {_choice_name(req.tool_choice)} requires tools",
                              "tool_choice")  # fmt: skip
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                      exclude_none=True)}
                         for t in req.tools]  # fmt: skip
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionChoice) else choice)  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def _choice_name(choice: Any) -> str:
    return repr(choice.name) if isinstance(choice, FunctionChoice) else repr(choice)


async def prepare(serving: Serving, store: ResponseStore, req: ResponsesRequest) -> Any:
    """Check ``req`` and ready it for the engine; any problem raises ``APIError`` first."""
    earlier = previous(req, store)
    history = [*(earlier.messages if earlier else ()), *input_messages(req)]
    job = await serving.prepare_chat(chat_request(req, history))
    return ResponsesRenderer(serving, store, req, job, history)


def stored(store: ResponseStore, response_id: str) -> StoredResponse:
    """A stored response, or a 404."""
    found = store.get(response_id)
    if found is None:
        raise APIError(f"No response with id '{response_id}' found.", 404,
                       param="response_id", code="response_not_found")  # fmt: skip
    return found


# ---- reply → response ----------------------------------------------------------------------


class ResponsesRenderer:
    """The response body, or its event stream, of one Responses request run as ``job``;
    a finished response is stored when the request asks (``store``)."""

    def __init__(
        self,
        serving: Serving,
        store: ResponseStore,
        req: ResponsesRequest,
        job: Job,
        history: list[dict[str, Any]],
    ) -> None:
        self.serving = serving
        self.store = store
        self.req = req
        self.job = job
        self.history = history
        self.id = _new_id("resp")
        self.message_id = _new_id("msg")
        self.logprobs = LogprobFormatter(serving.tokenizer, req.top_logprobs or 0)

    def snapshot(self, status: str, output: list[OutputItem], usage: Any = None,
                 error: APIError | None = None) -> ResponseObject:  # fmt: skip
        """The response object with everything the request set, as it stands."""
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.job.created, status=status, model=self.job.model,
            output=output, usage=usage,
            error=None if error is None else ResponseError(code=error.code or error.type,
                                                           message=error.message),
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, store=req.store,
            temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs,
            text=(req.text.model_dump(by_alias=True, exclude_none=True)
                  if req.text and req.text.format else {"format": {"type": "text"}}),
            tool_choice=(req.tool_choice if isinstance(req.tool_choice, str | dict)
                         else req.tool_choice.model_dump()),
            tools=[t.model_dump(exclude_none=True) for t in req.tools],
            user=req.user, metadata=req.metadata or {},
        )  # fmt: skip

    def message_item(self, text: str, status: str, logprobs: list | None) -> OutputMessage:
        part = OutputText(text=text, logprobs=logprobs)
        return OutputMessage(id=self.message_id, status=status, content=[part])

    @staticmethod
    def call_item(call: ToolCall) -> FunctionCallOutput:
        function = call.function
        return FunctionCallOutput(id=_new_id("fc"), call_id=call.id, name=function.name,
                                  arguments=function.arguments, status="completed")  # fmt: skip

    def _finish(self, status: str, output: list[OutputItem], usage: Any) -> ResponseObject:
        """The finished response, stored when asked for."""
        response = self.snapshot(status, output, usage)
        if self.req.store:
            calls = [ToolCall(id=o.call_id, function={"name": o.name, "arguments": o.arguments})
                     for o in output if isinstance(o, FunctionCallOutput)]  # fmt: skip
            texts = [o.content[0].text for o in output if isinstance(o, OutputMessage)]
            content = texts[0] if texts else (None if calls else "")  # never neither
            reply = AssistantMessage(content=content, tool_calls=calls or None)
            messages = (*self.history, reply.model_dump(exclude_none=True))
            self.store.put(StoredResponse(response, messages))
        return response

    async def response(self) -> ResponseObject:
        done = await collect_replies(self.serving, self.job)
        reply = done.replies[0]
        status = _status(reply.finish_reason)
        output: list[OutputItem] = []
        if reply.message.content is not None:
            logprobs = [self.logprobs.chat(e) for e in reply.logprobs]
            output.append(self.message_item(reply.message.content, _item_status(status),
                                        logprobs if self.req.wants_logprobs else None))  # fmt: skip
        output += [self.call_item(c) for c in reply.message.tool_calls or []]
        return self._finish(status, output, _usage(done.usage))

    async def stream(self) -> AsyncIterator[str]:
        events = _EventStream(self)
        yield events.send("response.created", response=self.snapshot("in_progress", []))
        yield events.send("response.in_progress", response=self.snapshot("in_progress", []))
        tally = Tally(self.job)
        finish = None
        try:
            async with aclosing(reply_deltas(self.serving, self.job, tally)) as deltas:
                async for d in deltas:
                    if d.delta.content:
                        lp = [self.logprobs.chat(e) for e in d.event.logprobs or []]
                        for line in events.text(d.delta.content, lp):
                            yield line
                    for call in d.delta.tool_calls or []:
                        for line in events.call(call):
                            yield line
                    finish = d.finish_reason
            status = _status(finish)
            if not events.output and self.job.tool_calls is None:
                for line in events.text("", []):  # a message even when nothing was said
                    yield line
            for line in events.close_message(_item_status(status)):
                yield line
            response = self._finish(status, events.output, _usage(tally.usage()))
            yield events.send(f"response.{status}", response=response)
        except Exception as exc:
            error = as_api_error(exc)
            yield events.send("error", code=error.code or error.type, message=error.message,
                              param=error.param)  # fmt: skip
            yield events.send("response.failed",
                              response=self.snapshot("failed", events.output, error=error))


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _item_status(status: str) -> str:
    return "incomplete" if status == "incomplete" else "completed"


def _usage(usage: Any) -> ResponseUsage:
    """Chat's usage in the Responses API's names."""
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


class _EventStream:
    """The typed events of one streamed response, numbered; ``output`` is what has been
    sent of the response's output so far (the message first once it has text)."""

    def __init__(self, renderer: ResponsesRenderer) -> None:
        self.renderer = renderer
        self.sequence = 0
        self.output: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._logprobs: list = []

    def send(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **_plain(fields)}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.output.index(item)}

    def text(self, delta: str, logprobs: list) -> list[str]:
        lines = []
        message = self._message
        if message is None:
            message = self._message = self.renderer.message_item("", "in_progress", None)
            message.content = []
            self.output.append(message)
            lines.append(self.send("response.output_item.added",
                                   output_index=self.output.index(message), item=message))
            message.content.append(OutputText(text=""))
            lines.append(self.send("response.content_part.added", **self._where(message),
                                   content_index=0, part=message.content[0]))  # fmt: skip
        message.content[0].text += delta
        self._logprobs += logprobs
        if delta:
            lines.append(self.send("response.output_text.delta", **self._where(message),
                                   content_index=0, delta=delta, logprobs=logprobs))  # fmt: skip
        return lines

    def close_message(self, status: str) -> list[str]:
        message = self._message
        if message is None:
            return []
        part = message.content[0]
        if self.renderer.req.wants_logprobs:
            part.logprobs = self._logprobs
        message.status = status
        where = {**self._where(message), "content_index": 0}
        return [
            self.send("response.output_text.done", **where, text=part.text,
                      logprobs=self._logprobs),
            self.send("response.content_part.done", **where, part=part),
            self.send("response.output_item.done", output_index=where["output_index"],
                      item=message),
        ]  # fmt: skip

    def call(self, delta: Any) -> list[str]:
        """A whole tool call (streamed calls come whole) as its item's events."""
        call = ToolCall(id=delta.id, function={"name": delta.function.name,
                                               "arguments": delta.function.arguments})
        item = self.renderer.call_item(call)
        self.output.append(item)
        opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        where = self._where(item)
        return [
            self.send("response.output_item.added", output_index=where["output_index"],
                      item=opened),
            self.send("response.function_call_arguments.delta", **where,
                      delta=item.arguments),
            self.send("response.function_call_arguments.done", **where, name=item.name,
                      arguments=item.arguments),
            self.send("response.output_item.done", output_index=where["output_index"],
                      item=item),
        ]  # fmt: skip


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """Event fields as JSON values (pydantic models dumped, lists of them too)."""

    def plain(value: Any) -> Any:
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in fields.items()}
