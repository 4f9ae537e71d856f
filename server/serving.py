"""Chat and completions: from a validated OpenAI request to engine requests and back.

``Serving.prepare_chat`` / ``prepare_completion`` check the request (model, prompt,
context length, sampling values) and turn it into a ``Job``: one ``ChoiceSpec`` per
output choice (``n`` per prompt, engine request ids ``{id}-{i}``, seed ``seed + i``).
Any problem raises ``APIError`` *before* anything is sent, so the status code is right.
A prompt text too long to fit the context whatever its tokens is refused before it is
tokenized (``_check_text_fits``): tokenizing 20 MB of text takes a core for half a
minute.

``Serving.events(job)`` runs every choice in the engine and merges their
``ChoiceEvent``s; leaving it early (client gone, error, cancellation) closes every
engine iterator, which aborts the requests in the engine. The chat and completions
renderers below turn events into a response body or SSE lines.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Counter

from encode.inputs import ImageRef, MediaError, SeenImages, load_images
from engine.client import EngineDeadError, ReaderTooSlow, ServingClient
from engine.messages import MediaItem, RequestOutput, TokenLogprob
from engine.sampling_params import GrammarSpec, SamplingError, SamplingParams
from engine.vision import ImageError, ImageInput, place_images
from server import access
from server.admission import Admission, Ticket
from server.config import ServerConfig
from server.errors import APIError, engine_unavailable, invalid_request, model_not_found
from server.logprobs import LogprobFormatter
from server.metrics import Metrics
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ImageURLPart,
    SamplingFields,
    TextPart,
    Usage,
)
from server.structured import (
    Constraint,
    ReplyStream,
    ToolCallMode,
    check_constraint,
    constraint,
    read_reply,
)
from server.text import TextDelta, TextStream

SSE_DONE = "data: [DONE]\n\n"

log = logging.getLogger("ferry.server")

T = TypeVar("T")

# Normalizers shorten text a few times at most (NFC: three Hangul jamo into one
# syllable), and no token stands for more bytes of text than the vocabulary's longest.
_TEXT_SHRINK_BOUND = 4


# ---- jobs and events ------------------------------------------------------------------


@dataclass(frozen=True)
class PromptInput:
    token_ids: list[int]
    echo_text: str | None = None  # completions with ``echo``: the text to prepend
    media: tuple[MediaItem, ...] = ()  # the prompt's images, with their files


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_index: int
    request_id: str
    sampling: SamplingParams
    stop: list[str]


@dataclass(frozen=True)
class Job:
    """One HTTP request, ready for the engine."""

    request_id: str
    model: str
    prompts: list[PromptInput]
    choices: list[ChoiceSpec]
    tool_calls: ToolCallMode | None = None  # how to read tool calls out of the text
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    ticket: Ticket | None = None  # its place in the admission queue
    trace_id: str = field(default_factory=access.request_id)  # its HTTP request's id


@dataclass(frozen=True)
class ChoiceEvent:
    """New text of one choice, the tokens released with it, and the finish on the last."""

    index: int
    text: str
    token_ids: list[int]
    offsets: list[int]  # where each token starts in the choice's generated text
    logprobs: list[TokenLogprob] | None
    num_new_tokens: int  # tokens generated since the previous event (released or not)
    num_cached_tokens: int
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the choice's first event


class Tally:
    """Counts tokens for ``usage``: each prompt once, every choice's generated tokens."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._generated = [0] * len(job.choices)
        self._cached = [0] * len(job.choices)

    def add(self, event: ChoiceEvent) -> None:
        self._generated[event.index] += event.num_new_tokens
        self._cached[event.index] = max(self._cached[event.index], event.num_cached_tokens)

    def usage(self) -> Usage:
        prompt = sum(len(p.token_ids) for p in self._job.prompts)
        cached = 0
        for p in range(len(self._job.prompts)):
            siblings = [self._cached[c.index] for c in self._job.choices if c.prompt_index == p]
            cached += min(siblings, default=0)
        return Usage.of(prompt, sum(self._generated), cached)


# ---- the engine side --------------------------------------------------------------------


class Serving:
    """Validation, fan-out and detokenization shared by chat and completions.

    The limits come from ``config`` (``ServerConfig``): ``max_tokens_default``, the output
    length of a request that gives none (0: whatever room the context leaves; an explicit
    value up to the context is honoured); ``max_tokens_limit``, the most tokens one request
    generates (asking for more gets that many; None: as many as the context holds);
    ``request_timeout_s``, how long a request may run before it ends with an error (0:
    no limit); and the admission bounds (``server.admission``).
    """

    def __init__(
        self, client: ServingClient, metrics: Metrics, model_name: str,
        config: ServerConfig | None = None,
    ) -> None:  # fmt: skip
        config = config or ServerConfig()
        self.client = client
        self.metrics = metrics
        self.model_name = model_name
        self.max_tokens_default = config.max_tokens_default
        self.max_tokens_limit = config.max_tokens_limit
        self.request_timeout_s = config.request_timeout_s
        self.media_limits = config.media
        self.seen_images = SeenImages()  # image files decoded before: not decoded again
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens,
                                   metrics.registry)  # fmt: skip
        self.timeouts = Counter("ferry_request_timeouts", "Requests ended by --request-timeout",
                                registry=metrics.registry)  # fmt: skip

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    # -- preparing ---------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        self._check_ready(req.model)
        wanted = constraint(req, getattr(self.tokenizer, "chat_template", None))
        await check_constraint(wanted)
        refs = _image_refs(req.messages)
        images = await self._load_images(refs)
        messages = [_template_message(m, i, bool(refs)) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt = await asyncio.to_thread(self._render_chat, messages, tools)
        media: list[MediaItem] = []
        if images:
            try:
                prompt, media = place_images(prompt, self.client.images.image_token_id, images)
            except ImageError as exc:
                raise invalid_request(f"Cannot place the images: {exc}.", "messages") from None
        self._check_token_ids(prompt, "messages")
        max_tokens = self._max_tokens(len(prompt), req.max_new_tokens, "messages",
                                      req.max_tokens_param)  # fmt: skip
        inputs = [PromptInput(prompt, media=tuple(media))]
        return self._job("chatcmpl", req, inputs, [max_tokens], wanted)

    async def _load_images(self, refs: list[ImageRef]) -> list[ImageInput]:
        """The request's images, read and checked (400s: ``encode.inputs``); a model that
        takes none refuses them."""
        if not refs:
            return []
        images = self.client.images
        if images is None:
            raise invalid_request(f"The model `{self.model_name}` does not accept images "
                                  "(it has no vision encoder).", refs[0].param)  # fmt: skip
        try:
            return await load_images(refs, images.processor, self.media_limits, self.seen_images)
        except MediaError as exc:
            raise invalid_request(exc.message, exc.param) from None

    async def prepare_completion(self, req: CompletionRequest) -> Job:
        self._check_ready(req.model)
        if req.suffix:
            raise invalid_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid_request("best_of is not supported (only best_of == n)", "best_of")
        wanted = constraint(req)
        await check_constraint(wanted)
        prompts = await asyncio.to_thread(self._completion_prompts, req)
        max_tokens = [self._max_tokens(len(p.token_ids), req.max_tokens, "prompt") for p in prompts]
        return self._job("cmpl", req, prompts, max_tokens, wanted)

    def _check_ready(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)
        if not self.client.is_healthy:
            raise engine_unavailable("the engine process is not running")

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools
            )
        except Exception as exc:  # jinja2 errors, templates that reject a conversation
            raise invalid_request(f"Cannot apply the chat template: {exc}", "messages") from exc
        self._check_text_fits(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        raw = req.prompt
        single = isinstance(raw, str) or isinstance(raw[0], int)
        items: Sequence[str | list[int]] = [raw] if single else raw  # type: ignore[list-item]
        prompts = []
        for item in items:
            if isinstance(item, str):
                self._check_text_fits(item, "prompt")
                ids = self.tokenizer.encode(item, add_special_tokens=True)
                echo = item
            else:
                ids = list(item)
                self._check_token_ids(ids, "prompt")  # before decoding them for the echo
                echo = self.tokenizer.decode(ids) if req.echo else None
            if not ids:
                raise invalid_request("prompt must not be empty", "prompt")
            prompts.append(PromptInput(ids, echo if req.echo else None))
        return prompts

    @functools.cached_property
    def _longest_token_bytes(self) -> int:
        tok = self.tokenizer
        return max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=1)

    def _check_text_fits(self, text: str, param: str) -> None:
        """400 when ``text`` holds more characters than the context's tokens could stand
        for, before tokenizing it."""
        limit = self.client.max_model_len
        most = _TEXT_SHRINK_BOUND * self._longest_token_bytes * limit
        if len(text) > most:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens; {len(text)} "
                f"characters of {param} are more than that many tokens can hold.",
                param,
            )

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)

    def _max_tokens(
        self, prompt_len: int, requested: int | None, where: str, param: str = "max_tokens"
    ) -> int:
        """``requested`` (None: the server's default; ``param`` names the field that asked),
        lowered to the server's limit and checked against the context length; a default is
        cut to what the context leaves."""
        limit = self.client.max_model_len
        if requested is not None and requested < 1:
            raise invalid_request(f"{param} must be at least 1, got {requested}", param)
        if requested is not None and self.max_tokens_limit is not None:
            requested = min(requested, self.max_tokens_limit)
        if prompt_len + (requested or 1) > limit:
            completion = requested or 0
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + completion} tokens ({prompt_len} in the {where}, "
                f"{completion} in the completion). Please reduce the length of the {where} "
                "or completion.",
                where,
            )
        if requested is not None:
            return requested
        room = limit - prompt_len
        bounds = [b for b in (self.max_tokens_default, self.max_tokens_limit) if b]
        return min([room, *bounds])

    def _job(
        self,
        prefix: str,
        req: SamplingFields,
        prompts: list[PromptInput],
        max_tokens: list[int],
        wanted: Constraint,
    ) -> Job:
        """``n`` choices per prompt; choice ``i`` of prompt ``p`` has index ``p * n + i``.
        Stop strings do not apply to a forced tool call (they would cut its JSON)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        forced = wanted.tool_calls is not None and wanted.tool_calls.forced
        stop = [] if forced else req.stop_strings
        choices = []
        for p in range(len(prompts)):
            for i in range(req.n):
                index = p * req.n + i
                sampling = self._sampling(req, i, max_tokens[p], wanted.grammar)
                choices.append(ChoiceSpec(index, p, f"{request_id}-{index}", sampling, stop))
        ticket = self.admission.admit([len(prompts[c.prompt_index].token_ids) for c in choices])
        job = Job(request_id, self.model_name, prompts, choices, wanted.tool_calls,
                  ticket=ticket)  # fmt: skip
        weakref.finalize(job, ticket.close)  # a job never run leaves the queue too
        return job

    def _sampling(
        self, req: SamplingFields, i: int, max_tokens: int, grammar: GrammarSpec | None
    ) -> SamplingParams:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        self._check_token_ids(list(bias), "logit_bias")
        self._check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        values: dict[str, Any] = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": None if req.top_k is None else max(req.top_k, 0),  # vLLM's -1 means off
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "seed": None if req.seed is None else req.seed + i,
            "logprobs": req.num_logprobs,
            "prompt_logprobs": req.num_prompt_logprobs,
        }
        try:
            return SamplingParams(
                **{k: v for k, v in values.items() if v is not None},
                logit_bias=bias,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                grammar=grammar,
                speculative=req.speculative,
            )
        except SamplingError as exc:  # each field named as the request names it
            names = {"logprobs": req.logprobs_param}
            raise invalid_request(exc.describe(names), names.get(exc.field, exc.field)) from exc

    # -- running ------------------------------------------------------------------------------

    async def events(self, job: Job) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events, merged; closing this aborts all choices in the engine.
        What they counted goes on the request's access-log line (``server.access``)."""
        for prompt in job.prompts:
            self.metrics.prompt_tokens.inc(len(prompt.token_ids))
        streams = [self._choice_events(job, spec) for spec in job.choices]
        tally = Tally(job)
        try:
            async with aclosing(merge(streams)) as events:
                async for event in events:
                    if event.num_new_tokens:
                        access.note_first_token()
                    tally.add(event)
                    yield event
        finally:
            if job.ticket is not None:
                job.ticket.close()
            usage = tally.usage()
            access.note_usage(usage.prompt_tokens, usage.completion_tokens,
                              usage.prompt_tokens_details.cached_tokens)  # fmt: skip

    async def _choice_events(self, job: Job, spec: ChoiceSpec) -> AsyncIterator[ChoiceEvent]:
        prompt = job.prompts[spec.prompt_index].token_ids
        text = TextStream(self.tokenizer.decode_stream(skip_special_tokens=True), spec.stop)
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        timer = _TokenTimer(self.metrics, job.arrival)
        media = job.prompts[spec.prompt_index].media
        outputs = self.client.generate(spec.request_id, prompt, spec.sampling, media=media,
                                       trace_id=job.trace_id)  # fmt: skip
        deadline = job.arrival + self.request_timeout_s if self.request_timeout_s else None
        try:
            async with asyncio.timeout_at(deadline), aclosing(outputs):
                async for out in outputs:
                    _raise_on_failure(out)
                    if out.new_token_ids and job.ticket is not None:
                        job.ticket.started(spec.index)
                    timer.tokens(len(out.new_token_ids))
                    ids += out.new_token_ids
                    logprobs += out.logprobs or []
                    delta = text.add(out.new_token_ids)
                    finish = "stop" if text.stopped else out.finish_reason
                    if finish is not None and not text.stopped:
                        delta = _join(delta, text.finish())
                    want_logprobs = spec.sampling.logprobs is not None
                    yield _event(spec.index, delta, ids, logprobs if want_logprobs else None,
                                 out, finish)  # fmt: skip
                    if finish is not None:
                        timer.done()
                        return
        except EngineDeadError as exc:
            raise engine_unavailable(str(exc)) from exc
        except ReaderTooSlow as exc:
            raise APIError(f"The client stopped reading: {exc}.", 408,
                           code="client_too_slow") from exc
        except TimeoutError:
            self.timeouts.inc()
            raise APIError(f"The request ran past the server's limit of "
                           f"{self.request_timeout_s:g} s (--request-timeout).", 504,
                           code="request_timeout", type="timeout_error") from None


class _TokenTimer:
    """Feeds TTFT, inter-token latency, end-to-end latency and the token counter."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            for _ in range(count):
                self._metrics.itl.observe((now - self._last) / count)
        self._last = now
        self._metrics.generation_tokens.inc(count)

    def done(self) -> None:
        self._metrics.e2e.observe(time.monotonic() - self._arrival)


def _raise_on_failure(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(f"The engine failed on this request: {out.error or 'unknown error'}", 500)
    if out.finish_reason == "abort":
        raise APIError("The engine aborted this request.", 503, code="engine_aborted")


def _join(a: TextDelta, b: TextDelta) -> TextDelta:
    return TextDelta(a.text + b.text, a.first_token, a.offsets + b.offsets)


def _event(
    index: int,
    delta: TextDelta,
    ids: list[int],
    logprobs: list[TokenLogprob] | None,
    out: RequestOutput,
    finish: str | None,
) -> ChoiceEvent:
    released = slice(delta.first_token, delta.first_token + delta.num_tokens)
    return ChoiceEvent(
        index=index,
        text=delta.text,
        token_ids=ids[released],
        offsets=delta.offsets,
        logprobs=None if logprobs is None else logprobs[released],
        num_new_tokens=len(out.new_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        finish_reason=finish,
        prompt_logprobs=out.prompt_logprobs,
    )


def _image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    """The ``image_url`` parts of a conversation, in order; only user messages take them."""
    refs = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImageURLPart):
                continue
            param = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise invalid_request(f"image_url parts are for user messages, not "
                                      f"{message.role} messages", param)  # fmt: skip
            refs.append(ImageRef(part.image_url.url, param))
    return refs


def _template_message(message: ChatMessage, position: int, parts: bool = False) -> dict[str, Any]:
    """A message as chat templates expect it: content flattened to one string, or, when
    the conversation has images (``parts``), a list of text and image parts."""
    content = message.content
    if isinstance(content, list):
        texts: list[Any] = []
        for j, part in enumerate(content):
            if isinstance(part, ImageURLPart):
                texts.append({"type": "image"})
            elif isinstance(part, TextPart):
                texts.append({"type": "text", "text": part.text} if parts else part.text)
            else:
                raise invalid_request(f"content part type {part.type!r} is not supported",
                                      f"messages.{position}.content.{j}")  # fmt: skip
        content = texts if parts else "\n".join(texts)
    role = "system" if message.role == "developer" else message.role
    fields = message.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
    return {"role": role, "content": content or "", **fields}


# ---- merging n streams --------------------------------------------------------------------


class _Done:
    pass


@dataclass(frozen=True)
class _Failed:
    error: Exception


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all ``streams`` as they come. The first error is raised; leaving early
    (or an error) cancels the remaining streams, which closes them."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[T | _Done | _Failed] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(s, queue)) for s in streams]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if isinstance(item, _Done):
                pending -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _pump(stream: AsyncIterator[T], queue: asyncio.Queue) -> None:
    try:
        async with aclosing(stream):  # type: ignore[type-var]
            async for item in stream:
                queue.put_nowait(item)
        queue.put_nowait(_Done())
    except Exception as exc:
        queue.put_nowait(_Failed(exc))


# ---- chat rendering -----------------------------------------------------------------------


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_event(exc: APIError) -> str:
    return sse(json.dumps(exc.body()))


def as_api_error(exc: Exception) -> APIError:
    """What a client is told about a failure after its stream began."""
    if isinstance(exc, APIError):
        return exc
    log.exception("stream failed", exc_info=exc)
    return APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500)


@dataclass(frozen=True)
class Reply:
    """One choice's finished reply, read as chat reads it (content and tool calls)."""

    message: AssistantMessage
    finish_reason: str | None
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Replies:
    replies: dict[int, Reply]  # by choice index
    usage: Usage
    prompt_logprobs: list[TokenLogprob | None] | None  # the prompt's, when asked (shared)


async def collect_replies(serving: Serving, job: Job) -> Replies:
    """Run ``job`` to the end and read each choice's reply."""
    tally = Tally(job)
    texts: dict[int, list[str]] = {c.index: [] for c in job.choices}
    logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in job.choices}
    finish: dict[int, str | None] = {}
    prompt = None
    async with aclosing(serving.events(job)) as events:
        async for ev in events:
            tally.add(ev)
            texts[ev.index].append(ev.text)
            logprobs[ev.index] += ev.logprobs or []
            finish[ev.index] = ev.finish_reason
            prompt = prompt or ev.prompt_logprobs
    replies = {}
    for i in sorted(texts):
        message, reason = read_reply("".join(texts[i]), job.tool_calls, finish.get(i))
        replies[i] = Reply(message, reason, logprobs[i])
    return Replies(replies, tally.usage(), prompt)


@dataclass(frozen=True)
class ReplyDelta:
    """What one event adds to its choice's reply: content and tool-call deltas, and the
    finish reason as chat reports it (``tool_calls`` when the reply made calls)."""

    event: ChoiceEvent
    delta: ChatDelta
    finish_reason: str | None


async def reply_deltas(serving: Serving, job: Job, tally: Tally) -> AsyncIterator[ReplyDelta]:
    """Run ``job``; each event as a delta of its choice's reply (counted in ``tally``)."""
    replies = {c.index: ReplyStream(job.tool_calls) for c in job.choices}
    async with aclosing(serving.events(job)) as events:
        async for ev in events:
            tally.add(ev)
            reply = replies[ev.index]
            delta = reply.feed(ev.text, final=ev.finish_reason is not None)
            yield ReplyDelta(ev, delta, reply.finish_reason(ev.finish_reason))


class ChatRenderer:
    """Chat completion bodies and chunks from ``ChoiceEvent``s."""

    _MARK = "\x00ferry-content\x00"  # stands for the content in a chunk's template

    def __init__(self, serving: Serving, job: Job, req: ChatCompletionRequest) -> None:
        self.serving = serving
        self.job = job
        self.req = req
        self.logprobs = LogprobFormatter(serving.tokenizer, req.top_logprobs or 0)
        self._templates: dict[int, tuple[str, str]] = {}  # choice index -> around content

    async def response(self) -> ChatCompletionResponse:
        done = await collect_replies(self.serving, self.job)
        choices = [
            ChatChoice(index=i, message=r.message, logprobs=self._logprobs(r.logprobs),
                       finish_reason=r.finish_reason)
            for i, r in done.replies.items()
        ]  # fmt: skip
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=done.usage,
            prompt_logprobs=self._prompt_logprobs(done.prompt_logprobs),
        )  # fmt: skip

    def _prompt_logprobs(self, entries: list[TokenLogprob | None] | None) -> Any:
        if self.req.prompt_logprobs is None or entries is None:
            return None
        top = LogprobFormatter(self.serving.tokenizer, self.req.prompt_logprobs)
        return top.vllm_prompt(entries)

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=[self.logprobs.chat(e) for e in entries])

    async def stream(self) -> AsyncIterator[str]:
        tally = Tally(self.job)
        try:
            for spec in self.job.choices:
                delta = ChatDelta(role="assistant", content=None if self.job.tool_calls else "")
                yield self._chunk([ChatChunkChoice(index=spec.index, delta=delta)])
            async with aclosing(reply_deltas(self.serving, self.job, tally)) as deltas:
                async for d in deltas:
                    ev, delta = d.event, d.delta
                    if (delta.content and delta.tool_calls is None and not self.req.logprobs
                            and d.finish_reason is None):  # fmt: skip
                        yield self.content_chunk(ev.index, delta.content)
                    elif delta.content or delta.tool_calls or ev.finish_reason or ev.logprobs:
                        yield self._chunk([self._chunk_choice(ev, delta, d.finish_reason)])
            if self.req.include_usage:
                yield self._chunk([], tally.usage())
        except Exception as exc:
            yield error_event(as_api_error(exc))
        yield SSE_DONE

    def _chunk_choice(
        self, ev: ChoiceEvent, delta: ChatDelta, finish: str | None
    ) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=ev.index,
            delta=delta,
            logprobs=self._logprobs(ev.logprobs or []),
            finish_reason=finish,
        )

    def content_chunk(self, index: int, content: str) -> str:
        """The chunk of a delta that is only content, the one nearly every token makes:
        byte for byte what ``_chunk`` renders for it, from a template rendered once per
        choice (a model's worth of validation and serialization per token is the served
        path's largest cost at high concurrency)."""
        around = self._templates.get(index)
        if around is None:
            mark = ChatDelta(content=self._MARK)
            whole = self._chunk([ChatChunkChoice(index=index, delta=mark)])
            head, found, tail = whole.rpartition(json.dumps(self._MARK, ensure_ascii=False))
            around = self._templates[index] = (head, tail) if found else ("", "")
        if not around[0]:
            return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=content))])
        return around[0] + json.dumps(content, ensure_ascii=False) + around[1]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=usage,
        )  # fmt: skip
        exclude = None if self.req.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))


# ---- completions rendering ----------------------------------------------------------------


class CompletionRenderer:
    """Completion bodies and chunks from ``ChoiceEvent``s (``echo``, legacy logprobs, vLLM's
    ``prompt_logprobs``). A choice's echoed prompt goes out with its first event, which
    brings the prompt's logprobs when they were asked for."""

    def __init__(self, serving: Serving, job: Job, req: CompletionRequest) -> None:
        self.serving = serving
        self.job = job
        self.req = req
        self.logprobs = LogprobFormatter(serving.tokenizer, req.logprobs or 0)
        self.prompt_logprobs = LogprobFormatter(serving.tokenizer, req.prompt_logprobs or 0)
        self._specs = {c.index: c for c in job.choices}

    def _echo(self, index: int) -> str:
        return self.job.prompts[self._specs[index].prompt_index].echo_text or ""

    def _choice(self, ev: ChoiceEvent, first: bool) -> CompletionChoice:
        """``ev`` as a choice: its text, and on the choice's first event the echo before it."""
        echo = self._echo(ev.index) if first else ""
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if first and self.req.echo:
                prompt = self.job.prompts[self._specs[ev.index].prompt_index].token_ids
                logprobs = self.logprobs.prompt(prompt, ev.prompt_logprobs)
            if ev.logprobs is not None:
                self.logprobs.extend(logprobs, ev.token_ids, ev.logprobs, ev.offsets, len(echo))
        vllm = None
        if first and self.req.prompt_logprobs is not None and ev.prompt_logprobs is not None:
            vllm = self.prompt_logprobs.vllm_prompt(ev.prompt_logprobs)
        return CompletionChoice(index=ev.index, text=echo + ev.text, logprobs=logprobs,
                                finish_reason=ev.finish_reason, prompt_logprobs=vllm)  # fmt: skip

    async def response(self) -> CompletionResponse:
        tally = Tally(self.job)
        choices: dict[int, CompletionChoice] = {}
        async with aclosing(self.serving.events(self.job)) as events:
            async for ev in events:
                tally.add(ev)
                part = self._choice(ev, ev.index not in choices)
                choices[ev.index] = _joined(choices.get(ev.index), part)
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=[choices[i] for i in sorted(choices)], usage=tally.usage(),
        )  # fmt: skip

    async def stream(self) -> AsyncIterator[str]:
        tally = Tally(self.job)
        started: set[int] = set()
        try:
            async with aclosing(self.serving.events(self.job)) as events:
                async for ev in events:
                    tally.add(ev)
                    first = ev.index not in started
                    started.add(ev.index)
                    if (first and self.req.echo) or ev.text or ev.finish_reason or ev.logprobs:
                        yield self._chunk([self._choice(ev, first)])
            if self.req.include_usage:
                yield self._chunk([], tally.usage())
        except Exception as exc:
            yield error_event(as_api_error(exc))
        yield SSE_DONE

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        chunk = CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=usage,
        )  # fmt: skip
        exclude = None if self.req.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))


def _joined(done: CompletionChoice | None, part: CompletionChoice) -> CompletionChoice:
    """A choice so far with its next part appended (text, logprobs, finish reason)."""
    if done is None:
        return part
    if done.logprobs is not None and part.logprobs is not None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(done.logprobs, name).extend(getattr(part.logprobs, name))
    done.text += part.text
    done.finish_reason = part.finish_reason
    return done
