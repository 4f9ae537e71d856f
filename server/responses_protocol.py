"""The Responses API's schemas (pydantic), as ``POST /v1/responses`` accepts and returns
them: the request with its input items, and the response object with its output items.

Unknown top-level fields are ignored (and logged once), as on chat; chat's sampling
extensions (``seed``, ``top_k``, ``ignore_eos``...) are accepted, as vLLM does. Fields the API
defines that ferry cannot honour are named by ``ResponsesRequest.unsupported()``, which
the server turns into a 400; hints that change nothing ferry does (``metadata``,
``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ...) are accepted.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationInfo, field_validator

from server.protocol import (
    ChatTokenLogprob,
    Int64,
    RequestBody,
    _Request,
    stream_options_need_stream,
    type_of,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# ---- the request ------------------------------------------------------------------------


class InputText(_Request):
    """Text of an input message (``output_text``: an earlier answer passed back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherInputPart(_Request):
    """A content part ferry does not handle (images, files, audio...); a 400 while serving."""

    type: str


def _part_kind(part: Any) -> str:
    return "<text>" if type_of(part) in ("input_text", "output_text", "text") else "<other>"


# chosen by ``type``: a text part with a bad field is an error about that field
InputPart = Annotated[
    Annotated[InputText, Tag("<text>")] | Annotated[OtherInputPart, Tag("<other>")],
    Discriminator(_part_kind),
]


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallItem(_Request):
    """A call the model made earlier, passed back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)  # as on chat, where it becomes a message's tool call
    arguments: str


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]


class OtherItem(_Request):
    """An input item ferry does not handle (reasoning, item references, hosted tools)."""

    type: str


def _item_kind(item: Any) -> str:
    kind = type_of(item, "message" if isinstance(item, dict) else "")
    known = kind in ("message", "function_call", "function_call_output")
    return f"<{kind}>" if known else "<other>"


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[OtherItem, Tag("<other>")],
    Discriminator(_item_kind),
]


# text, or items; a bad item's error names only the item (not also "not a string")
Input = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[InputItem], Tag("<items>")],
    Discriminator(lambda value: "<text>" if isinstance(value, str) else "<items>"),
]


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesTool(_Request):
    """A function tool (``type`` other than ``function`` is a 400 while serving)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice | dict[str, Any]


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Int64 | None = Field(None, ge=1)  # chat's bound, by this name
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[ResponsesTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    # chat's sampling extensions (vLLM's), passed on as they are
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    # defined by the API, not done by ferry: a 400 when set to anything but "off"
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: Int64 | None = None
    context_management: Any = None

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, value: Any, info: ValidationInfo) -> Any:
        return stream_options_need_stream(value, info)

    EXTENSIONS: ClassVar[tuple[str, ...]] = (
        "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
        "repetition_penalty", "ignore_eos",
    )  # fmt: skip

    def unsupported(self) -> list[str]:
        """The fields set to something ferry cannot do, by name (``tools.1.type``...)."""
        named = [name for name in ("conversation", "prompt", "max_tool_calls",
                                   "context_management") if getattr(self, name) is not None]
        if self.background:
            named.append("background")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            named.append("reasoning")
        if self.truncation not in (None, "disabled"):
            named.append("truncation")
        if any(item != LOGPROBS_INCLUDE for item in self.include or []):
            named.append("include")
        named += [f"tools.{i}.type" for i, t in enumerate(self.tools) if t.type != "function"]
        named += [f"tools.{i}.name" for i, t in enumerate(self.tools)
                  if t.type == "function" and not t.name]  # fmt: skip
        if isinstance(self.tool_choice, dict):
            named.append("tool_choice")
        return named

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


# ---- the response -----------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A call the model made (``function_call`` output item)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response; ``status``: ``in_progress`` (a stream's first snapshots),
    ``completed``, ``incomplete`` (``max_output_tokens`` reached) or ``failed``."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
