"""The decode channel: typed messages between the frontend and a decode worker.

Frontend → worker: ``DecodeRequest``; then, for a request the worker asked KV for,
``KVReady`` (the KV has landed; here is the first token) or ``KVFailed``; ``AbortDecode``;
``Shutdown``.
Worker → frontend: ``DecodeReady`` (with its KV endpoint) or ``WorkerFailed`` once, then
``KVWanted`` (blocks are reserved: have a prefill worker fill them) and
``DecodeOutputs`` batches, one per step.
msgspec msgpack; nothing is pickled.
"""

from __future__ import annotations

import msgspec

from engine.messages import EngineStats, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from kvstore.events import KVEvent
from kvstore.transport.base import KVDestination, KVEndpoint
from prefill.messages import Shutdown, WorkerFailed


class DecodeRequest(msgspec.Struct, tag=True, frozen=True):
    """``remote_prefill``: a prefill worker may compute the prompt (the decode worker
    still computes it itself when its uncached tail is short)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str = ""
    remote_prefill: bool = True
    output_token_ids: list[int] = []  # a resumed request's tokens so far (EngineRequest)


class KVReady(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    first_token: int
    logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0


class KVFailed(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    error: str


class AbortDecode(msgspec.Struct, tag=True, frozen=True):
    request_ids: list[str]


DecodeInput = DecodeRequest | KVReady | KVFailed | AbortDecode | Shutdown


class DecodeReady(msgspec.Struct, tag=True, frozen=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str
    endpoint: KVEndpoint
    hash_extra: bytes = b""  # what the worker's block hashes mix in (router's index)


class KVWanted(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    dest: KVDestination


class DecodeOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    num_transferring: int = 0
    events: list[KVEvent] = []
    draining: bool = False  # finishing what it has; send it nothing new


DecodeMessage = DecodeReady | WorkerFailed | KVWanted | DecodeOutputs

_input_decoder = msgspec.msgpack.Decoder(DecodeInput)
_message_decoder = msgspec.msgpack.Decoder(DecodeMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> DecodeInput:
    return _input_decoder.decode(data)


def decode_message(data: bytes) -> DecodeMessage:
    return _message_decoder.decode(data)
