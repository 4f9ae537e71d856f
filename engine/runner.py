"""Executes a StepPlan: builds the step's tensors, runs the model, samples.

The runner keeps, per request, only what sampling needs (params, generator, tokens
so far, the grammar matcher of a structured request); everything about *which* tokens
run and where their KV goes comes in the plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from engine.models.base import CausalLM
from engine.plan import NewRequest, StepPlan, StepResult
from engine.sampler import Sampler, SamplingRow
from engine.structured import GrammarState, build_mask

log = logging.getLogger("ferry.runner")


@dataclass
class _RowState:
    new: NewRequest
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None

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
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the step's tokens whose logits are sampled
    sample_ids: list[str]


class ModelRunner:
    def __init__(
        self, model: CausalLM, backend: AttentionBackend, sampler: Sampler, block_size: int
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.states: dict[str, _RowState] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        self._sync_states(plan)
        if plan.is_empty:
            return StepResult({})
        inputs = self.prepare(plan)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, self.backend)
            )
            if not inputs.sample_ids:
                return StepResult({})
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            states = [self.states[rid] for rid in inputs.sample_ids]
            mask = build_mask([s.grammar for s in states], self.sampler.vocab_size)
            out = self.sampler(logits, [s.row() for s in states], mask)
        ended = self._advance(inputs.sample_ids, out.token_ids)
        logprobs = {rid: lp for rid, lp in zip(inputs.sample_ids, out.logprobs) if lp is not None}
        return StepResult(dict(zip(inputs.sample_ids, out.token_ids)), logprobs, ended)

    def _advance(self, request_ids: list[str], tokens: list[int]) -> frozenset[str]:
        """Record each sampled token; returns the requests whose grammar it completed."""
        ended = set()
        for rid, token in zip(request_ids, tokens):
            state = self.states[rid]
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
            self.states[new.request_id] = _RowState(new, generator, outputs, grammar)

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
            query_start_loc=torch.from_numpy(cu).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        return StepInputs(
            input_ids=input_ids.to(dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            sample_rows=torch.from_numpy(cu[1:][sampled].astype(np.int64) - 1).to(dev),
            sample_ids=[chunks[i].request_id for i in sampled],
        )
