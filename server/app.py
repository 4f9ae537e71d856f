"""The FastAPI application: routes, auth, request metrics and the engine's lifespan.

``create_app(config, client)`` returns an app for a started engine client (``await
client.start()``: ``server.serve`` starts it before the app, so that an engine that
cannot start is one line, not a traceback); its lifespan shuts the client down on exit.
Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE),
- ``POST /v1/responses`` (JSON or typed SSE events; ``server.responses``), ``GET`` and
  ``DELETE /v1/responses/{id}`` for stored responses,
- ``GET /v1/models``, ``GET /v1/models/{id}``,
- ``GET /health`` (liveness: 200 while this process serves; its JSON body says
  ``status``, ``ok`` or ``degraded`` while requests cannot be served, and with worker
  pools lists each worker — its pid, address and start-up, which with an API key only a
  caller that sends it sees), ``GET /ready`` (readiness: 200 while
  requests can be served and the server is not draining, else 503), ``GET /metrics``,
- ``GET /openapi.json``: the public routes with their request bodies (``server.openapi``).

Workers do not come here: the control plane has a listener of its own
(``server.control``). Every response carries ``x-request-id``, and every request gets one
access-log line (``server.access``).

A non-streaming request whose client disconnects is cancelled, which aborts its engine
requests; a streaming one is cancelled by Starlette when the client goes away. A client
that leaves before its body has arrived gets the same 499 (no one reads it), not a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.client import ServingClient
from server import errors, openapi, responses
from server.access import AccessLogMiddleware
from server.body import parse_body as parse_json_body
from server.config import ServerConfig
from server.metrics import CONTENT_TYPE, GcCollector, Metrics
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.response_store import ResponseStore
from server.responses_protocol import ResponsesRequest
from server.serving import ChatRenderer, CompletionRenderer, Serving

log = logging.getLogger("ferry.server")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# what each route's ``parse_body`` reads, for the served OpenAPI schema (server.openapi)
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
_ENDPOINTS = {
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health",
    "/ready", "/metrics",
}  # fmt: skip


def create_app(config: ServerConfig, client: ServingClient) -> FastAPI:
    metrics = Metrics(lambda: client.stats)
    metrics.registry.register(GcCollector(lambda: client.workers))
    for collector in client.collectors():  # a worker pool's own metrics
        metrics.registry.register(collector)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        name = config.served_model_name or client.model_name
        app.state.serving = Serving(client, metrics, name, config)
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="ferry", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.client = client
    app.state.draining = False  # set when the server is shutting down (server.serve)
    app.state.created = int(time.time())  # the models' ``created``: when this server started
    app.state.metrics = metrics
    app.state.response_store = ResponseStore(config.response_store_size,
                                             config.response_store_ttl_s)  # fmt: skip
    errors.install_handlers(app)
    app.add_exception_handler(ClientDisconnected, _on_disconnected)
    app.add_exception_handler(ClientDisconnect, _on_disconnected)  # gone while sending its body
    _add_routes(app)
    openapi.install(app, REQUEST_BODIES)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # counts 401s too
    app.add_middleware(AccessLogMiddleware)  # outermost: every request has its id and line
    return app


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """Liveness: 200 while this process serves, without a key (load balancers and
        probes call it). The body says ``status``; what runs behind it (each worker, its
        pid, ipc address and start-up) only to a caller that may use the API."""
        client = request.app.state.client
        body = {"status": "ok" if client.is_healthy else "degraded"}
        detail = client.health()  # with worker pools: each worker
        key = request.app.state.config.api_key
        if detail is not None and (not key or has_api_key(request.scope, key)):
            body.update(detail)
        elif detail is not None:
            body["detail"] = "the workers: send the API key (Authorization: Bearer <key>)"
        return Response(json.dumps(body), 200, media_type="application/json")

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: 200 while requests can be served (the engine, or at least one live
        prefill and one live decode worker) and the server is not shutting down."""
        ok = request.app.state.client.is_healthy and not request.app.state.draining
        body = {"ready": ok, "draining": request.app.state.draining}
        return Response(json.dumps(body), 200 if ok else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return _json(ModelList(data=[_model_card(request)]))

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        card = _model_card(request)
        if model != card.id:
            raise errors.model_not_found(model, card.id)
        return _json(card)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        serving = _serving(request)
        renderer = ChatRenderer(serving, await serving.prepare_chat(body), body)
        if body.stream:
            return _event_stream(renderer.stream())
        return _json(await until_disconnected(request, renderer.response()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        serving = _serving(request)
        renderer = CompletionRenderer(serving, await serving.prepare_completion(body), body)
        if body.stream:
            return _event_stream(renderer.stream())
        return _json(await until_disconnected(request, renderer.response()))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        store = request.app.state.response_store
        renderer = await responses.prepare(_serving(request), store, body)
        if body.stream:
            return _event_stream(renderer.stream())
        return _json(await until_disconnected(request, renderer.response()))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return _json(responses.stored(request.app.state.response_store, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        store = request.app.state.response_store
        responses.stored(store, response_id)
        store.delete(response_id)
        body = {"id": response_id, "object": "response.deleted", "deleted": True}
        return Response(json.dumps(body), media_type="application/json")


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as ``model``, whatever the Content-Type: 413 past ``--max-body-mb``,
    400 when it is not valid JSON or does not validate (``server.body``)."""
    limit = int(request.app.state.config.max_body_mb * 2**20)
    return await parse_json_body(request, model, limit)


def _model_card(request: Request) -> ModelCard:
    serving = _serving(request)
    return ModelCard(id=serving.model_name, created=request.app.state.created,
                     max_model_len=serving.client.max_model_len)  # fmt: skip


def _event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _on_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts
    its engine requests) and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns once the ASGI server reports ``http.disconnect`` (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- middleware ----------------------------------------------------------------------------


def has_api_key(scope: Scope, api_key: str) -> bool:
    """Whether the request sends ``Authorization: Bearer <api_key>`` (compared in constant
    time)."""
    sent = dict(scope["headers"]).get(b"authorization", b"")
    return secrets.compare_digest(sent, f"Bearer {api_key}".encode())


class ApiKeyMiddleware:
    """Rejects ``/v1/*`` requests without ``Authorization: Bearer <api_key>`` (401)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        v1 = scope["type"] == "http" and scope["path"].startswith("/v1/")
        if v1 and not has_api_key(scope, self._api_key):
            await errors.unauthorized().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestMetricsMiddleware:
    """Counts HTTP requests by endpoint and status (pure ASGI: streaming stays untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
