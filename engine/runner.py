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

Images (``NewRequest.media``): a chunk that covers an image's placeholder tokens takes
their embeddings from ``embeddings(request_id)`` (one tensor per image, in order) and
hands them to the model as ``Spliced`` rows; a model whose ``rope_table`` places a
prompt's tokens off their indices (M-RoPE) gets positions ``[streams, T]`` for a step
that holds such tokens, and ``index + delta`` ([T]) for one whose tokens all lie past
the last image (decode steps, so their CUDA graphs serve those requests too). Positions
depend only on the request and the token index, so prefix hits, chunking, preemption and
a request that arrives with its KV computed elsewhere need nothing special.

Decode-only steps replay a CUDA graph when ``capture_decode_graphs`` has run
(``engine.cuda_graphs``); other steps run eagerly. Either way the step's forward and its
sampling only queue device work: inputs go over from pinned memory without waiting, and
the copy of the sampled tokens back to the host at the end of ``execute`` is the step's
one synchronisation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from engine.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from engine.messages import TokenLogprob
from engine.models.base import CausalLM, RopeTable, Spliced
from engine.plan import NewRequest, ScheduledChunk, StepPlan, StepResult
from engine.request import UNRESOLVED
from engine.sampler import PromptLogprobs, SampledTokens, Sampler, SamplingRow
from engine.structured import GrammarState, build_mask

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
        return SamplingRow(
            params=self.new.sampling,
            generator=self.generator,
            prompt_token_ids=self.new.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            eos_token_ids=self.new.eos_token_ids,
        )


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor  # [T], or [streams, T] when some token has its own (M-RoPE)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the step's tokens whose logits are sampled
    sample_ids: list[str]
    spliced: Spliced | None = None  # image embeddings in place of their tokens' embeddings


Embeddings = Callable[[str], "list[torch.Tensor] | None"]


class ModelRunner:
    """``embeddings(request_id)``: the embeddings of a request's images, one tensor
    [tokens, hidden] per image (None when this engine has none for it)."""

    def __init__(
        self, model: CausalLM, backend: AttentionBackend, sampler: Sampler, block_size: int,
        embeddings: Embeddings | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.embeddings = embeddings or (lambda request_id: None)
        self.device = next(model.parameters()).device
        self.states: dict[str, _RowState] = {}
        self.graphs: DecodeGraphs | None = None

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

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> tuple[list[str], SampledTokens] | None:
        """Queue the plan's forward and sampling on the device; ``finish`` waits for the
        tokens. An UNRESOLVED input token is the one the previous launch sampled for its
        request: it goes from that step's output to this step's input on the device."""
        self._sync_states(plan)
        if plan.is_empty:
            return None
        sampled = self.sample(plan)
        if sampled is not None:
            sample_ids, tokens = sampled
            self._last = ({rid: i for i, rid in enumerate(sample_ids)}, tokens.tokens)
            tokens.start_copy()
        return sampled

    def finish(self, launched: tuple[list[str], SampledTokens] | None) -> StepResult:
        if launched is None:
            return StepResult({})
        sample_ids, tokens = launched
        out = tokens.to_host()  # the step's one device-to-host copy: waits for the step
        prompt = {
            rid: state.take_prompt_logprobs()
            for rid in sample_ids
            if (state := self.states.get(rid)) is not None and state.wants_prompt_logprobs
        }
        ended = self._advance(sample_ids, out.token_ids)
        logprobs = {rid: lp for rid, lp in zip(sample_ids, out.logprobs) if lp is not None}
        return StepResult(dict(zip(sample_ids, out.token_ids)), logprobs, ended, prompt)

    def resolve_inputs(self, ids: torch.Tensor, host_ids: np.ndarray, owners: list[str]) -> None:
        """Replace, in the device tensor ``ids`` (a copy of ``host_ids``), every
        UNRESOLVED token by the token the previous launch sampled for its owner
        (``owners[i]``: the request of ``host_ids[i]``)."""
        where = np.flatnonzero(host_ids[: len(owners)] == UNRESOLVED)
        if not len(where):
            return
        rows, previous = self._last
        index = np.array([rows[owners[i]] for i in where], dtype=np.int64)
        ids[_to_device(where.astype(np.int64), self.device)] = previous[
            _to_device(index, self.device)
        ]

    def sample(self, plan: StepPlan) -> tuple[list[str], SampledTokens] | None:
        """Run the plan's forward and sampling; returns the sampled requests and their
        tokens still on the device (None when no chunk samples). Only queues device work."""
        with torch.inference_mode():
            logits, sample_ids = self._logits(plan)
            if not sample_ids:
                return None
            states = [self.states[rid] for rid in sample_ids]
            mask = build_mask([s.grammar for s in states], self.sampler.vocab_size)
            return sample_ids, self.sampler.sample(logits, [s.row() for s in states], mask)

    def _logits(self, plan: StepPlan) -> tuple[torch.Tensor, list[str]]:
        """Logits of the rows to sample and their request ids."""
        chunks = plan.chunks
        sample_ids = [c.request_id for c in chunks if c.sample]
        prompt_rows = [self.states[c.request_id].prompt_rows(c) for c in chunks]
        offsets = [self.states[c.request_id].rope_offset(c.start_pos) for c in chunks]
        if (self.graphs is not None and self.graphs.accepts(chunks) and not any(prompt_rows)
                and None not in offsets):  # fmt: skip
            if not sample_ids:
                return torch.empty(0), []
            logits = self.graphs.run(chunks, offsets if any(offsets) else None)
            if len(sample_ids) == len(chunks):
                return logits[: len(chunks)], sample_ids
            rows = [i for i, c in enumerate(chunks) if c.sample]
            return logits[_to_device(np.array(rows, dtype=np.int64), self.device)], sample_ids
        inputs = self.prepare(plan)
        ctx = ForwardContext(inputs.meta, self.backend)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx, inputs.spliced)
        if any(prompt_rows):
            self._prompt_logprobs(chunks, prompt_rows, hidden)
        if not inputs.sample_ids:
            return torch.empty(0), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sample_ids

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
                targets = _to_device(np.array(prompt[start + 1 : stop + 1], np.int64), self.device)
                k = state.new.sampling.prompt_logprobs or 0
                state.add_prompt_part(start, self.sampler.prompt_logprobs(logits, targets, k))
            first_row += chunk.num_tokens

    def _advance(self, request_ids: list[str], tokens: list[int]) -> frozenset[str]:
        """Record each sampled token; returns the requests whose grammar it completed."""
        ended = set()
        for rid, token in zip(request_ids, tokens):
            state = self.states.get(rid)
            if state is None:  # it ended while this step ran (overlap): the token is moot
                continue
            state.output_token_ids.append(token)
            if state.grammar is None:
                continue
            if not state.grammar.accept(token):
                log.error("request %s: sampled token %d breaks its grammar; ending it", rid, token)
                ended.add(rid)
            elif state.grammar.is_terminated:
                ended.add(rid)
        return frozenset(ended)

    def _sync_states(self, plan: StepPlan) -> None:
        for rid in plan.finished_ids:
            self.states.pop(rid, None)
        for new in plan.new_requests:
            generator = None
            if new.sampling.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(new.sampling.seed)
            outputs = list(new.output_token_ids)
            grammar = None if new.grammar is None else GrammarState.resume(new.grammar, outputs)
            state = _RowState(new, generator, outputs, grammar, prompt_sent=bool(outputs))
            if new.media:
                state.rope = self.model.rope_table(len(new.prompt_token_ids), new.media)
            self.states[new.request_id] = state

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs = self.block_size
        chunks = plan.chunks
        query_lens = [c.num_tokens for c in chunks]
        seq_lens = [c.end_pos for c in chunks]
        positions = np.concatenate([np.arange(c.start_pos, c.end_pos) for c in chunks])
        max_blocks = max(len(c.block_ids) for c in chunks)
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_ids)] = c.block_ids
        owner = np.repeat(np.arange(len(chunks)), query_lens)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        cu = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=_to_device(cu, dev),
            seq_lens=_to_device(np.array(seq_lens, dtype=np.int32), dev),
            block_tables=_to_device(tables, dev),
            slot_mapping=_to_device(slots, dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64)
        device_ids = _to_device(input_ids, dev)
        if (input_ids == UNRESOLVED).any():
            owners = [c.request_id for c in chunks for _ in range(c.num_tokens)]
            self.resolve_inputs(device_ids, input_ids, owners)
        return StepInputs(
            input_ids=device_ids,
            positions=_to_device(self._rope_positions(chunks, positions), dev),
            meta=meta,
            sample_rows=_to_device(cu[1:][sampled].astype(np.int64) - 1, dev),
            sample_ids=[chunks[i].request_id for i in sampled],
            spliced=self._spliced(chunks),
        )

    def _rope_positions(self, chunks: list[ScheduledChunk], index: np.ndarray) -> np.ndarray:
        """The model's positions for the step's tokens (``index``: their token indices):
        [T] when every token sits at its index + an offset, else [streams, T]."""
        states = [self.states[c.request_id] for c in chunks]
        offsets = [s.rope_offset(c.start_pos) for s, c in zip(states, chunks)]
        if None not in offsets:
            if not any(offsets):
                return index.astype(np.int64)
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
        index = _to_device(np.concatenate(rows).astype(np.int64), self.device)
        return Spliced(index, torch.cat(values).to(self.device))


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``; to CUDA from pinned memory, without waiting."""
    tensor = torch.from_numpy(host)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
