"""The engine channel: typed messages between the frontend and an engine process.

Frontend → engine: ``EngineRequest``, ``AbortRequests``, ``Shutdown`` (one tagged union).
Engine → frontend: ``EngineReady`` once, then ``EngineOutputs`` batches.
Encoded with msgspec msgpack; nothing is pickled.
"""

from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str = ""
    # tokens already generated for it elsewhere (a request resumed on another worker):
    # computed with the prompt, they count as output (max_tokens, penalties, grammar)
    output_token_ids: list[int] = []


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


EngineInput = EngineRequest | AbortRequests | Shutdown


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """The sampled (or, for a prompt, the given) token's logprob and the top alternatives
    (ids, logprobs, best first). ``rank``: the token's 1-based rank in the distribution,
    set for prompt tokens."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None


class RequestOutput(msgspec.Struct, array_like=True):
    """New tokens of one request since the last batch; ``finish_reason`` set on the last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_token_id: int | None = None
    error: str | None = None
    # on the request's first output when ``sampling.prompt_logprobs`` is set: one entry per
    # prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class EngineStats(msgspec.Struct, frozen=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_query_tokens: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # cumulative tokens found there (any tier)
    num_preemptions: int = 0  # cumulative
    # KV tiers (engine.kv_cache.tiered); all cumulative except the host blocks
    prefix_hit_tokens_device: int = 0
    prefix_hit_tokens_host: int = 0
    prefix_hit_tokens_file: int = 0
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_host_bytes_read: int = 0
    kv_host_bytes_written: int = 0
    kv_host_evictions: int = 0
    kv_file_bytes_read: int = 0
    kv_file_bytes_written: int = 0
    kv_file_evictions: int = 0  # over capacity
    kv_file_expired: int = 0  # past the TTL
    kv_file_checksum_failures: int = 0
    kv_file_writes_dropped: int = 0  # the writer's queue was full


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    timestamp: float = 0.0


class EngineReady(msgspec.Struct, tag=True, frozen=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str


class EngineFailed(msgspec.Struct, tag=True, frozen=True):
    message: str


EngineMessage = EngineOutputs | EngineReady | EngineFailed

_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_message_decoder = msgspec.msgpack.Decoder(EngineMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_message(data: bytes) -> EngineMessage:
    return _message_decoder.decode(data)
