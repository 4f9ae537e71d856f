"""Engine-side state of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache.block_pool import Block
from engine.messages import MediaItem
from engine.sampling_params import SamplingParams
from kvstore.hashing import ROOT_HASH, BlockHash, MediaSpan, block_extra, block_hash

UNRESOLVED = -1  # an output token sampled by a step that is still running (overlap)


def unresolved_draft(j: int) -> int:
    """The placeholder of draft ``j`` made on the device after a step still running (its
    token is known there only)."""
    return -2 - j


def draft_index(placeholder: int) -> int:
    """Which draft an ``unresolved_draft`` placeholder stands for."""
    return -2 - placeholder


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    AWAITING_KV = "awaiting_kv"  # decode worker: blocks reserved, KV on its way
    FINISHED = "finished"


@dataclass
class Request:
    """A sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV sits in ``blocks``; the tokens from
    there to ``num_tokens`` are still to run through the model. After a preemption the
    count drops to 0 and prompt + output are recomputed. ``media``: the prompt's images
    (their content hashes enter the hashes of the blocks that hold their tokens).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    hash_extra: bytes = b""
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits at first schedule; -1 until then
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    grammar: Any = None  # compiled grammar (engine.structured), set before it is scheduled
    # trailing output tokens that are UNRESOLVED: their step is still running
    num_unresolved: int = 0
    # drafts rejected by a step whose outcome came after the next step was planned: how
    # far that next step's chunk lies before where it was placed (Scheduler.update)
    moved_back: int = 0
    media: tuple[MediaItem, ...] = ()
    trace_id: str = ""  # the HTTP request it belongs to, for log lines (EngineRequest's)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_resolved_outputs(self) -> int:
        return len(self.output_token_ids) - self.num_unresolved

    def resolve(self, tokens: list[int], assumed: int = 1) -> None:
        """The oldest ``assumed`` unresolved output tokens (a step's, counted at its
        longest: every draft kept) are ``tokens``; those it did not yield are dropped."""
        first = len(self.output_token_ids) - self.num_unresolved
        self.output_token_ids[first : first + assumed] = tokens
        self.num_unresolved -= assumed

    @property
    def computes_whole_prompt(self) -> bool:
        """True while every prompt position must run through the model: the request asks
        for prompt logprobs and has no output yet (so none were sent)."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def media_spans(self) -> list[MediaSpan]:
        return [(m.offset, m.end, m.content_hash) for m in self.media]

    @property
    def media_end(self) -> int:
        """Tokens up to the end of the last image (0 without images): a worker without
        their embeddings can compute only what lies beyond."""
        return max((m.end for m in self.media), default=0)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens (memoised); a
        block holding an unresolved token has none yet."""
        num_tokens = min(num_tokens, self.num_tokens - self.num_unresolved)
        while (len(self.block_hashes) + 1) * block_size <= num_tokens:
            start = len(self.block_hashes) * block_size
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            tokens = self.token_ids(start, start + block_size)
            extra = self.hash_extra
            if self.media:
                extra = block_extra(extra, self.media_spans, start, start + block_size)
            self.block_hashes.append(block_hash(parent, tokens, extra))
        return self.block_hashes[: num_tokens // block_size]
