"""The messages every worker channel carries, and the codec each channel is made of.

A worker (``engine.worker``) serves one role: the aggregated engine (``engine.core``), a
prefill worker (``prefill``), a decode worker (``decode``). Whatever the role:

- frontend → worker: the role's own inputs (an ``EngineRequest`` here, or a role's
  message that carries one), ``Abort`` and ``Shutdown``;
- worker → frontend: ``WorkerReady`` (or ``WorkerFailed``) once, ``WorkerStats`` at
  least once a second while its loop runs (with the KV events since the last),
  ``Outputs`` (tokens, with the stats of the step that made them), the role's own
  replies, and ``Heartbeat`` from its own thread whenever nothing else went out for a
  second (so a frontend hears it through a long step).

``Codec`` adds these to a role's own message types; nothing is pickled.
"""

from __future__ import annotations

from typing import Union

import msgspec

from engine.sampling_params import SamplingParams
from kvstore.events import KVEvent
from kvstore.transport.base import KVEndpoint


class MediaItem(msgspec.Struct, array_like=True, frozen=True):
    """One image of a prompt: its placeholder tokens ``offset .. offset + length`` (copies
    of the model's image token), the patch grid the image processor makes of it
    (``grid``: time, height, width, in patches) and the sha256 of its decoded pixels and
    the processor's settings (``content_hash``), which enters the block hashes of the
    blocks holding its tokens. ``data``: the image file itself, when the worker that gets
    it is to encode it; empty when its embeddings come from an encode worker (or are not
    needed there: a decode worker's prompt arrives as KV)."""

    content_hash: bytes
    offset: int
    length: int
    grid: tuple[int, int, int]
    data: bytes = b""

    @property
    def end(self) -> int:
        return self.offset + self.length

    def without_data(self) -> MediaItem:
        return msgspec.structs.replace(self, data=b"")


class EngineRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str = ""
    # tokens already generated for it elsewhere (a request resumed on another worker):
    # computed with the prompt, they count as output (max_tokens, penalties, grammar)
    output_token_ids: list[int] = []
    media: list[MediaItem] = []  # the prompt's images, by offset
    # the HTTP request it belongs to (its x-request-id), which every worker's log lines
    # about it name; "" when it came from no HTTP request
    trace_id: str = ""

    @property
    def num_input_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Abort(msgspec.Struct, tag=True, frozen=True):
    """Stop these requests (a role answers what its protocol says it answers)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


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

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's ``later`` one as one: tokens (and their
        logprobs) in order, ``later``'s ending, the first prompt logprobs."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or ()), *later.logprobs]
        return RequestOutput(
            self.request_id, self.new_token_ids + later.new_token_ids, later.finish_reason,
            later.num_cached_tokens or self.num_cached_tokens, logprobs, later.stop_token_id,
            later.error, self.prompt_logprobs or later.prompt_logprobs,
        )  # fmt: skip


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
    kv_file_writes_dropped: int = 0  # the writer's queue was full, or the tier degraded
    kv_file_read_errors: int = 0  # block files the file system would not give back
    kv_file_write_errors: int = 0
    # 1 while the file tier writes nothing (its directory is full or read-only; summed
    # over workers: how many are degraded); it clears itself once a probe write succeeds
    kv_file_degraded: int = 0
    # speculative decoding (engine.spec), cumulative; the lists are per draft position
    spec_draft_proposed: list[int] = []
    spec_draft_verified: list[int] = []
    spec_draft_accepted: list[int] = []
    spec_verify_groups: int = 0  # (request, step) pairs that verified drafts
    spec_verify_steps: int = 0  # steps that verified drafts
    spec_expected_milli: int = 0  # kept drafts the verify policy expected, x1000
    spec_error_milli: int = 0  # sum over groups of |expected - kept|, x1000
    spec_time_us: int = 0  # measured time of the steps whose time the cost model predicted
    spec_time_error_us: int = 0  # sum of |predicted - measured| step time
    spec_budget_drafts: int = 0  # drafts the verify policy chose, summed over its steps
    spec_budget_steps: int = 0  # steps the policy was asked (some request had drafts)
    spec_guard_blocked_steps: int = 0  # steps the realized-gain guard ran without drafts
    spec_guard_probe_steps: int = 0  # the guard's probe steps (either mode)
    spec_explored_steps: int = 0  # steps verifying a total of a step size never measured


class WorkerReady(msgspec.Struct, tag=True, frozen=True):
    """A worker is up: what it serves and how much room it has. A rank of an
    expert-parallel group names the group, its rank and the group's size. ``startup``:
    seconds its start took, by phase (``process``: interpreter and imports; ``group``:
    meeting its group's ranks; ``weights``; ``compile``: the first forward, where kernels
    compile; ``graphs``: CUDA graph capture)."""

    role: str  # "engine" | "prefill" | "decode" | "encode"
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str
    hash_extra: bytes = b""  # what its block hashes mix in (the router's prefix index)
    endpoint: KVEndpoint | None = None  # where KV for it goes (a decode worker's receiver)
    device: str = ""  # where its engine runs (cpu, cuda:1)
    kv_cache_bytes: int = 0  # the size of its KV cache
    group: str = ""
    rank: int = 0
    group_size: int = 1
    startup: dict[str, float] = {}
    encodes_images: bool = False  # it runs a vision tower: send it the image files


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    """A worker could not start; why."""

    message: str


class ExpertStats(msgspec.Struct, frozen=True):
    """A rank's experts (``engine.ep``), since it started: ``routed`` [layer-major,
    ``len(moe_layers) * num_experts``] the (token, choice) pairs its own tokens routed to
    each logical expert of each MoE layer (``moe_layers``: their decoder layer indices);
    ``computed`` the pairs its expert slots computed, whoever routed them; ``rebalances``
    the placements its group switched to; ``imbalance`` the balancer's max/mean rank load
    (mean over layers) at its last rebalance (0: none yet)."""

    group: str
    rank: int
    size: int
    moe_layers: list[int]
    num_experts: int
    routed: list[int]
    computed: int = 0
    rebalances: int = 0
    imbalance: float = 0.0


class GcStats(msgspec.Struct, frozen=True):
    """A process's garbage collector (``engine.heap``), cumulative: collections and their
    pause seconds by generation, the longest pause, the objects frozen at startup."""

    collections: tuple[int, int, int] = (0, 0, 0)
    pause_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    longest_s: float = 0.0
    frozen: int = 0


class WorkerStats(msgspec.Struct, tag=True):
    """A worker's state for the frontends' routing and metrics."""

    stats: EngineStats
    num_transferring: int = 0  # requests whose KV is reserved for or in a transfer
    events: list[KVEvent] = []  # since the previous stats message
    tokens_per_s: float = 0.0  # measured prefill rate (moving average over busy steps)
    draining: bool = False  # finishing what it has; send it nothing new
    experts: ExpertStats | None = None  # an expert-parallel rank's, at most once a second
    gc: GcStats | None = None  # its garbage collector's pauses (the shell adds them)


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """The worker is alive (sent by its own thread when nothing else went out lately)."""


class Outputs(msgspec.Struct, tag=True):
    """New tokens of some requests (all of them one frontend's), and the worker's stats
    after the step that made them."""

    outputs: list[RequestOutput]
    stats: WorkerStats | None = None


def stats_of(msg: msgspec.Struct) -> WorkerStats | None:
    """The worker stats ``msg`` carries, if any."""
    if isinstance(msg, Outputs):
        return msg.stats
    return msg if isinstance(msg, WorkerStats) else None


class Codec:
    """The encoder and the two decoders of one role's channel: ``inputs`` are the role's
    own messages to the worker, ``replies`` its own messages to frontends; the messages
    every channel carries are added to both."""

    def __init__(self, inputs: tuple[type, ...], replies: tuple[type, ...] = ()) -> None:
        self._inputs = msgspec.msgpack.Decoder(Union[(*inputs, Abort, Shutdown)])  # noqa: UP007
        self._replies = msgspec.msgpack.Decoder(
            Union[(*replies, WorkerReady, WorkerFailed, WorkerStats, Outputs, Heartbeat)]  # noqa: UP007
        )
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode_input(self, data: bytes) -> msgspec.Struct:
        return self._inputs.decode(data)

    def decode_reply(self, data: bytes) -> msgspec.Struct:
        return self._replies.decode(data)


ENGINE = Codec((EngineRequest,))  # the aggregated engine's channel
