"""The access log: one line per HTTP request, and the request id that ties its lines
together across processes.

``AccessLogMiddleware`` (the app's outermost layer) gives every request an id: the
client's ``x-request-id`` when it sends a plain one (at most 64 characters of letters,
digits and ``._:-``), else a fresh ``req-<32 hex>``. The id is returned as
``x-request-id`` on every response and travels to every worker with the request
(``EngineRequest.trace_id``), whose log lines name it. Once the response has been sent
(or has failed) one line goes to the ``ferry.access`` logger::

    [req-4f..] POST /v1/chat/completions 200 prompt=27 output=8 cached=16 ttft=0.112s \
duration=0.388s

(with ``--log-format json``: the same as fields). Token counts and the time to the first
token are what the serving code notes on the request's ``AccessRecord``
(``note_first_token``, ``note_usage``), reached through a context variable the
middleware sets for the request's task and every task it starts. Probes and scrapes
(``/health``, ``/ready``, ``/metrics``) log at debug level only. No prompt or generated
text is logged.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import logs

log = logging.getLogger("ferry.access")

HEADER = b"x-request-id"
_GIVEN_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
_QUIET = {"/health", "/ready", "/metrics"}  # probes and scrapes: debug level


@dataclass
class AccessRecord:
    """What the access line of one request says; the serving code fills the counts."""

    request_id: str
    method: str
    path: str
    started: float
    status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None


_RECORD: ContextVar[AccessRecord | None] = ContextVar("ferry_access_record", default=None)


def request_id() -> str:
    """The id of the HTTP request being served ("" outside one)."""
    record = _RECORD.get()
    return record.request_id if record is not None else ""


def note_first_token() -> None:
    """The request's first token has arrived (the first call counts)."""
    record = _RECORD.get()
    if record is not None and record.ttft_s is None:
        record.ttft_s = time.monotonic() - record.started


def note_usage(prompt: int, output: int, cached: int) -> None:
    """Add one generation's token counts to the request's line."""
    record = _RECORD.get()
    if record is not None:
        record.prompt_tokens += prompt
        record.output_tokens += output
        record.cached_tokens += cached


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == HEADER and _GIVEN_ID.fullmatch(value):
            return value.decode()
    return f"req-{uuid.uuid4().hex}"


class AccessLogMiddleware:
    """Gives each HTTP request its id (returned as ``x-request-id``) and logs its line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(_request_id(scope), scope["method"], scope["path"],
                              time.monotonic())  # fmt: skip
        token = _RECORD.set(record)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", []), (HEADER, record.request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            _RECORD.reset(token)
            _write(record)


def _write(r: AccessRecord) -> None:
    duration = time.monotonic() - r.started
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f}s"
    level = logging.DEBUG if r.path in _QUIET else logging.INFO
    fields = {"method": r.method, "endpoint": r.path, "status": r.status,
              "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
              "cached_tokens": r.cached_tokens, "ttft_s": r.ttft_s,
              "duration_s": round(duration, 6)}  # fmt: skip
    log.log(level, "%s %s %d prompt=%d output=%d cached=%d ttft=%s duration=%.3fs", r.method,
            r.path, r.status, r.prompt_tokens, r.output_tokens, r.cached_tokens, ttft, duration,
            extra=logs.about(r.request_id, fields))  # fmt: skip
