"""One streaming request (chat completions or the Responses API) and its timings.

Timing rules (all from ``time.perf_counter``, taken when a line is read off the socket,
before its JSON is parsed):

- a *token event* is an SSE chunk whose ``delta.content`` (or ``delta.reasoning_content``)
  is non-empty; role-only and usage-only chunks are not token events. On the Responses
  API: a ``response.output_text.delta`` event with a non-empty ``delta``;
- TTFT = first token event - request start; ITL = the gaps between successive token
  events (one gap per chunk: a server that packs k tokens into a chunk shows one gap);
- E2E = end of stream (``[DONE]`` or the stream closing) - request start;
- output tokens come from the final ``usage`` chunk (``stream_options.include_usage``;
  on the Responses API the ``response.completed``/``response.incomplete`` event's
  ``response.usage``); without one, the number of token events.

Errors by kind: ``http_<status>``, ``timeout``, ``connection`` (connect, read or write
failures), ``stream`` (an ``error`` event, ``response.failed``, bad JSON, or no ``[DONE]``
/ final response event).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``start_s`` is from the run's start."""

    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_detail: str = ""
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON record in milliseconds (ITL rounded to microseconds)."""
        ms = lambda s: None if s is None else round(s * 1e3, 3)
        return {
            "start_ms": ms(self.start_s),
            "ttft_ms": ms(self.ttft_s),
            "e2e_ms": ms(self.e2e_s),
            "itl_ms": [ms(g) for g in self.itl_s],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "error": self.error,
            "error_detail": self.error_detail or None,
        }


class _StreamError(Exception):
    pass


class _Stream:
    """Accumulates one SSE stream's token events, text and usage."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.done = False

    async def consume(self, chunks: AsyncIterator[bytes]) -> None:
        """Feed the body's lines as they arrive, up to ``[DONE]`` or the end of the body.

        Splits bytes itself (no text decoding of the whole stream): ``aiter_lines`` costs
        about a third more CPU per chunk, which caps how many streams one process can time.
        """
        buf = b""
        async for data in chunks:
            now = time.perf_counter()
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self.feed(line, now)
                if self.done:
                    return

    def feed(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        self.take(json.loads(data), now)

    def take(self, chunk: dict[str, Any], now: float) -> None:
        """One chat completion chunk."""
        if chunk.get("error"):
            raise _StreamError(str(chunk["error"])[:200])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content")
            if text:
                self.times.append(now)
                self.parts.append(text)

    def fill(self, result: RequestResult, end: float) -> None:
        times = self.times
        result.e2e_s = end - self.t0
        result.ttft_s = times[0] - self.t0 if times else None
        result.itl_s = [b - a for a, b in zip(times, times[1:])]
        result.text = "".join(self.parts)
        usage = self.usage or {}
        result.output_tokens = usage.get("completion_tokens", len(times))
        result.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


class _ResponsesStream(_Stream):
    """The same for the Responses API's typed events; the final response event ends it."""

    def take(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("type")
        if kind == "error" or kind == "response.failed":
            raise _StreamError(str(event.get("message") or event.get("response"))[:200])
        if kind == "response.output_text.delta" and event.get("delta"):
            self.times.append(now)
            self.parts.append(event["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            usage = event["response"].get("usage") or {}
            self.usage = {
                "prompt_tokens": usage.get("input_tokens"),
                "completion_tokens": usage.get("output_tokens", len(self.times)),
                "prompt_tokens_details": usage.get("input_tokens_details") or {},
            }
            self.done = True


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    run_t0: float,
    responses: bool = False,
) -> RequestResult:
    """POST ``body`` (with ``stream: true``) to ``url`` and time the SSE answer: chat
    completion chunks, or with ``responses`` the Responses API's events.

    Never raises for a failed request: the failure is recorded in ``result.error``.
    ``run_t0`` is the run's start on the ``perf_counter`` clock.
    """
    t0 = time.perf_counter()
    result = RequestResult(start_s=t0 - run_t0)
    stream = _ResponsesStream(t0) if responses else _Stream(t0)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _fail(result, f"http_{resp.status_code}", resp.text, t0)
            await stream.consume(resp.aiter_bytes())
        stream.fill(result, time.perf_counter())
        if not stream.done:
            return _fail(result, "stream", "stream ended without [DONE]", t0)
    except httpx.TimeoutException as e:
        return _fail(result, "timeout", repr(e), t0)
    except httpx.TransportError as e:
        return _fail(result, "connection", repr(e), t0)
    except (_StreamError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return _fail(result, "stream", str(e), t0)
    return result


def _fail(result: RequestResult, kind: str, detail: str, t0: float) -> RequestResult:
    result.error = kind
    result.error_detail = detail[:300]
    if not result.e2e_s:
        result.e2e_s = time.perf_counter() - t0
    return result
