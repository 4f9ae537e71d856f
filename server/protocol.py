"""OpenAI request and response schemas (pydantic), as ``/v1/chat/completions`` and
``/v1/completions`` accept and return them.

Requests ignore unknown top-level fields, like OpenAI and vLLM; each unknown name is
logged once, at debug level (``ferry.server``). A request body's values must be of their
field's JSON type, as OpenAI checks them (``server.body`` validates it strictly):
``"stream": "yes"`` or ``"max_tokens": "5"`` is a 400, not read as ``true`` or ``5``. A
number field takes an integer (``"temperature": 1``), and an integer field a number
written with a zero fraction (``5.0``), which JSON does not tell apart from ``5``.
Range checks of sampling values are not repeated here:
``engine.sampling_params.SamplingParams`` owns them and the serving layer turns its
``SamplingError`` into a 400 naming the request's field. What is bounded
here is what would cost the server before any such check: integers fit in 64 bits
(``Int64``: no 4,300-digit number reaches ``int()`` or ``str()``), ``logit_bias`` keys are
token ids of at most 10 digits, and one request starts at most ``MAX_CHOICES`` sequences
(``n`` × prompts).
Responses are built with these models and serialized with ``model_dump_json``; ``None``
fields are kept (OpenAI sends ``null``).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from server.errors import FieldError

MAX_N = 128
MAX_CHOICES = 128  # sequences one request may start: n x prompts
MAX_STOP_STRINGS = 4
MAX_TOKEN_ID_DIGITS = 10  # token ids are below 2**31

MAX_LOGGED_UNKNOWN = 256  # distinct unknown field names logged; later ones are not



def _whole(value: Any) -> Any:
    """A number with a zero fraction (``5.0``) as the integer it is; anything else as it
    came, for the strict integer check (a string or a boolean is refused there)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int64 = Annotated[int, BeforeValidator(_whole), Field(ge=-(2**63), lt=2**63)]

log = logging.getLogger("ferry.server")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(_Request):
    """A whole request body: unknown top-level fields are ignored, and the first time a
    name is seen (per body type) it is logged at debug level."""

    _logged: ClassVar[set[tuple[str, str]]] = set()

    @model_validator(mode="before")
    @classmethod
    def _note_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
            known = {n for name, f in cls.model_fields.items() for n in (name, f.alias) if n}
            for name in sorted(set(data) - known):
                key = (cls.__name__, str(name)[:64])
                if key not in cls._logged and len(cls._logged) < MAX_LOGGED_UNKNOWN:
                    cls._logged.add(key)
                    log.debug("%s: ignoring unknown field %r", cls.__name__, key[1])
        return data


class StreamOptions(_Request):
    include_usage: bool = False


def stream_options_need_stream(value: Any, info: ValidationInfo) -> Any:
    """``stream_options`` with ``stream`` false is a 400, as OpenAI answers (declare
    ``stream`` before ``stream_options``)."""
    if value is not None and not info.data.get("stream", False):
        raise ValueError("stream_options is only allowed when stream is true")
    return value


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    """Where an image is: a ``data:image/...;base64,`` URL, or an http(s) URL of a host
    the server fetches from (``encode.inputs``). ``detail`` is accepted and has no effect:
    the model sees the image at the resolution its processor chooses."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


class OtherPart(_Request):
    """A content part ferry does not handle (audio, files...); rejected while serving."""

    type: str


def type_of(value: Any, default: str | None = None) -> str | None:
    """The ``type`` of a tagged part or item, as a dict being validated or as a model."""
    if isinstance(value, dict):
        return value.get("type", default)
    return getattr(value, "type", default)


def _part_kind(part: Any) -> str:
    kind = type_of(part)
    return f"<{kind}>" if kind in ("text", "image_url") else "<other>"


# chosen by ``type``: a text or image part with a bad field is an error about that field,
# not "content part type 'text' is not supported"
ContentPart = Annotated[
    Annotated[TextPart, Tag("<text>")]
    | Annotated[ImageURLPart, Tag("<image_url>")]
    | Annotated[OtherPart, Tag("<other>")],
    Discriminator(_part_kind),
]


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


class CalledFunction(_Request):
    """The function an earlier assistant turn called. ``arguments`` is JSON text as the
    model wrote it, handed to the chat template unparsed: OpenAI does not parse it either
    (a model's arguments are not always valid JSON, and such a turn is sent back as is)."""

    name: str = Field(min_length=1)
    arguments: str


class MessageToolCall(_Request):
    """A tool call of an assistant message sent back; a missing ``type`` is a function's."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    """Content is required except on an assistant message that makes tool calls; a tool
    message names the call it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _required_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldError("tool_call_id", "a tool message needs tool_call_id")
        return self


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one constraint on the generated text."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [self.json_, self.regex, self.grammar, self.choice, self.json_object or None]
        if sum(v is not None for v in given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, grammar, choice, json_object"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")
        return self


class SamplingFields(RequestBody):
    """Fields shared by chat and completions: OpenAI's plus vLLM's common extensions."""

    model: str | None = None
    n: Int64 = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias
    # vLLM extensions
    top_k: Int64 | None = Field(None, ge=-1, lt=2**31)  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = Field(0, ge=0, lt=2**31)
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: Int64 | None = None
    # ferry: false keeps this request out of speculative decoding (where it is on)
    speculative: bool = True

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        return stream_options_need_stream(value, info)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            digits = key.removeprefix("-")
            if not (digits.isascii() and digits.isdigit()) or len(digits) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("stream", False):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    logprobs_param: ClassVar[str] = "logprobs"  # the field ``num_logprobs`` comes from

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token the engine should return (None: no logprobs)."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token the engine should return (None: none)."""
        return self.prompt_logprobs


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    logprobs_param: ClassVar[str] = "top_logprobs"

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise FieldError("tool_choice", "tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice",
                             f"tool_choice names function {choice.function.name!r}, not in tools")
        return self

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the output length: ``max_completion_tokens`` when given
        (whatever its value), else the older ``max_tokens``."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_param)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[Int64] | list[list[Int64]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    suffix: str | None = None
    echo: bool = False
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    best_of: Int64 | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Prompt) -> Prompt:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("token id prompts must not be empty")
        return value

    @model_validator(mode="after")
    def _bounded_fan_out(self) -> CompletionRequest:
        if self.num_prompts * self.n > MAX_CHOICES:
            raise FieldError(
                "n" if self.n > 1 else "prompt",
                f"{self.num_prompts} prompts x n={self.n} would start "
                f"{self.num_prompts * self.n} sequences; at most {MAX_CHOICES} per request"
            )
        return self

    @property
    def num_prompts(self) -> int:
        """How many prompts ``prompt`` holds (a text, a token list, or a list of either)."""
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return 1 if single else len(self.prompt)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` scores the prompt too; vLLM's ``prompt_logprobs``."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if n is not None]  # fmt: skip
        return max(wanted) if wanted else None


# ---- responses ------------------------------------------------------------------------


class _OmitsNone(BaseModel):
    """Fields named in ``_omit_none`` are left out of the JSON when None (as OpenAI leaves
    out ``tool_calls``, and vLLM's ``prompt_logprobs`` extension when not asked for)."""

    _omit_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        for name in self._omit_none:
            if body.get(name) is None:
                body.pop(name, None)
        return body


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class PromptLogprob(BaseModel):
    """One token of vLLM's ``prompt_logprobs``: keyed by token id in its position's dict."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# per prompt token (the first None): the token itself, then the top alternatives
PromptLogprobList = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_OmitsNone):
    """``tool_calls`` is left out when there are none, as OpenAI does."""

    _omit_none = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_OmitsNone):
    _omit_none = ("prompt_logprobs",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobList | None = None  # vLLM's extension


class ChatDelta(BaseModel):
    """Serialized without its unset fields: ``{}`` on the finishing chunk, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first carries ``id``, ``type`` and the name,
    the rest only argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_OmitsNone):
    _omit_none = ("prompt_logprobs",)
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobList | None = None  # vLLM's extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int  # when the server started: the same on every call
    owned_by: str = "ferry"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
