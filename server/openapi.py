"""The OpenAPI schema the server serves at ``/openapi.json``: the request bodies the
routes parse themselves, and none of the cluster's own routes.

Routes read their bodies through ``server.body`` (to bound them and parse them off the
event loop), so FastAPI never sees their models. ``install(app, bodies)`` puts each
model's JSON schema under ``components.schemas`` and a required ``application/json``
request body on its path's POST, so the schema describes what the server accepts and a
fuzzer (schemathesis) can use it as served. Paths under ``/internal/`` (workers joining
a frontend) are the control plane's, not the public API's: they are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

INTERNAL_PREFIX = "/internal/"
_REF = "#/components/schemas/{model}"


def install(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """Serve ``app``'s schema with ``bodies`` (path -> request model of its POST)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented hook


def build(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schema["paths"] = {p: ops for p, ops in schema.get("paths", {}).items()
                       if not p.startswith(INTERNAL_PREFIX)}  # fmt: skip
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template=_REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        ref = {"$ref": _REF.format(model=model.__name__)}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    return schema
