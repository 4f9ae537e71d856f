"""The drafter contract: what a drafter is told about each step and what it proposes.

A drafter lives beside the runner (it runs where the model runs) and is called once per
step, after the step's tokens are known (``ModelRunner.finish``): it sees the step's
chunks, how many leading tokens of each are now real (a chunk's rejected drafts are not),
the target's hidden states of the step's rows, and the requests that sampled and go on.
For each of those it returns a ``Proposal``: up to K tokens that follow the request's
last token, each with a confidence, the drafter's estimate of the probability that the
token is kept given that the drafts before it are. The scheduler's side
(``engine.spec.manager``) turns those into how many drafts each request gets verified in
the next step; the runner verifies them in that step's one target forward.

A proposal is a point mass: one token per position, never a distribution, so the
verifier's acceptance test is ``u < q(token)`` (``engine.sampler``).

A drafter ``on_device`` (the MTP layers) drafts from the step's outputs on the device
instead: ``launch`` is called right after the step's forward and verification are queued,
before anything is read back, with the step's hidden states and the token that follows
each of its rows (sampled and verified tokens included, as the device has them); it
queues its forwards behind the step's and returns a ``Drafting`` that the runner reads
once the step is collected. So a verify step and the drafting after it run back to back
on the device, read back together.

Drafters that run a model of their own keep its KV in slots of the request's own blocks
(the target's block table): ``kv_lookahead`` says how many positions past the next
verify step's tokens they write, which the scheduler keeps allocated for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import AttentionMetadata, device_index, move_back, padded_tables
from engine.plan import NewRequest, ScheduledChunk, one_token_rows
from engine.spec.chain import Chained
from kvstore.layout import KVCache


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request: ``token_ids[j]`` is a guess for the token at index
    ``start + j`` of prompt + output; ``confidence[j]`` estimates P(token j kept | the
    drafts before it kept)."""

    start: int
    token_ids: list[int]
    confidence: list[float]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.confidence):
            raise ValueError("one confidence per draft token")
        if any(not 0.0 <= c <= 1.0 for c in self.confidence):
            raise ValueError(f"confidences are probabilities, got {self.confidence}")

    def survival(self) -> list[float]:
        """Prefix survival: ``P_i`` = the product of the first ``i + 1`` confidences, the
        probability that draft ``i`` is kept."""
        out, p = [], 1.0
        for c in self.confidence:
            p *= c
            out.append(p)
        return out


def draft_depth(verified: int, max_draft: int) -> int:
    """How many drafts a drafter on the device makes behind a step for a request that
    verifies ``verified`` drafts in it: two more than that (the next step is planned
    before these are made, and the policy's lengths move little from one step to the next:
    they may grow by two a step), all it can when it verifies none (new, or after a rest).
    By two, not one: between the graph buckets of a step of 64 requests, one draft a
    request (128 rows) and three (256) are the choices and two pad to three's bucket; one
    further only, the policy never saw three and stayed at one, 0.92-0.94 of fixed k = 3
    over the simulated H200's seeds (``bench.spec_decode_sim``, 4x the requests), 0.99-1.00
    two further. Each draft position is a chained pass of the drafter: with five drafted
    behind each step where about one was verified, a step of 128 requests on an H200 took
    ~2 % longer than with one drafted, for the same rows. The scheduler plans the next
    step's drafts within the same depth (``SpecDecoding.drafts_for``)."""
    return max_draft if verified <= 0 else min(max_draft, verified + 2)


@dataclass(frozen=True)
class DraftRequest:
    """A request to propose for: it sampled this step and goes on."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output, this step's tokens included
    block_ids: list[int]  # its block table, allocated ``kv_lookahead`` positions ahead
    num_draft: int  # propose at most this many


@dataclass
class DraftStep:
    """What one step did, as a drafter needs to know it.

    ``num_real[i]``: leading tokens of ``chunks[i]`` whose KV is now valid (all of a
    prefill chunk; a verify chunk's input token and its kept drafts). ``token_ids[i]``:
    the whole known sequence of chunk ``i``'s request (prompt + output, this step's
    tokens included), so the token after its real ones is ``token_ids[i][start + num_real]``
    when known. ``hidden``: the target's final hidden states, one row per token of the
    step in chunk order (None when the drafter did not ask for them).
    """

    chunks: list[ScheduledChunk]
    num_real: list[int]
    token_ids: list[Sequence[int]]
    requests: list[DraftRequest] = field(default_factory=list)
    hidden: torch.Tensor | None = None

    def rows(self, i: int) -> range:
        """Rows of ``hidden`` that hold chunk ``i``'s real tokens."""
        start = sum(c.num_tokens for c in self.chunks[:i])
        return range(start, start + self.num_real[i])


@dataclass
class LaunchStep:
    """A step just queued on the device, as an ``on_device`` drafter sees it.

    ``hidden``: the target's final hidden states, a row per token of ``chunks`` in order
    (more rows may follow: padding; None unless the drafter ``needs_hidden``);
    ``next_ids``: the token that follows each row, on the device (a row past a verify
    chunk's kept drafts holds some token: its KV is written again before anything attends
    to it). ``requests`` draft: ``num_draft`` is at most
    what each may verify next (the runner cuts the proposal to its room once the step's
    tokens are known). Per request, on the device: ``last_rows``, the row of its last
    real token (its chunk's input token or last kept draft), and ``back``, how many
    positions before its ``bounds`` (host: its chunk's end, as planned) the position
    after that row really is (the drafts rejected, this step's and the step before's).
    ``shift``: per row, how far before its planned position it really sits (the step was planned
    before the one before it was known: ``engine.runner``; only a verify chunk's rows and
    one-token chunks move), None when none moved. ``input_ids``: the step's input tokens on
    the device, a row per token; ``context(request_id)``: the request's tokens the host
    knows.
    """

    chunks: list[ScheduledChunk]
    hidden: torch.Tensor | None
    next_ids: torch.Tensor
    requests: list[DraftRequest]
    last_rows: torch.Tensor
    back: torch.Tensor
    bounds: list[int]
    shift: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    context: Callable[[str], Sequence[int]] = lambda request_id: ()

    def rows_of(
        self, keep: Callable[[ScheduledChunk], bool]
    ) -> tuple[list[ScheduledChunk], list[int]]:
        """The chunks ``keep`` takes, and the step's rows that are theirs, in order."""
        chunks, rows, first = [], [], 0
        for c in self.chunks:
            if keep(c):
                chunks.append(c)
                rows += range(first, first + c.num_tokens)
            first += c.num_tokens
        return chunks, rows

    def chunk_rows(
        self, chunks: list[ScheduledChunk], block_size: int, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """``chunks`` (the step's rows ``index``; all of them by default) as the step ran
        them, a sequence each and a verify chunk's rows one-token sequences
        (``plan.one_token_rows``), moved back by ``shift``: the rows' positions and the
        attention metadata."""
        from engine.runner import step_inputs

        chunks = one_token_rows(chunks) or chunks
        device = self.next_ids.device
        blank = [ScheduledChunk(c.request_id, [0] * c.num_tokens, c.start_pos, c.block_ids,
                                False) for c in chunks]  # fmt: skip
        inputs, _ = step_inputs(blank, block_size, device)
        lengths = np.array([c.num_tokens for c in chunks])
        single = np.flatnonzero(lengths == 1)  # only these may have moved
        if self.shift is not None and len(single):
            rows = device_index((np.cumsum(lengths) - 1)[single], device)
            by = self.shift[rows if index is None else index[rows]]
            move_back(inputs.meta, inputs.positions, rows, device_index(single, device), by,
                      block_size)  # fmt: skip
        return inputs.positions, inputs.meta

    def token_rows(
        self, chunks: list[ScheduledChunk], index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, np.ndarray, list[int]]:
        """``chunks``' rows (the step's rows ``index``; all of them by default) one token
        a sequence: their positions on the device (moved back by ``shift``), each row's
        block table, and the positions as planned (a host bound on each)."""
        positions, planned = self.row_positions(chunks, index)
        tables = padded_tables([c.block_ids for c in chunks for _ in range(c.num_tokens)])
        return positions, tables, planned.tolist()

    def row_positions(
        self, chunks: list[ScheduledChunk], index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The positions of ``chunks``' rows (the step's rows ``index``; all of them by
        default): on the device, where they really are (moved back by ``shift``), and on
        the host as planned."""
        planned = np.concatenate([np.arange(c.start_pos, c.end_pos) for c in chunks])
        positions = device_index(planned, self.next_ids.device)
        if self.shift is not None:
            positions = positions - (self.shift[: len(planned)] if index is None
                                     else self.shift[index])  # fmt: skip
        return positions, planned

    def placed(self, active: list[int], at: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For the drafting requests ``active`` (indices into ``requests``) at positions
        ``at`` as planned: their indices on the device, and where they really are."""
        index = device_index(active, self.next_ids.device)
        return index, device_index(at, self.next_ids.device) - self.back[index]


@dataclass
class Drafting:
    """Drafts queued on the device for ``request_ids`` (``Drafter.launch``)."""

    request_ids: list[str]
    chained: Chained = field(default_factory=lambda: Chained(0, []))

    def to_host(self) -> dict[str, tuple[list[int], list[float]]]:
        """Per request: its draft tokens and their confidences (waits for the drafting)."""
        return dict(zip(self.request_ids, self.chained.to_host()))

    def table(self, width: int) -> torch.Tensor:
        """The drafts as a device table [requests, width] (0 past a request's last)."""
        return self.chained.as_table(width)


class Drafter:
    """Proposes draft tokens (module docstring). One instance per runner.

    ``add`` / ``drop`` follow the runner's requests; ``reset`` says a request lost its KV
    (preempted: recomputed later); ``observe`` reports how many of the drafts verified for
    a request were kept, for drafters that learn their confidence online. ``propose`` is
    called after every step, with an empty ``requests`` list when nobody samples (a model
    drafter still writes the KV of the step's tokens then).
    """

    name = "drafter"
    needs_hidden = False  # whether ``DraftStep.hidden`` must be filled
    # whether ``propose`` must see a step after which nothing is proposed (a model drafter
    # writes the KV of its tokens); False: such a step is not shown to it at all
    sees_every_step = True
    kv_lookahead = 0  # positions past the verified tokens whose KV slots it writes

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def add(self, new: NewRequest) -> None:  # noqa: B027 - optional hook
        """A request the runner sees for the first time."""

    def drop(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request ended."""

    def reset(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request's KV is gone (preempted); it will be recomputed."""

    def observe(self, request_id: str, num_verified: int, num_kept: int) -> None:  # noqa: B027
        """Of ``num_verified`` drafts verified for the request, the first ``num_kept``
        were kept."""

    on_device = False  # drafts at launch from the step's device outputs (``launch``)

    def propose(self, step: DraftStep) -> dict[str, Proposal]:
        """Proposals for ``step.requests`` (a request may get none: no good guess); a
        drafter that is not ``on_device`` has this."""
        raise NotImplementedError

    def launch(self, step: LaunchStep) -> Drafting:
        """Queue the drafts of ``step.requests`` (an ``on_device`` drafter has this)."""
        raise NotImplementedError

    def capture_graphs(self, max_rows: int, max_seq_len: int, capture: bool = True):
        """Replay the drafter's forwards from CUDA graphs from now on, where it has some
        (``engine.spec.graphs``); returns them (their ``dry_run``, ``capture``), or None."""
        return None

    def kv_layers(self) -> int:
        """Layers the drafter adds to the target's KV cache (carried with its blocks:
        prefix cache, tiers, transfers); 0 when it keeps its KV elsewhere or has none."""
        return 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of a KV cache of its own per block of the target's (sizing the cache)."""
        return 0

    def bind(self, cache: KVCache, num_blocks: int, max_model_len: int) -> None:  # noqa: B027
        """The target's KV cache exists now (``num_blocks`` blocks; contexts of at most
        ``max_model_len`` tokens): a drafter with KV of its own allocates it here."""
