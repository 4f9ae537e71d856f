"""Executes a StepPlan: builds the step's tensors, runs the model, samples.

The runner keeps, per request, only what sampling needs (params, generator, tokens
so far, the grammar matcher of a structured request); everything about *which* tokens
run and where their KV goes comes in the plan.

Prompt logprobs (``sampling.prompt_logprobs``): each prefill chunk of such a request also
computes the logits of its prompt positions (``PROMPT_LOGPROB_ROWS`` rows at a time) and
keeps the logprob of the prompt token that follows each; the step that samples the
request's first token returns them all in ``StepResult.prompt_logprobs`` (first entry
None). A chunk recomputed after a preemption replaces what it computed before. Only the
prompt's first prefill computes them: a request that arrives with output tokens (resumed
elsewhere) does not.

Speculative decoding: a chunk with drafts (``ScheduledChunk.num_draft``) has its last
``num_draft + 1`` rows verified in the same forward (``Sampler.verify``: each row's
sampling history holds the drafts before it, and a structured request's mask row is its
grammar's state after them); the request gets the kept drafts and one sampled token.
Each token of a chunk of one token plus drafts becomes a row of its own over the sequence's
block table (context up to that token), whatever shares the step, so verify rows take the
decode path of every attention backend, and steps of nothing else replay the decode CUDA
graphs by bucket of rows. After the step's tokens are known the ``Drafter``
(``engine.spec``) proposes the next drafts; they come back in ``StepResult.proposals``, cut
where a request's grammar would reject one. A drafter ``on_device`` drafts in ``launch``
instead, right behind the verification, from the tokens on the device; its drafts come back
with the step's. The step after it may then be planned before its outcome: its placeholders
(the token after the kept drafts, the drafts made behind the step) are filled in on the
device, where its rows are moved back by the drafts rejected (``resolve_inputs``); new
prompts may share that step. The drafts a verify step checks are read from its own input
tokens on the device.
Images (``NewRequest.media``): a chunk that covers an image's placeholder tokens takes
their embeddings from ``embeddings(request_id)`` (one tensor per image, in order) and
hands them to the model as ``Spliced`` rows; a model whose ``rope_table`` places a
prompt's tokens off their indices (M-RoPE) gets positions ``[streams, T]`` for a step
that holds such tokens, and ``index + delta`` ([T]) for one whose tokens all lie past
the last image (decode steps, so their CUDA graphs serve those requests too). Positions
depend only on the request and the token index, so prefix hits, chunking, preemption and
a request that arrives with its KV computed elsewhere need nothing special.

Decode-only steps replay a CUDA graph when ``capture_decode_graphs`` has run
(``engine.cuda_graphs``); steps with prompt tokens, up to the token count that
``capture_piecewise_graphs`` was given, replay graph pieces between eager attentions
(``engine.piecewise_graphs``), unless they splice image embeddings in or place tokens by
M-RoPE; other steps run eagerly. Either way the step's forward and its
sampling only queue device work: inputs go over from pinned memory without waiting, and
the copy of the sampled tokens back to the host at the end of ``execute`` is the step's
one synchronisation.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    device_arrays,
    device_index,
    device_indices,
    host_to_device,
    padded_tables,
)
from engine.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from engine.inflight import Clock, LeftBehind
from engine.messages import TokenLogprob
from engine.models.base import CausalLM, RopeTable, Spliced
from engine.models.quant import decode_rows
from engine.piecewise_graphs import TOKEN_BUCKETS, PiecewiseGraphs
from engine.plan import (
    NewRequest,
    ScheduledChunk,
    StepPlan,
    StepResult,
    StepTiming,
    one_token_rows,
)
from engine.request import UNRESOLVED, draft_index
from engine.sampler import (
    DraftGroup,
    PendingTokens,
    PromptLogprobs,
    SampledTokens,
    Sampler,
    SamplingRow,
    VerifiedTokens,
    distinct_ids,
)
from engine.spec.base import (
    Drafter,
    Drafting,
    DraftRequest,
    DraftStep,
    LaunchStep,
    Proposal,
    draft_depth,
)
from engine.structured import GrammarState, build_draft_mask, build_mask
from kernels import parallel_builds

log = logging.getLogger("ferry.runner")

PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits exist at once (rows x vocab floats)


@dataclass
class _RowState:
    new: NewRequest
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None
    # prompt logprobs computed so far: (first position, its rows' logprobs), by position
    prompt_parts: list[tuple[int, PromptLogprobs]] = field(default_factory=list)
    prompt_sent: bool = False
    rope: RopeTable | None = None  # positions that are not token indices (M-RoPE)
    prompt_ids: torch.Tensor | None = None  # its prompt's distinct ids on the device, if read

    def rope_offset(self, start: int) -> int | None:
        """What a token at ``start`` or later adds to its index as its position in every
        stream; None when tokens there have positions of their own."""
        if self.rope is None:
            return 0
        return self.rope.delta if start >= self.rope.linear_from else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.new.sampling.prompt_logprobs is not None and not self.prompt_sent

    def prompt_rows(self, chunk: ScheduledChunk) -> range:
        """Positions of ``chunk`` whose logits predict a prompt token (none once sent)."""
        if not self.wants_prompt_logprobs:
            return range(0)
        return range(chunk.start_pos, min(chunk.end_pos, len(self.new.prompt_token_ids) - 1))

    def add_prompt_part(self, start: int, part: PromptLogprobs) -> None:
        """Keep ``part``; whatever was computed from ``start`` on before (a chunk run again
        after a preemption) is dropped."""
        self.prompt_parts = [(s, p) for s, p in self.prompt_parts if s < start]
        self.prompt_parts.append((start, part))

    def take_prompt_logprobs(self) -> list[TokenLogprob | None]:
        entries: list[TokenLogprob | None] = [None]
        for _, part in self.prompt_parts:
            entries += part.to_host()
        self.prompt_parts, self.prompt_sent = [], True
        return entries

    def row(self) -> SamplingRow:
        """The sampling row of its tokens so far (on the host: ``ModelRunner._pending``
        adds what the device alone knows)."""
        return SamplingRow(
            params=self.new.sampling,
            generator=self.generator,
            prompt_token_ids=(
                self.new.prompt_token_ids if self.prompt_ids is None else self.prompt_ids
            ),
            output_token_ids=self.output_token_ids,
            eos_token_ids=self.new.eos_token_ids,
        )

    @property
    def live_grammar(self) -> GrammarState | None:
        """Its grammar, unless complete (its request ended with the step before, planned
        past: what this step samples for it is dropped)."""
        return None if self.grammar is None or self.grammar.is_terminated else self.grammar

    @property
    def reads_history(self) -> bool:
        """Whether sampling its next token reads its output so far (penalties, min_tokens)."""
        sp = self.new.sampling
        return sp.needs_penalties or len(self.output_token_ids) < sp.min_tokens

    def token_ids(self) -> list[int]:
        return [*self.new.prompt_token_ids, *self.output_token_ids]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor  # [T], or [streams, T] when some token has its own (M-RoPE)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the step's tokens whose logits are sampled
    sample_ids: list[str]
    spliced: Spliced | None = None  # image embeddings in place of their tokens' embeddings


Embeddings = Callable[[str], "list[torch.Tensor] | None"]


@dataclass
class _Launched:
    """A step queued on the device: what ``finish`` collects. Until ``complete`` has
    queued its sampling, ``logits`` holds what it samples and ``ids`` / ``shift`` its
    input tokens and rows moved back (``ModelRunner.resolve_inputs``)."""

    plan: StepPlan
    clock: Clock
    hidden: torch.Tensor | None  # the step's hidden states, when the drafter wants them
    logits: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    plain_ids: list[str] = field(default_factory=list)  # requests sampled one token
    plain: SampledTokens | None = None
    verify_ids: list[str] = field(default_factory=list)  # drafts verified, in group order
    verified: VerifiedTokens | None = None
    drafting: Drafting | None = None  # drafts queued behind the step (``Drafter.on_device``)
    # requests planned before the step before was back (their input token a placeholder)
    unresolved: frozenset[str] = frozenset()
    deferred: bool = False  # sampled after the step before was collected (``launch``)

    @property
    def sample_ids(self) -> list[str]:
        return self.plain_ids + self.verify_ids


class ModelRunner:
    """``embeddings(request_id)``: the embeddings of a request's images, one tensor
    [tokens, hidden] per image (None when this engine has none for it)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        sampler: Sampler,
        block_size: int,
        drafter: Drafter | None = None,
        proposes: bool = True,
        embeddings: Embeddings | None = None,
    ) -> None:
        """``drafter``: proposes each step's drafts for the next (speculative decoding);
        ``proposes`` False: it only keeps its KV of the step's tokens (a prefill worker's
        MTP layers, whose KV goes to the decode worker with the blocks)."""
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.drafter = drafter
        self.proposes = proposes
        self.embeddings = embeddings or (lambda request_id: None)
        self.device = next(model.parameters()).device
        self.states: dict[str, _RowState] = {}
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        self.num_forwards = 0  # model forwards run (or replayed) since start
        self._previous = LeftBehind()
        self._drafted: dict[str, list[int]] = {}  # the last drafts collected, by request
        # per row of the step being launched: how many positions back its request's
        # tokens really sit (drafts the step in flight rejected); None when none do
        self._shift: torch.Tensor | None = None

    @property
    def computes_in_launch(self) -> bool:
        """Whether ``launch`` runs the forward itself (on the CPU) rather than queuing it
        on a device: then the host time around it holds the forward's time too."""
        return self.device.type != "cuda"

    def capture_decode_graphs(
        self,
        max_batch: int,
        max_seq_len: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: bool = True,
    ) -> DecodeGraphs:
        """From now on, decode-only steps of up to ``max_batch`` sequences whose contexts
        fit ``max_seq_len`` replay CUDA graphs (``capture=False``: the same padded buffers,
        run eagerly; the CPU's way to exercise them)."""
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.block_size, max_batch, max_seq_len, buckets, capture
        )
        self.graphs.resolve_inputs = self.resolve_inputs
        return self.graphs

    def capture_piecewise_graphs(
        self, max_tokens: int, buckets: tuple[int, ...] = TOKEN_BUCKETS, capture: bool = True
    ) -> PiecewiseGraphs:
        """From now on, steps of up to ``max_tokens`` tokens that no decode graph holds
        replay graph pieces between eager attentions (``capture=False``: the same padded
        buffers and attention calls, without graphs; the CPU's way to exercise them)."""
        self.pieces = PiecewiseGraphs(self.model, self.backend, max_tokens, buckets, capture)
        return self.pieces

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> _Launched | None:
        """Queue the plan's forward and sampling on the device; ``finish`` waits for the
        tokens. An UNRESOLVED input token is the one the previous launch sampled for its
        request: it goes from that step's output to this step's input on the device.

        A structured request planned so (its grammar not yet advanced by that token) has
        its step's forward queued only: ``complete`` queues the sampling once ``finish``
        has collected the step before, and the device computes the forward meanwhile."""
        self._sync_states(plan)
        if plan.is_empty:
            return None
        clock = Clock(self.device)
        with torch.inference_mode():
            logits, hidden = self._logits(plan)
        clock.mark()
        wanted = self.drafter is not None and self.drafter.needs_hidden
        launched = _Launched(plan, clock, hidden if wanted else None, logits, self._ids,
                             self._shift)  # fmt: skip
        launched.unresolved = frozenset(c.request_id for c in plan.chunks
                                        if c.sample and c.token_ids[0] == UNRESOLVED)  # fmt: skip
        launched.deferred = any(self.states[rid].grammar is not None
                                for rid in launched.unresolved)  # fmt: skip
        if not launched.deferred:
            self.complete(launched)
        return launched

    def complete(self, launched: _Launched | None) -> None:
        """Queue the sampling (and the drafting behind it) of a launched step whose forward
        alone is queued; nothing when it has them. Run after ``finish`` of the step before
        where ``launch`` left it so: its tokens are then on the host, in the grammars."""
        if launched is None or launched.logits is None:
            return
        logits, launched.logits = launched.logits, None
        self._ids, self._shift = launched.ids, launched.shift
        clock = launched.clock
        with torch.inference_mode():
            if launched.deferred:
                clock.gap()  # the device waited for the host to collect the step before
            self._sample_and_verify(launched, logits)
            clock.mark()
            for tokens in (launched.plain, launched.verified):
                if tokens is not None:
                    tokens.start_copy()  # before the drafting: read back without waiting for it
            drafter = self.drafter
            if drafter is not None and drafter.on_device and self._drafts_behind(launched):
                launched.drafting = self._launch_drafts(launched)
                clock.mark()
        self._previous = self._left_behind(launched)

    def _left_behind(self, launched: _Launched) -> LeftBehind:
        previous = LeftBehind(verify={rid: g for g, rid in enumerate(launched.verify_ids)},
                              verified=launched.verified)  # fmt: skip
        if launched.plain is not None:
            previous.plain = {rid: i for i, rid in enumerate(launched.plain_ids)}
            previous.plain_tokens = launched.plain.tokens
        drafting = launched.drafting
        if drafting is not None and drafting.request_ids:
            previous.drafted = {rid: d for d, rid in enumerate(drafting.request_ids)}
            previous.drafts = drafting.table(self.drafter.max_draft)
        return previous

    def finish(self, launched: _Launched | None) -> StepResult:
        if launched is None:
            return StepResult({})
        self.complete(launched)
        emitted: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        if launched.plain is not None:
            out = launched.plain.to_host()  # the step's device-to-host copy: waits for it
            for rid, token, lp in zip(launched.plain_ids, out.token_ids, out.logprobs):
                emitted[rid] = [token]
                if lp is not None:
                    logprobs[rid] = [lp]
        if launched.verified is not None:
            drafts = {c.request_id: c.num_draft for c in launched.plan.chunks if c.num_draft}
            for rid, (tokens, lps) in zip(launched.verify_ids, launched.verified.to_host()):
                emitted[rid] = tokens
                if lps[0] is not None:
                    logprobs[rid] = lps
                if self.drafter is not None:
                    self.drafter.observe(rid, drafts[rid], len(tokens) - 1)
        prompt = {
            rid: state.take_prompt_logprobs()
            for rid in launched.sample_ids
            if (state := self.states.get(rid)) is not None and state.wants_prompt_logprobs
        }
        ended = self._record(emitted)
        start = time.perf_counter()
        self._drafted = {}
        if launched.drafting is not None:
            proposals = self._collect_drafts(launched.drafting, ended)
        else:
            proposals = self._propose(launched, emitted, ended)
        draft_s = time.perf_counter() - start
        forward_s, sample_s, *drafting = launched.clock.spans()
        if drafting:  # drafted on the device: its time there, not the wait for it
            draft_s = drafting[0]
        return StepResult(
            {rid: tokens[-1] for rid, tokens in emitted.items()},
            {rid: lps[: len(emitted[rid])] for rid, lps in logprobs.items()},
            ended,
            prompt,
            accepted={rid: t[:-1] for rid, t in emitted.items() if len(t) > 1},
            proposals=proposals,
            timing=StepTiming(forward_s, sample_s, draft_s),
        )

    def resolve_inputs(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        host_ids: np.ndarray, owners: list[str],
    ) -> None:  # fmt: skip
        """Fill in, in the device tensors of a step, what the previous launch left on the
        device (``LeftBehind.resolve``); ``self._shift`` keeps how far rows moved back,
        for the drafter."""
        self._shift = self._previous.resolve(ids, positions, meta, host_ids, owners,
                                             self.block_size)  # fmt: skip

    def sample(self, plan: StepPlan) -> tuple[list[str], SampledTokens] | None:
        """Run the forward and sampling of a plan without drafts; returns the sampled
        requests and their tokens still on the device (None when no chunk samples). Only
        queues device work."""
        if plan.num_draft_tokens:
            raise ValueError("a plan with drafts is verified: use launch")
        with torch.inference_mode():
            logits, _ = self._logits(plan)
            sample_ids = [c.request_id for c in plan.chunks if c.sample]
            if not sample_ids:
                return None
            return sample_ids, self._sample_plain(logits, sample_ids)

    def _sample_plain(self, logits: torch.Tensor, sample_ids: list[str],
                      unresolved: frozenset[str] = frozenset()) -> SampledTokens:  # fmt: skip
        states = [self.states[rid] for rid in sample_ids]
        mask = build_mask([s.live_grammar for s in states], self.sampler.vocab_size)
        pending = self._pending(sample_ids, unresolved)
        return self.sampler.sample(logits, [s.row() for s in states], mask, pending)

    def _pending(self, request_ids: list[str], unresolved: frozenset[str],
                 before: list[list[int]] | None = None) -> PendingTokens | None:  # fmt: skip
        """The history only the device holds, for the rows of ``request_ids``
        (``LeftBehind.pending``); None when no row's sampling reads its history
        (penalties, min_tokens)."""
        if not any(self.states[rid].reads_history for rid in request_ids):
            return None
        return self._previous.pending(request_ids, unresolved, self._ids, before)

    def _sample_and_verify(self, launched: _Launched, logits: torch.Tensor) -> None:
        """Sample the plain chunks' rows and verify the drafts of the others (``logits``
        holds each sampling chunk's rows in turn), into ``launched``."""
        plain_ids, plain_rows, verify_ids, verify_rows, groups = [], [], [], [], []
        drafts: list[int] = []  # per verified row, the step's row of the draft it checks
        row = first = 0
        for chunk in launched.plan.chunks:
            first += chunk.num_tokens
            if not chunk.sample:
                continue
            if chunk.num_draft:
                verify_ids.append(chunk.request_id)
                groups.append(DraftGroup(len(verify_rows), self._host_drafts(chunk)
                                         if launched.deferred else chunk.draft_token_ids))
                verify_rows += range(row, row + chunk.num_sampled_rows)
                drafts += [*range(first - chunk.num_draft, first), -1]
            else:
                plain_ids.append(chunk.request_id)
                plain_rows.append(row)
            row += chunk.num_sampled_rows
        # sampled before the step before was collected: its tokens are on the device only
        unresolved = frozenset() if launched.deferred else launched.unresolved
        launched.plain_ids, launched.verify_ids = plain_ids, verify_ids
        if plain_ids:
            rows = logits if not verify_ids else logits[device_index(plain_rows, self.device)]
            launched.plain = self._sample_plain(rows, plain_ids, unresolved)
        if verify_ids:
            rows = logits if not plain_ids else logits[device_index(verify_rows, self.device)]
            launched.verified = self._verify(rows, verify_ids, groups, drafts, unresolved)

    def _host_drafts(self, chunk: ScheduledChunk) -> list[int]:
        """A chunk's drafts with those made on the device behind the step before (their
        placeholders) as the host collected them: the tokens its grammar's mask follows."""
        made = self._drafted.get(chunk.request_id, [])
        return [
            t if t >= 0 else made[draft_index(t)] if draft_index(t) < len(made) else 0
            for t in chunk.draft_token_ids
        ]

    def _verify(
        self, logits: torch.Tensor, request_ids: list[str], groups: list[DraftGroup],
        draft_rows: list[int], unresolved: frozenset[str] = frozenset(),
    ) -> VerifiedTokens:  # fmt: skip
        """``draft_rows``: per verified row, the step's row whose input token is the draft
        it checks (-1: a group's last row); the drafts are read there, on the device,
        where a draft made behind the step before is only known (the history of the rows
        after it too: ``_pending``)."""
        states = [self.states[rid] for rid in request_ids]
        rows = [row for s, g in zip(states, groups) for row in [s.row()] * g.num_rows]
        mask = build_draft_mask(
            [(s.live_grammar, g.draft_token_ids) for s, g in zip(states, groups)],
            self.sampler.vocab_size,
        )
        at = device_index(draft_rows, self.device)
        drafts = torch.where(at >= 0, self._ids[at.clamp(min=0)], -1)
        pending = None
        if any(s.reads_history for s in states):
            owners = [rid for rid, g in zip(request_ids, groups) for _ in range(g.num_rows)]
            before = [draft_rows[g.row : g.row + j] for g in groups for j in range(g.num_rows)]
            pending = self._pending(owners, unresolved, before)
        return self.sampler.verify(logits, rows, mask, groups, drafts, pending)

    def _logits(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the rows to sample or verify (each sampling chunk's in turn) and the
        step's hidden states (one row per token; None from a CUDA graph without them)."""
        chunks = one_token_rows(plan.chunks) or plan.chunks
        self._shift = None
        # a row at a time only where a request asks it: its prompt's logprobs, or positions
        # of its own (M-RoPE)
        states = [self.states[c.request_id] for c in plan.chunks]
        prompt_rows = ([self.states[c.request_id].prompt_rows(c) for c in chunks]
                       if any(s.wants_prompt_logprobs for s in states) else [])  # fmt: skip
        offsets = ([self.states[c.request_id].rope_offset(c.start_pos) for c in chunks]
                   if any(s.rope is not None for s in states) else [])  # fmt: skip
        if (self.graphs is not None and not any(prompt_rows) and None not in offsets
                and self.graphs.accepts(chunks)):  # fmt: skip
            logits = self.graphs.run(chunks, offsets if any(offsets) else None)
            self.num_forwards += 1
            hidden = self.graphs.hidden(len(chunks))
            self._ids = self.graphs.input_ids(len(chunks))
            if not any(c.sample for c in chunks):
                return torch.empty(0), hidden
            if all(c.sample for c in chunks):
                return logits[: len(chunks)], hidden
            rows = [i for i, c in enumerate(chunks) if c.sample]
            return logits[device_index(rows, self.device)], hidden
        inputs = self.prepare(StepPlan(chunks=chunks))
        self._ids = inputs.input_ids  # on the device, resolved
        pieces = self.pieces
        if (pieces is not None and inputs.spliced is None and inputs.positions.dim() == 1
                and pieces.accepts(inputs.input_ids.shape[0])):  # fmt: skip
            hidden = pieces.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            ctx = ForwardContext(inputs.meta, self.backend)
            with decode_rows(_decode_row_mask(chunks) if self.device.type == "cpu" else None):
                hidden = self.model(inputs.input_ids, inputs.positions, ctx, inputs.spliced)
        self.num_forwards += 1
        if any(prompt_rows):
            self._prompt_logprobs(chunks, prompt_rows, hidden)
        if not inputs.sample_ids:
            return torch.empty(0), hidden
        return self.model.compute_logits(hidden[inputs.sample_rows]), hidden

    def warm_up(self, steps: Sequence[Sequence[int]]) -> None:
        """Before serving: ``warm_up_forwards``, first as a dry run inside
        ``parallel_builds`` (the TileLang kernels these steps need that nothing built yet,
        all at once), then for real (library plans, workspaces, the allocator's pools)."""
        with parallel_builds():
            self.warm_up_forwards(steps)
        self.warm_up_forwards(steps)

    def warm_up_forwards(self, steps: Sequence[Sequence[int]]) -> None:
        """One forward for each step, a sequence of that many tokens for each of its
        lengths, then the logits of every sequence's last row, so that the first requests
        do not pay what a first use costs. The tokens are 0s over the null block (block 0,
        never handed out): no real block is touched."""
        with torch.inference_mode():
            for lengths in steps:
                chunks = [ScheduledChunk(f"warm-up-{i}", [0] * n, 0,
                                         [0] * -(-n // self.block_size), sample=True)
                          for i, n in enumerate(lengths)]  # fmt: skip
                inputs, _ = step_inputs(chunks, self.block_size, self.device)
                ctx = ForwardContext(inputs.meta, self.backend)
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)
                self.model.compute_logits(hidden[inputs.sample_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def idle_forward(self) -> None:
        """Run the model over no tokens: how a rank of an expert-parallel group with nothing
        to run takes part in its MoE layers' exchanges (``engine.ep.group``)."""
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.model(none, none, ForwardContext(AttentionMetadata.empty(self.device),
                                                  self.backend))  # fmt: skip
        self.num_forwards += 1

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], rows: list[range], hidden: torch.Tensor
    ) -> None:
        """Queue the logprobs of each chunk's prompt ``rows`` (positions) onto its state, from
        the step's hidden states (one row per token, chunks in order)."""
        first_row = 0
        for chunk, positions in zip(chunks, rows):
            state = self.states[chunk.request_id]
            prompt = state.new.prompt_token_ids
            for start in range(positions.start, positions.stop, PROMPT_LOGPROB_ROWS):
                stop = min(start + PROMPT_LOGPROB_ROWS, positions.stop)
                at = first_row + start - chunk.start_pos
                logits = self.model.compute_logits(hidden[at : at + stop - start])
                following = np.array(prompt[start + 1 : stop + 1], np.int64)
                targets = host_to_device(following, self.device)
                k = state.new.sampling.prompt_logprobs or 0
                state.add_prompt_part(start, self.sampler.prompt_logprobs(logits, targets, k))
            first_row += chunk.num_tokens

    def _advance(self, request_ids: list[str], tokens: list[int]) -> frozenset[str]:
        """Record one sampled token per request; returns the requests whose grammar it
        completed."""
        return self._record({rid: [t] for rid, t in zip(request_ids, tokens)})

    def _record(self, emitted: dict[str, list[int]]) -> frozenset[str]:
        """Record each request's tokens in order; returns the requests whose grammar they
        completed (their list is cut after the token that completed it)."""
        ended = set()
        for rid, tokens in emitted.items():
            state = self.states.get(rid)
            if state is None:  # it ended while this step ran (overlap): the tokens are moot
                continue
            for i, token in enumerate(tokens):
                state.output_token_ids.append(token)
                if state.grammar is None:
                    continue
                if not state.grammar.accept(token):
                    log.error("request %s: token %d breaks its grammar; ending it", rid, token)
                elif not state.grammar.is_terminated:
                    continue
                ended.add(rid)
                del tokens[i + 1 :]
                break
        return frozenset(ended)

    def _drafts_behind(self, launched: _Launched) -> bool:
        """Whether the drafter works after this step: it proposes then, or it must see
        every step (a model drafter writes the KV of its tokens). Not while it rests: the
        step then costs what a step without speculation costs."""
        assert self.drafter is not None
        return launched.plan.propose or self.drafter.sees_every_step

    def _propose(
        self, launched: _Launched, emitted: dict[str, list[int]], ended: frozenset[str]
    ) -> dict[str, Proposal]:
        """The drafter's proposals for the requests that sampled and go on, each cut where
        its grammar would reject a draft."""
        if self.drafter is None or not self._drafts_behind(launched):
            return {}
        chunks = launched.plan.chunks
        num_real, token_ids, requests = [], [], []
        for chunk in chunks:
            state = self.states.get(chunk.request_id)
            tokens = emitted.get(chunk.request_id)
            token_ids.append(state.token_ids() if state is not None else chunk.token_ids)
            if not chunk.sample or tokens is None:
                num_real.append(chunk.num_tokens - chunk.num_draft)
                continue
            num_real.append(chunk.num_tokens - chunk.num_draft + len(tokens) - 1)
            if state is None or chunk.request_id in ended:
                continue
            sp = state.new.sampling
            room = self._room(state)
            if self.proposes and launched.plan.propose and sp.speculative and room > 0:
                requests.append(DraftRequest(chunk.request_id, token_ids[-1],
                                             chunk.block_ids, room))  # fmt: skip
        step = DraftStep(chunks, num_real, token_ids, requests, launched.hidden)
        with torch.inference_mode():
            proposals = self.drafter.propose(step)
        return self._within_grammars(proposals)

    def _within_grammars(self, proposals: dict[str, Proposal]) -> dict[str, Proposal]:
        """The proposals with drafts, each cut where its request's grammar would reject
        one."""
        out = {}
        for rid, proposal in proposals.items():
            grammar = self.states[rid].grammar
            if grammar is not None:
                valid = grammar.valid_prefix(proposal.token_ids)
                proposal = Proposal(proposal.start, proposal.token_ids[:valid],
                                    proposal.confidence[:valid])  # fmt: skip
            if proposal.token_ids:
                out[rid] = proposal
        return out

    def _room(self, state: _RowState) -> int:
        """Drafts a request may verify after its tokens so far: all kept, plus the token
        sampled after them, stay within its max_tokens."""
        assert self.drafter is not None
        left = state.new.sampling.max_tokens - len(state.output_token_ids) - 1
        return min(self.drafter.max_draft, left)

    def _launch_drafts(self, launched: _Launched) -> Drafting:
        """Queue an ``on_device`` drafter's drafts behind the step (``LaunchStep``): every
        sampling chunk's request that may verify drafts next drafts, as far as its room
        allows before this step's tokens (the proposal is cut to the room they leave) and
        no deeper than ``draft_depth`` of the drafts it verifies in this step."""
        assert self.drafter is not None
        plan, chunks = launched.plan, launched.plan.chunks
        next_ids = np.zeros(sum(c.num_tokens for c in chunks), dtype=np.int64)
        sampled_rows: list[int] = []  # the plain chunks' last rows, then the verified rows
        verified_rows: list[int] = []
        requests, last_rows, num_draft, bounds, group_of = [], [], [], [], []
        groups = {rid: g for g, rid in enumerate(launched.verify_ids)}
        first = 0
        for chunk in chunks:
            n, state = chunk.num_tokens, self.states.get(chunk.request_id)
            next_ids[first : first + n - 1] = chunk.token_ids[1:]
            last = first + n - 1 - chunk.num_draft  # the chunk's input token's row
            if not chunk.sample:
                known = state.token_ids() if state is not None else []
                next_ids[first + n - 1] = known[chunk.end_pos] if chunk.end_pos < len(known) else 0
            elif chunk.num_draft:
                verified_rows += range(last, first + n)
            else:
                sampled_rows.append(last)
            room = self._room(state) if chunk.sample and state is not None else 0
            room = min(room, draft_depth(chunk.num_draft, self.drafter.max_draft))
            if room > 0 and self.proposes and plan.propose and state.new.sampling.speculative:
                requests.append(DraftRequest(chunk.request_id, (), chunk.block_ids, room))
                last_rows.append(last)
                num_draft.append(chunk.num_draft)
                bounds.append(chunk.end_pos)
                group_of.append(groups.get(chunk.request_id, len(groups)))  # past: none
            first += n
        verified = launched.verified
        ids, sampled, verified_at, inputs, num_draft, group = device_indices(
            self.device, np.maximum(next_ids, 0), sampled_rows, verified_rows, last_rows,
            num_draft, group_of)  # fmt: skip
        if launched.plain is not None:
            ids[sampled] = launched.plain.tokens  # UNRESOLVED: from the device
        if verified is not None:
            ids[verified_at] = verified.tokens
            kept = torch.cat((verified.kept, verified.kept.new_zeros(1)))[group]  # past: 0
        else:
            kept = torch.zeros_like(num_draft)
        back = num_draft - kept  # each one's input token's row is ``inputs``
        if self._shift is not None and requests:  # moved back by the step before's rejects
            back += self._shift[inputs]
        step = LaunchStep(chunks, launched.hidden, ids, requests, inputs + kept, back, bounds,
                          self._shift, self._ids, self._context)  # fmt: skip
        return self.drafter.launch(step)

    def _context(self, request_id: str) -> list[int]:
        """The request's tokens as the host knows them (prompt and outputs recorded)."""
        return self.states[request_id].token_ids()

    def _collect_drafts(self, drafting: Drafting, ended: frozenset[str]) -> dict[str, Proposal]:
        """The proposals of drafts made on the device, for the requests that go on, each
        cut to the room its tokens left it and where its grammar would reject a draft."""
        proposals = {}
        drafted = drafting.to_host()
        self._drafted = {rid: tokens for rid, (tokens, _) in drafted.items()}
        for rid, (tokens, conf) in drafted.items():
            state = self.states.get(rid)
            if state is None or rid in ended:
                continue
            room = self._room(state)
            if room > 0:
                proposals[rid] = Proposal(len(state.token_ids()), tokens[:room], conf[:room])
        return self._within_grammars(proposals)

    def _sync_states(self, plan: StepPlan) -> None:
        for rid in plan.finished_ids:
            self.states.pop(rid, None)
            if self.drafter is not None:
                self.drafter.drop(rid)
        if self.drafter is not None:
            for rid in plan.preempted_ids:
                self.drafter.reset(rid)
            for new in plan.new_requests:
                self.drafter.add(new)
        for new in plan.new_requests:
            generator = None
            if new.sampling.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(new.sampling.seed)
            outputs = list(new.output_token_ids)
            grammar = None if new.grammar is None else GrammarState.resume(new.grammar, outputs)
            state = _RowState(new, generator, outputs, grammar, prompt_sent=bool(outputs))
            if new.media:
                state.rope = self.model.rope_table(len(new.prompt_token_ids), new.media)
            if new.sampling.repetition_penalty != 1.0:
                state.prompt_ids = distinct_ids(new.prompt_token_ids, self.device)
            self.states[new.request_id] = state

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's tensors; UNRESOLVED input tokens come from the previous launch. A
        model whose rotary positions are not the token indices (M-RoPE past an image) gets
        its own, and image tokens their embeddings."""
        chunks = plan.chunks
        positions = self._rope_positions(chunks)
        inputs, host_ids = step_inputs(chunks, self.block_size, self.device, positions)
        owners = [c.request_id for c in chunks for _ in range(c.num_tokens)]
        self.resolve_inputs(inputs.input_ids, inputs.positions, inputs.meta, host_ids, owners)
        spliced = self._spliced(chunks)
        return inputs if spliced is None else replace(inputs, spliced=spliced)

    def _rope_positions(self, chunks: list[ScheduledChunk]) -> np.ndarray | None:
        """The model's positions for the step's tokens where they are not their token
        indices (None): [T] when every token sits at its index + an offset, else
        [streams, T]."""
        states = [self.states[c.request_id] for c in chunks]
        if all(s.rope is None for s in states):
            return None  # text only: every offset 0
        offsets = [s.rope_offset(c.start_pos) for s, c in zip(states, chunks)]
        if None not in offsets:
            if not any(offsets):
                return None
            index = np.concatenate([np.arange(c.start_pos, c.end_pos) for c in chunks])
            lengths = [c.num_tokens for c in chunks]
            return index + np.repeat(np.array(offsets, dtype=np.int64), lengths)
        streams = next(s.rope.prompt.shape[0] for s in states if s.rope is not None)
        parts = []
        for state, c in zip(states, chunks):
            if state.rope is not None:
                parts.append(state.rope.positions(c.start_pos, c.end_pos))
            else:
                diagonal = np.arange(c.start_pos, c.end_pos)
                parts.append(np.broadcast_to(diagonal, (streams, c.num_tokens)))
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.int64)

    def _spliced(self, chunks: list[ScheduledChunk]) -> Spliced | None:
        """The image embeddings of the step's placeholder tokens, at their rows."""
        rows, values = [], []
        base = 0
        for c in chunks:
            media = self.states[c.request_id].new.media
            wanted = [(i, m) for i, m in enumerate(media)
                      if m.offset < c.end_pos and m.end > c.start_pos]  # fmt: skip
            if wanted:
                embeds = self.embeddings(c.request_id)
                if embeds is None:
                    raise RuntimeError(f"request {c.request_id}: its image tokens are to be "
                                       "computed here, but this engine has no embeddings")
                for i, m in wanted:
                    first, last = max(m.offset, c.start_pos), min(m.end, c.end_pos)
                    rows.append(np.arange(first, last) - c.start_pos + base)
                    values.append(embeds[i][first - m.offset : last - m.offset])
            base += c.num_tokens
        if not rows:
            return None
        index = host_to_device(np.concatenate(rows).astype(np.int64), self.device)
        return Spliced(index, torch.cat(values).to(self.device))


def step_inputs(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device,
    rope_positions: np.ndarray | None = None,
) -> tuple[StepInputs, np.ndarray]:  # fmt: skip
    """The tensors of a forward over ``chunks`` (each a sequence's next tokens over its
    block table): ids, positions (the token indices, or ``rope_positions`` where the model
    places tokens otherwise), attention metadata, and the rows to sample (each sampling
    chunk's last ``num_sampled_rows``); also the ids as a host array.

    Built a chunk at a time, not a row at a time (a verify step has a row per draft), and
    copied to the device in two copies, one per dtype."""
    n, bs = len(chunks), block_size
    query_lens = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
    starts = np.fromiter((c.start_pos for c in chunks), np.int64, n)
    seq_lens = starts + query_lens
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    owner = np.repeat(np.arange(n), query_lens)
    rows = np.arange(cu[-1])
    positions = rows - cu[owner] + starts[owner]
    tables = padded_tables([c.block_ids for c in chunks])
    slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
    sampled = np.fromiter((c.num_sampled_rows for c in chunks), np.int64, n)
    sample_rows = np.flatnonzero(cu[owner + 1] - rows <= sampled[owner])
    input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks),
                            np.int64, int(cu[-1]))  # fmt: skip
    ids, pos, slot_mapping, sample_at = device_arrays(
        device, np.int64, input_ids, positions if rope_positions is None else rope_positions,
        slots, sample_rows)  # fmt: skip
    query_start, lengths, block_tables = device_arrays(device, np.int32, cu, seq_lens, tables)
    meta = AttentionMetadata(
        query_start_loc=query_start,
        seq_lens=lengths,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    inputs = StepInputs(
        input_ids=ids,
        positions=pos,
        meta=meta,
        sample_rows=sample_at,
        sample_ids=[c.request_id for c in chunks if c.sample],
    )
    return inputs, input_ids


def _decode_row_mask(chunks: list[ScheduledChunk]) -> torch.Tensor | bool | None:
    """Which of the step's token rows are decode rows (a chunk of one token plus its
    drafts): True for all, None for none, else one bool per row (``quant.decode_rows``:
    they take the same arithmetic whatever shares their step)."""
    kinds = [c.is_decode for c in chunks]
    if all(kinds):
        return True
    if not any(kinds):
        return None
    return torch.tensor([k for c, k in zip(chunks, kinds) for _ in range(c.num_tokens)])


