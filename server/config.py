"""Frozen configuration of the HTTP front door."""

from __future__ import annotations

from dataclasses import dataclass, field

from encode.inputs import MediaLimits
from server.body import DEFAULT_MAX_BODY_MB

# A request that sets no max_tokens stops here: minutes at CPU speeds, not a worker held
# until the context is full. An explicit value up to the context still works.
MAX_TOKENS_DEFAULT = 2048


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen and who may call.

    ``api_key``: when set, every ``/v1/*`` request must send ``Authorization: Bearer
    <key>``; ``/health`` and ``/metrics`` stay open. ``served_model_name``: the model id
    clients see and send (default: the engine's model name). ``max_body_mb``: larger
    request bodies get 413 before they are read. ``max_tokens_default``: the output
    length of a request that sets no ``max_tokens`` (0: all the context leaves);
    ``max_tokens_limit``: the most tokens any request generates, whatever it asks (None:
    the context decides; ``Serving``).
    ``response_store_size`` / ``response_store_ttl_s``: how many stored Responses API
    responses are kept, and for how long, for ``previous_response_id`` and ``GET``.
    ``max_queued_requests`` / ``max_queued_tokens``: how many sequences (and their prompt
    tokens) may wait for a first token before new requests get 429 (``server.admission``);
    ``request_timeout_s``: how long one request may run (0: no limit).
    ``drain_timeout_s``: on SIGTERM or Ctrl-C, how long requests in flight may take to
    finish before they end with an error.
    ``internal_host`` / ``internal_port``: the control plane's own listener
    (``server.control``; port None: the public port + 1, or a free one with port 0).
    ``media``: what a request's images may be, and the hosts image URLs are fetched from
    (``encode.inputs``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    drain_timeout_s: float = 30.0
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    max_tokens_limit: int | None = None
    max_tokens_default: int = MAX_TOKENS_DEFAULT
    response_store_size: int = 1000
    response_store_ttl_s: float = 3600.0
    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 20
    request_timeout_s: float = 600.0
    internal_host: str = "127.0.0.1"
    internal_port: int | None = None
    media: MediaLimits = field(default_factory=MediaLimits)

    @property
    def control_port(self) -> int:
        if self.internal_port is not None:
            return self.internal_port
        return self.port + 1 if self.port else 0
