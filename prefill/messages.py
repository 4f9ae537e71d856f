"""The prefill channel: typed messages between the frontend and a prefill worker.

Frontend → worker: ``PrefillRequest``, ``AbortPrefill``, ``Shutdown``.
Worker → frontend: ``PrefillReady`` (or ``WorkerFailed``) once, then ``PrefillDone`` /
``PrefillFailed`` (exactly one per request: the decode worker waits for it before it
frees the blocks it reserved) and ``PrefillStats`` after each step.
msgspec msgpack; nothing is pickled.
"""

from __future__ import annotations

import msgspec

from engine.messages import EngineStats, TokenLogprob
from engine.sampling_params import SamplingParams
from kvstore.events import KVEvent
from kvstore.transport.base import KVDestination


class PrefillRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    dest: KVDestination
    arrival_time: float = 0.0
    cache_salt: str = ""
    output_token_ids: list[int] = []  # a resumed request's tokens so far (EngineRequest)


class AbortPrefill(msgspec.Struct, tag=True, frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


PrefillInput = PrefillRequest | AbortPrefill | Shutdown


class PrefillReady(msgspec.Struct, tag=True, frozen=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str
    hash_extra: bytes = b""  # what the worker's block hashes mix in (router's index)


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    message: str


class PrefillDone(msgspec.Struct, tag=True, frozen=True):
    """The prompt's KV is in the decode worker's blocks; the first token is this."""

    request_id: str
    first_token: int
    logprob: TokenLogprob | None
    num_cached_tokens: int
    num_blocks: int
    num_bytes: int
    seconds: float  # the transfer alone (its sends, summed)
    num_streamed_blocks: int = 0  # of num_blocks, sent while the prompt was still computing


class PrefillFailed(msgspec.Struct, tag=True, frozen=True):
    """No KV is coming for this request (aborted, invalid, transfer failed, too late)."""

    request_id: str
    error: str
    aborted: bool = False
    retry: bool = False  # the request itself is fine: another prefill worker may do it


class PrefillStats(msgspec.Struct, tag=True):
    stats: EngineStats
    num_transferring: int = 0
    events: list[KVEvent] = []
    tokens_per_s: float = 0.0  # measured prefill rate (moving average over busy steps)
    draining: bool = False  # finishing what it has; send it nothing new


PrefillMessage = PrefillReady | WorkerFailed | PrefillDone | PrefillFailed | PrefillStats

_input_decoder = msgspec.msgpack.Decoder(PrefillInput)
_message_decoder = msgspec.msgpack.Decoder(PrefillMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> PrefillInput:
    return _input_decoder.decode(data)


def decode_message(data: bytes) -> PrefillMessage:
    return _message_decoder.decode(data)
