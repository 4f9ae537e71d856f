"""Frozen configuration of the HTTP front door."""

from __future__ import annotations

from dataclasses import dataclass

from server.body import DEFAULT_MAX_BODY_MB


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen and who may call.

    ``api_key``: when set, every ``/v1/*`` request must send ``Authorization: Bearer
    <key>``; ``/health`` and ``/metrics`` stay open. ``served_model_name``: the model id
    clients see and send (default: the engine's model name). ``max_body_mb``: larger
    request bodies get 413 before they are read. ``max_tokens``: the most tokens one
    request may generate (None: the context decides; ``Serving``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    graceful_shutdown_s: float = 5.0
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    max_tokens: int | None = None
