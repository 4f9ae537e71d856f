"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers installed by ``install_handlers`` turn every failure into that shape with the
right status: pydantic validation and malformed JSON become 400 (not FastAPI's 422),
unknown routes 404 naming the API's routes, a method a route does not take 405 naming
the one it takes (both ``invalid_request_error``, as OpenAI answers a wrong URL), anything
unexpected 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ferry.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error the client sees; raise it anywhere in request handling."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "api_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class FieldError(ValueError):
    """A validator's complaint about one field of the model it checks: raised from a model
    validator (where pydantic places the error at the model), the 400 names ``field``
    below that place (``messages.2.tool_call_id``, not ``messages.2``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(f"The model `{model}` does not exist; this server serves `{served}` "
                    "(GET /v1/models).", 404, param="model", code="model_not_found")  # fmt: skip


def unauthorized(
    message: str = "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
) -> APIError:
    return APIError(message, 401, code="invalid_api_key")


def engine_unavailable(reason: str) -> APIError:
    return APIError(f"The engine is unavailable: {reason}", 503, code="engine_unavailable")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 from pydantic's error list (``ValidationError.errors()``)."""
    message, param = _validation_message(errors)
    return invalid_request(message, param)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable sentence from pydantic's error list, plus the offending field."""
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":  # pydantic's "Invalid JSON: <where>"
        where = str(first.get("msg", "")).removeprefix("Invalid JSON").lstrip(": ")
        return f"Invalid JSON body: {where}".rstrip(": "), None
    # the deepest first: where a union's every alternative failed, the one that got
    # furthest says what is wrong (``content.0.text``, not "content is not a string")
    errors = sorted(errors, key=lambda err: -len(err.get("loc", ())))
    param = _where(errors[0]) or None
    parts = []
    for err in errors[:3]:
        where, msg = _where(err), _reason(err)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts), param


def _reason(error: Any) -> str:
    """What is wrong, in the check's own words: a ValueError raised by a validator is its
    message, without pydantic's "Value error, " before it; a value of another JSON type
    says what was expected and what came (``expected a boolean, got a string``)."""
    cause = (error.get("ctx") or {}).get("error")
    if error.get("type") == "value_error" and isinstance(cause, ValueError):
        return str(cause)
    expected = _EXPECTED.get(str(error.get("type")))
    if expected is not None:
        return f"expected {expected}, got {_json_type(error.get('input'))}"
    return str(error.get("msg"))


# pydantic's error types for a value of the wrong JSON type (validation is strict)
_EXPECTED = {"bool_type": "a boolean", "int_type": "an integer", "float_type": "a number",
             "string_type": "a string"}  # fmt: skip


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


# how pydantic names a union's alternatives in an error's location (``stop.str``,
# ``content.list[tagged-union[TextPart,...]]``, and the protocol's own tags, ``<text>``):
# not fields, so not part of the param
_ALTERNATIVES = {"str", "int", "float", "bool"}


def _where(error: Any) -> str:
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc.append(cause.field)
    return ".".join(p for p in loc
                    if p not in _ALTERNATIVES and "[" not in p and not p.startswith("<"))


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors()).response()


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 405:
        return _method_not_allowed(request, exc).response()
    if exc.status_code == 404 and exc.detail == HTTPStatus.NOT_FOUND.phrase:  # no such route
        return _no_route(request).response()
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    detail = exc.detail if isinstance(exc.detail, str) else phrase
    return APIError(detail, exc.status_code, headers=exc.headers).response()  # 405's Allow


def _method_not_allowed(request: Request, exc: StarletteHTTPException) -> APIError:
    allowed = (exc.headers or {}).get("Allow", "")
    return APIError(f"{request.method} is not allowed on {request.url.path}; use {allowed}.",
                    405, type="invalid_request_error", headers=exc.headers)  # fmt: skip


def _no_route(request: Request) -> APIError:
    """A 404 that says which API routes there are (every route: ``GET /openapi.json``)."""
    api = sorted({path for route in request.app.routes
                  if (path := getattr(route, "path", "")).startswith("/v1/") and "{" not in path})
    return APIError(f"{request.method} {request.url.path} is not a route of this server; it "
                    f"serves {', '.join(api)} (GET /openapi.json describes every route).",
                    404, type="invalid_request_error")  # fmt: skip


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500).response()


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_unexpected)
