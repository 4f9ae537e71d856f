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
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.client import EngineDeadError, ServingClient
from engine.messages import RequestOutput, TokenLogprob
from engine.sampling_params import GrammarSpec, SamplingParams
from server.errors import APIError, engine_unavailable, invalid_request, model_not_found
from server.metrics import Metrics
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TextPart,
    TopLogprob,
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
    """Validation, fan-out and detokenization shared by chat and completions."""

    def __init__(
        self,
        client: ServingClient,
        metrics: Metrics,
        model_name: str,
        max_tokens: int | None = None,
    ) -> None:
        """``max_tokens``: the most tokens one request generates (asking for more gets that
        many); None: as many as the context holds."""
        self.client = client
        self.metrics = metrics
        self.model_name = model_name
        self.max_tokens = max_tokens

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    # -- preparing ---------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        self._check_ready(req.model)
        wanted = constraint(req, getattr(self.tokenizer, "chat_template", None))
        await check_constraint(wanted)
        messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt = await asyncio.to_thread(self._render_chat, messages, tools)
        self._check_token_ids(prompt, "messages")
        max_tokens = self._max_tokens(len(prompt), req.max_new_tokens, "messages")
        return self._job("chatcmpl", req, [PromptInput(prompt)], [max_tokens], wanted)

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
            raise model_not_found(model)
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

    def _max_tokens(self, prompt_len: int, requested: int | None, where: str) -> int:
        """``requested`` (None: fill the context), lowered to the server's ``max_tokens``
        and checked against the context length."""
        limit = self.client.max_model_len
        if requested is not None and requested < 1:
            raise invalid_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
        if requested is not None and self.max_tokens is not None:
            requested = min(requested, self.max_tokens)
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
        return min(limit - prompt_len, self.max_tokens or limit)

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
        return Job(request_id, self.model_name, prompts, choices, wanted.tool_calls)

    def _sampling(
        self, req: SamplingFields, i: int, max_tokens: int, grammar: GrammarSpec | None
    ) -> SamplingParams:
        vocab = self.tokenizer.vocab_size
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        for token in [*bias, *(req.stop_token_ids or [])]:
            if not 0 <= token < vocab:
                raise invalid_request(f"token id {token} is outside the vocabulary [0, {vocab})")
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
            )
        except ValueError as exc:
            raise invalid_request(str(exc)) from exc

    # -- running ------------------------------------------------------------------------------

    def events(self, job: Job) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events, merged; closing this aborts all choices in the engine."""
        for prompt in job.prompts:
            self.metrics.prompt_tokens.inc(len(prompt.token_ids))
        streams = [self._choice_events(job, spec) for spec in job.choices]
        return merge(streams)

    async def _choice_events(self, job: Job, spec: ChoiceSpec) -> AsyncIterator[ChoiceEvent]:
        prompt = job.prompts[spec.prompt_index].token_ids
        text = TextStream(self.tokenizer.decode_stream(skip_special_tokens=True), spec.stop)
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        timer = _TokenTimer(self.metrics, job.arrival)
        outputs = self.client.generate(spec.request_id, prompt, spec.sampling)
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    _raise_on_failure(out)
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
    )


def _template_message(message: ChatMessage, position: int) -> dict[str, Any]:
    """A message as chat templates expect it: content flattened to one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, TextPart):
                raise invalid_request(
                    f"content part type {part.type!r} is not supported",
                    f"messages.{position}.content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    role = "system" if message.role == "developer" else message.role
    plain = {"role": role, "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, key) is not None:
            plain[key] = getattr(message, key)
    return plain


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


class ChatRenderer:
    """Chat completion bodies and chunks from ``ChoiceEvent``s."""

    def __init__(self, serving: Serving, job: Job, req: ChatCompletionRequest) -> None:
        self.serving = serving
        self.job = job
        self.req = req
        self.logprobs = LogprobFormatter(serving.tokenizer, req.top_logprobs or 0)

    async def response(self) -> ChatCompletionResponse:
        tally = Tally(self.job)
        texts = {c.index: [] for c in self.job.choices}
        logprobs = {c.index: [] for c in self.job.choices}
        finish: dict[int, str | None] = {}
        async with aclosing(self.serving.events(self.job)) as events:
            async for ev in events:
                tally.add(ev)
                texts[ev.index].append(ev.text)
                logprobs[ev.index] += ev.logprobs or []
                finish[ev.index] = ev.finish_reason
        choices = []
        for i in sorted(texts):
            message, reason = read_reply("".join(texts[i]), self.job.tool_calls, finish.get(i))
            lp = self._logprobs(logprobs[i])
            choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=reason))
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=tally.usage(),
        )  # fmt: skip

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=[self.logprobs.chat(e) for e in entries])

    async def stream(self) -> AsyncIterator[str]:
        tally = Tally(self.job)
        mode = self.job.tool_calls
        replies = {c.index: ReplyStream(mode) for c in self.job.choices}
        try:
            for spec in self.job.choices:
                delta = ChatDelta(role="assistant", content=None if mode else "")
                yield self._chunk([ChatChunkChoice(index=spec.index, delta=delta)])
            async with aclosing(self.serving.events(self.job)) as events:
                async for ev in events:
                    tally.add(ev)
                    reply = replies[ev.index]
                    delta = reply.feed(ev.text, final=ev.finish_reason is not None)
                    if delta.content or delta.tool_calls or ev.finish_reason or ev.logprobs:
                        finish = reply.finish_reason(ev.finish_reason)
                        yield self._chunk([self._chunk_choice(ev, delta, finish)])
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

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=usage,
        )  # fmt: skip
        exclude = None if self.req.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))


# ---- completions rendering ----------------------------------------------------------------


class CompletionRenderer:
    """Completion bodies and chunks from ``ChoiceEvent``s (``echo``, legacy logprobs)."""

    def __init__(self, serving: Serving, job: Job, req: CompletionRequest) -> None:
        self.serving = serving
        self.job = job
        self.req = req
        self.logprobs = LogprobFormatter(serving.tokenizer, req.logprobs or 0)

    def _echo(self, spec: ChoiceSpec) -> str:
        return self.job.prompts[spec.prompt_index].echo_text or ""

    def _prompt_logprobs(self, spec: ChoiceSpec) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        if not self.req.echo:
            return CompletionLogprobs()
        return self.logprobs.prompt(self.job.prompts[spec.prompt_index].token_ids)

    async def response(self) -> CompletionResponse:
        tally = Tally(self.job)
        specs = {c.index: c for c in self.job.choices}
        texts = {i: [self._echo(s)] for i, s in specs.items()}
        logprobs = {i: self._prompt_logprobs(s) for i, s in specs.items()}
        finish: dict[int, str | None] = {}
        async with aclosing(self.serving.events(self.job)) as events:
            async for ev in events:
                tally.add(ev)
                texts[ev.index].append(ev.text)
                self._extend(logprobs[ev.index], ev, len(self._echo(specs[ev.index])))
                finish[ev.index] = ev.finish_reason
        choices = [
            CompletionChoice(
                index=i, text="".join(texts[i]), logprobs=logprobs[i], finish_reason=finish.get(i)
            )
            for i in sorted(specs)
        ]
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=tally.usage(),
        )  # fmt: skip

    def _extend(self, target: CompletionLogprobs | None, ev: ChoiceEvent, base: int) -> None:
        if target is not None and ev.logprobs is not None:
            self.logprobs.extend(target, ev.token_ids, ev.logprobs, ev.offsets, base)

    async def stream(self) -> AsyncIterator[str]:
        tally = Tally(self.job)
        specs = {c.index: c for c in self.job.choices}
        try:
            if self.req.echo:
                for i, spec in specs.items():
                    first = CompletionChoice(
                        index=i, text=self._echo(spec), logprobs=self._prompt_logprobs(spec),
                        finish_reason=None,
                    )  # fmt: skip
                    yield self._chunk([first])
            async with aclosing(self.serving.events(self.job)) as events:
                async for ev in events:
                    tally.add(ev)
                    if ev.text or ev.finish_reason or ev.logprobs:
                        yield self._chunk([self._chunk_choice(ev, specs[ev.index])])
            if self.req.include_usage:
                yield self._chunk([], tally.usage())
        except Exception as exc:
            yield error_event(as_api_error(exc))
        yield SSE_DONE

    def _chunk_choice(self, ev: ChoiceEvent, spec: ChoiceSpec) -> CompletionChoice:
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs()
            self._extend(logprobs, ev, len(self._echo(spec)))
        return CompletionChoice(
            index=ev.index, text=ev.text, logprobs=logprobs, finish_reason=ev.finish_reason
        )

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        chunk = CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.job.model,
            choices=choices, usage=usage,
        )  # fmt: skip
        exclude = None if self.req.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))


# ---- logprobs ------------------------------------------------------------------------------


class LogprobFormatter:
    """Engine ``TokenLogprob``s in OpenAI's chat and legacy completions shapes."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))

    def chat(self, entry: TokenLogprob) -> ChatTokenLogprob:
        alternatives = [
            TopLogprob(token=self._text(t), logprob=lp, bytes=self._bytes(t))
            for t, lp in zip(entry.top_ids[: self.top], entry.top_logprobs[: self.top], strict=True)
        ]
        return ChatTokenLogprob(
            token=self._text(entry.token_id),
            logprob=entry.logprob,
            bytes=self._bytes(entry.token_id),
            top_logprobs=alternatives,
        )

    def extend(
        self,
        target: CompletionLogprobs,
        token_ids: list[int],
        entries: list[TokenLogprob],
        offsets: list[int],
        base: int,
    ) -> None:
        """Append generated tokens; ``base`` is where the generated text starts."""
        for token_id, entry, offset in zip(token_ids, entries, offsets, strict=True):
            top = {self._text(t): lp for t, lp in zip(entry.top_ids, entry.top_logprobs)}
            top = dict(list(top.items())[: self.top])
            top.setdefault(self._text(token_id), entry.logprob)
            target.tokens.append(self._text(token_id))
            target.token_logprobs.append(entry.logprob)
            target.top_logprobs.append(top)
            target.text_offset.append(base + offset)

    def prompt(self, token_ids: list[int]) -> CompletionLogprobs:
        """Echoed prompt tokens: their text and offsets; the engine computes no prompt
        logprobs, so those are null."""
        decoder = self.tokenizer.decode_stream(skip_special_tokens=True)
        result = CompletionLogprobs()
        offset = 0
        for token_id in token_ids:
            result.tokens.append(self._text(token_id))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(decoder.step(token_id))
        return result
