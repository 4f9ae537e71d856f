"""The scheduler's decision for one step, as plain data the runner executes."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    ends at the sequence's last token, so its final row is sampled.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_ids: list[str] = field(default_factory=list)
    # (block, hash) published for this step, whose content it computes: written through to
    # the KV tiers once it has run
    computing: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class StepResult:
    """What the runner sampled: for each chunk with ``sample``, one token (and logprobs).

    ``ended``: requests whose sampled token completed their grammar; they stop there.
    ``prompt_logprobs``: for requests that asked and sampled their first token this step,
    one entry per prompt token (``TokenLogprob``; the first None).
    """

    sampled: dict[str, int]
    logprobs: dict[str, object] = field(default_factory=dict)  # request_id -> TokenLogprob
    ended: frozenset[str] = frozenset()
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
