"""The decode channel: what a frontend and a decode worker say besides what every worker
channel carries (``engine.messages``).

Frontend → worker: ``DecodeRequest``; for a request the worker asked KV for, ``KVReady``
(the KV has landed; here is the first token) or ``KVFailed`` — exactly one of them for
every ``KVWanted``, also when the client has left; ``Abort``.
Worker → frontend: ``KVWanted`` (blocks are reserved: have a prefill worker fill them)
and ``Outputs``. The decode worker's ``WorkerReady`` carries its KV endpoint.
"""

from __future__ import annotations

import msgspec

from engine.messages import Codec, EngineRequest, RequestOutput
from kvstore.transport.base import KVDestination


class DecodeRequest(msgspec.Struct, tag=True, frozen=True):
    """``remote_prefill``: a prefill worker may compute the prompt (the decode worker
    still computes it itself when its uncached tail is short)."""

    request: EngineRequest
    remote_prefill: bool = True

    @property
    def request_id(self) -> str:
        return self.request.request_id


class KVReady(msgspec.Struct, tag=True, frozen=True):
    """The prompt's KV is in the reserved blocks; ``output`` is the first token, which the
    frontend has already given the client."""

    output: RequestOutput

    @property
    def request_id(self) -> str:
        return self.output.request_id


class KVFailed(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    error: str


class KVWanted(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    destination: KVDestination


CODEC = Codec((DecodeRequest, KVReady, KVFailed), (KVWanted,))
