"""The prefill channel: what a frontend and a prefill worker say besides what every worker
channel carries (``engine.messages``).

Frontend → worker: ``PrefillRequest`` (a request and where its KV goes), ``Abort``.
Worker → frontend: exactly one ``PrefillDone`` or ``PrefillFailed`` per request, sent
only when none of its sends is still running (the decode worker waits for it before it
frees the blocks it reserved).

A request whose images are encoded by encode workers (its ``MediaItem``s carry no files)
first gets inbox blocks reserved for their embeddings: the worker answers
``EmbeddingsWanted`` (one destination and transfer id per image), the frontend has encode
workers write them and answers *every* image with ``EmbeddingsReady`` or
``EmbeddingsFailed`` (also when the client has left): only then, or past the
destination's deadline and a grace period, are those blocks given back.
"""

from __future__ import annotations

import msgspec

from engine.messages import Codec, EngineRequest, RequestOutput
from kvstore.transport.base import KVDestination


class PrefillRequest(msgspec.Struct, tag=True, frozen=True):
    """Compute ``request``'s prompt (with a resumed request's outputs) and write its KV
    into ``destination``."""

    request: EngineRequest
    destination: KVDestination

    @property
    def request_id(self) -> str:
        return self.request.request_id


class PrefillDone(msgspec.Struct, tag=True, frozen=True):
    """The prompt's KV is in the decode worker's blocks. ``output`` is the first token as
    the client gets it (``finish_reason`` set when that token already ends the request);
    the rest are the transfer's figures."""

    output: RequestOutput
    num_blocks: int
    num_bytes: int
    seconds: float  # the transfer alone (its sends, summed)
    num_streamed_blocks: int = 0  # of num_blocks, sent while the prompt was still computing

    @property
    def request_id(self) -> str:
        return self.output.request_id


class PrefillFailed(msgspec.Struct, tag=True, frozen=True):
    """No KV is coming for this request (aborted, invalid, transfer failed, too late)."""

    request_id: str
    error: str
    aborted: bool = False
    retry: bool = False  # the request itself is fine: another prefill worker may do it


class EmbeddingsWanted(msgspec.Struct, tag=True, frozen=True):
    """The request's images go into these inbox blocks, in order: image ``i`` into
    ``destinations[i]``, sent under ``transfer_ids[i]``."""

    request_id: str
    destinations: list[KVDestination]
    transfer_ids: list[str]


class EmbeddingsReady(msgspec.Struct, tag=True, frozen=True):
    """Image ``index``'s embeddings have been written into its destination."""

    request_id: str
    index: int


class EmbeddingsFailed(msgspec.Struct, tag=True, frozen=True):
    """No embeddings are coming for image ``index`` (nor is any write into its blocks)."""

    request_id: str
    index: int
    error: str


CODEC = Codec((PrefillRequest, EmbeddingsReady, EmbeddingsFailed),
              (PrefillDone, PrefillFailed, EmbeddingsWanted))  # fmt: skip
