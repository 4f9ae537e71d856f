"""The frontend's control-plane listener: what workers, not clients, talk to.

It is its own HTTP server (``--internal-host`` / ``--internal-port``, loopback unless an
address is given), so a client of the public port never reaches it, and every request
must carry the cluster secret's token (``Authorization: Bearer``, ``kvstore.auth``;
compared in constant time) — the client API key is never accepted here. Routes:

- ``POST /internal/workers``: a worker started on its own (``ferry worker --frontend
  URL``) announces ``{name, role, address}``; the frontend connects to it — where the
  worker must prove the secret again on its own channel — and takes it into rotation
  once it is ready (202 at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.client import ServingClient, WorkerRefused
from kvstore import auth
from server import errors
from server.body import parse_body

log = logging.getLogger("ferry.server")

MAX_BODY_BYTES = 64 << 10


class WorkerAnnouncement(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    role: Literal["prefill", "decode", "encode"]
    address: str = Field(pattern=r"^(tcp|ipc)://.+", max_length=500)


def create_control_app(client: ServingClient, secret: str) -> FastAPI:
    app = FastAPI(title="ferry control plane", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install_handlers(app)

    @app.post("/internal/workers")
    async def join(request: Request) -> Response:
        body = await parse_body(request, WorkerAnnouncement, MAX_BODY_BYTES)
        try:
            client.join(body.name, body.role, body.address).add_done_callback(_log_join)
        except WorkerRefused as exc:
            raise errors.invalid_request(str(exc)) from exc
        return Response(json.dumps({"name": body.name, "status": "connecting"}), 202,
                        media_type="application/json")  # fmt: skip

    app.add_middleware(ClusterTokenMiddleware, secret=secret)
    return app


def _log_join(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a worker could not join: %s", task.exception())


class ClusterTokenMiddleware:
    """Refuses (401) every request without the cluster secret's bearer token."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self._secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            sent = dict(scope["headers"]).get(b"authorization", b"").decode(errors="replace")
            token = sent.removeprefix("Bearer ")
            if sent == token or not auth.token_matches(self._secret, token):
                response = errors.unauthorized("the cluster secret's token is required "
                                               "here (ferry worker --cluster-secret)")
                await response.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
