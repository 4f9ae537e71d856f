"""Request bodies at the HTTP edge: bounded before they are read, parsed so that no
input turns into a 500 or holds the event loop.

``parse_body(request, model, max_bytes)`` returns the body as ``model`` or raises an
``APIError``:

- **413** when ``Content-Length`` announces more than ``max_bytes`` (nothing is read), or
  when a body without one (chunked) streams past it (counted as it arrives, the rest is
  never read). The answer says ``Connection: close``: what the client still sends is
  not read, so the connection cannot carry another request.
- **400** for anything that is not valid JSON of the model, each value of its field's
  JSON type: validation is strict (``"stream": "yes"`` and ``"max_tokens": "5"`` are
  refused, as OpenAI refuses them, not read as ``true`` and ``5``). pydantic parses the bytes
  itself (jiter): nesting deeper than 200 levels, a lone surrogate (``"\\ud800"``) and
  bytes that are not UTF-8 are invalid JSON there, not a ``RecursionError`` or a
  ``TypeError`` in the tokenizer later; so is a body of more than ``MAX_JSON_VALUES``
  values (commas and colons counted, a bound on what validation may cost).

A body above ``PARSE_IN_THREAD_BYTES`` is parsed in a worker thread. pydantic holds the
GIL while it builds objects, so a thread only shortens the stall for bodies made of
structure (a million token ids) while it takes it away for bodies made of text; the
value bound caps what is left (about 0.1 s on one core for 262,144 token ids).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from server import errors

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_MB = 32.0  # room for long prompts and token lists; bodies past it get 413
PARSE_IN_THREAD_BYTES = 1 << 20
MAX_JSON_VALUES = 1 << 18


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    """The body of ``request`` validated as ``model`` (see the module docstring)."""
    raw = await read_body(request, max_bytes)
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(validate, raw, model)
    return validate(raw, model)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def validate(raw: bytes, model: type[M]) -> M:
    """``raw`` (JSON) as ``model``; a 400 for invalid JSON, too many values or a body that
    does not validate."""
    if raw.count(b",") + raw.count(b":") > MAX_JSON_VALUES:
        raise errors.invalid_request(
            f"Invalid JSON body: more than {MAX_JSON_VALUES} values (commas and colons)"
        )
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise errors.validation_error(exc.errors()) from exc


def too_large(max_bytes: int) -> errors.APIError:
    return errors.APIError(
        f"The request body is larger than {max_bytes / 2**20:g} MB (--max-body-mb).",
        413,
        code="request_too_large",
        headers={"Connection": "close"},
    )
