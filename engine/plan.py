"""The scheduler's decision for one step, as plain data the runner executes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.messages import MediaItem
    from engine.request import Request


@dataclass(frozen=True)
class NewRequest:
    """Sent the first time the runner sees a request: what it keeps for sampling, and the
    prompt's images (their positions, and where their embeddings go)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    grammar: Any = None  # the compiled grammar when ``sampling.grammar`` is set
    # tokens generated before this runner first sees the request (a decode worker's first
    # token, sampled by the prefill worker): penalties count them, the matcher replays them
    output_token_ids: tuple[int, ...] = ()
    media: tuple[MediaItem, ...] = ()

    @classmethod
    def of(cls, req: Request) -> NewRequest:
        """What the runner gets of ``req`` (with the tokens it already has as output)."""
        return cls(req.request_id, req.prompt_token_ids, req.sampling, req.eos_token_ids,
                   req.grammar, tuple(req.output_token_ids), req.media)  # fmt: skip


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start_pos .. start_pos+len(token_ids)`` of one sequence, to run this step.

    ``block_ids`` is the sequence's whole block table. ``sample`` is true when the chunk
    ends at the sequence's last token, so its final row is sampled. ``num_draft`` > 0
    (speculative decoding; ``sample`` is then true): the last ``num_draft`` tokens are
    drafts that follow the sequence's last token, and the last ``num_draft + 1`` rows are
    verified (``engine.sampler``: each draft is kept or rejected, then one token is
    sampled after the kept ones).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    num_draft: int = 0

    def __post_init__(self) -> None:
        if self.num_draft and (not self.sample or self.num_draft >= len(self.token_ids)):
            raise ValueError("drafts follow a sampled sequence's last token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits are sampled or verified: 0, 1, or 1 + the drafts."""
        return self.num_draft + 1 if self.sample else 0

    @property
    def is_decode(self) -> bool:
        """One token (plus its drafts) that samples: a decode row, not a prompt's."""
        return self.sample and self.num_tokens == self.num_draft + 1

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft :] if self.num_draft else []


def one_token_rows(chunks: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
    """Each chunk of one token plus drafts as one-token chunks of their own over its
    sequence's blocks, whatever shares the step (None when no chunk has drafts): a verify
    chunk's rows then take the decode path of every attention backend, and a row moved
    back on the device (``engine.runner``) is a sequence of its own."""
    if not any(c.num_draft and c.is_decode for c in chunks):
        return None
    return [
        row
        for c in chunks
        for row in (
            [ScheduledChunk(c.request_id, [t], c.start_pos + j, c.block_ids, True)
             for j, t in enumerate(c.token_ids)]
            if c.num_draft and c.is_decode else [c]
        )
    ]  # fmt: skip


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_ids: list[str] = field(default_factory=list)
    # (block, hash) published for this step, whose content it computes: written through to
    # the KV tiers once it has run
    computing: list = field(default_factory=list)
    # whether the drafter proposes drafts after this step (False: the verify policy has
    # verified none lately, SpecDecoding.proposes; a model drafter still sees the step)
    propose: bool = True

    # a plan's sums and kinds are asked for several times a step, each a pass over its
    # chunks (256 and more at high load): taken once (a plan and its chunks never change)
    @cached_property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @cached_property
    def num_draft_tokens(self) -> int:
        return sum(c.num_draft for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @cached_property
    def is_decode(self) -> bool:
        """Every chunk one token (plus its drafts) that samples: the decode path, which
        replays CUDA graphs up to their largest size."""
        return all(c.is_decode for c in self.chunks)


@dataclass(frozen=True)
class StepTiming:
    """Where the step's time went, in seconds, as the runner measured it: the target
    forward (and its logits), sampling or verification, and drafting the next step."""

    forward_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0


@dataclass(frozen=True)
class StepResult:
    """What the runner sampled: for each chunk with ``sample``, one token (and logprobs).

    ``accepted``: for a chunk with drafts, the drafts kept, in order; ``sampled`` is the
    token that follows them. ``logprobs``: per request that asked, one ``TokenLogprob``
    per token it got (the accepted drafts', then the sampled one's).
    ``ended``: requests whose tokens completed their grammar; they stop there.
    ``prompt_logprobs``: for requests that asked and sampled their first token this step,
    one entry per prompt token (``TokenLogprob``; the first None).
    ``proposals``: drafts for the next step (``engine.spec``), by request.
    """

    sampled: dict[str, int]
    logprobs: dict[str, list] = field(default_factory=dict)  # request_id -> [TokenLogprob]
    ended: frozenset[str] = frozenset()
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    proposals: dict[str, Any] = field(default_factory=dict)  # request_id -> spec.Proposal
    timing: StepTiming | None = None

    def tokens(self, request_id: str) -> list[int]:
        """Every token ``request_id`` got this step: the accepted drafts, then the sampled."""
        return [*self.accepted.get(request_id, ()), self.sampled[request_id]]
