"""The encode channel: what a frontend and an encode worker say besides what every worker
channel carries (``engine.messages``).

Frontend → worker: ``EncodeRequest`` (one image, and where its embeddings go), ``Abort``.
Worker → frontend: exactly one ``Encoded`` or ``EncodeFailed`` per request, sent once
no send of it is running any more (the prefill worker frees the blocks it reserved only
when the frontend has told it how the image ended).
"""

from __future__ import annotations

import msgspec

from engine.messages import Codec
from kvstore.transport.base import KVDestination


class EncodeRequest(msgspec.Struct, tag=True, frozen=True):
    """Encode the image file ``data`` (``content_hash``: sha256 of its pixels and the
    processor's settings, as the frontend computed it; ``num_tokens``: the embedding rows
    it makes) and write its embeddings into ``destination``, a prefill worker's inbox
    blocks. No send starts after the destination's deadline."""

    request_id: str
    data: bytes
    content_hash: bytes
    num_tokens: int
    destination: KVDestination
    trace_id: str = ""  # the HTTP request it belongs to (``EngineRequest.trace_id``)

    @property
    def num_input_tokens(self) -> int:
        return self.num_tokens


class Encoded(msgspec.Struct, tag=True, frozen=True):
    """The embeddings are in the destination blocks. ``cache``: where they came from —
    "" (encoded now), "memory" or "file" (the worker's embedding cache)."""

    request_id: str
    cache: str
    encode_seconds: float  # decode + preprocess + the tower's share (0 on a cache hit)
    num_bytes: int
    transfer_seconds: float


class EncodeFailed(msgspec.Struct, tag=True, frozen=True):
    """No embeddings are coming. ``retry``: the image is fine (the send failed): another
    encode worker may do it; ``aborted``: the frontend asked for it."""

    request_id: str
    error: str
    retry: bool = False
    aborted: bool = False


CODEC = Codec((EncodeRequest,), (Encoded, EncodeFailed))
