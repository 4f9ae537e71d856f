"""A draft model: a small model with the target's tokenizer proposes the next tokens.

The draft model (any model ``engine.loader`` loads: SmolLM2-135M drafting for a larger
Llama-family target, say) keeps its KV in a cache of its own with the target's block
count and block size, indexed by the target's block tables: a request's draft KV for
position p sits in the same slot as its target KV. So it needs no allocator of its own:
the scheduler keeps ``kv_lookahead`` (K) slots past each step's tokens for the drafts it
feeds itself.

It drafts on the device (``Drafter.on_device``), right behind each step, before anything
is read back. In one forward it runs the step's rows with the step's own input tokens as
the device has them (a prefill chunk's tokens; a decode or verify chunk's input token and
drafts), at their positions (moved back on the device where the step was planned before
the one before it was known: ``LaunchStep.shift``). Rows past a verify chunk's kept drafts
write KV at positions that the next step writes again before anything attends to them.
Then, for the requests that go on, it feeds the token sampled after the kept drafts at
its position, and drafts K tokens one forward at a time from there (``engine.spec.chain``).
A request it has not seen yet, or one preempted since, first runs its whole context up to
its chunk from the host's tokens: a prefix that came from the cache, a tier or another
worker carries no draft KV to trust (rewriting it with the same tokens is harmless).
Its forwards over one-token rows (a decode or verify step's rows, each chained draft)
replay CUDA graphs by bucket of rows (``engine.spec.graphs``), as the MTP layer's do.
Confidence: the draft model's probability of its token at the position's calibration
temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import build_backend
from engine.attention.base import (
    AttentionMetadata,
    ForwardContext,
    device_index,
    padded_tables,
)
from engine.config import SpeculativeConfig
from engine.plan import NewRequest, ScheduledChunk
from engine.spec.base import Drafting, LaunchStep
from engine.spec.chain import Chained, ChainStart, launch_chain
from engine.spec.graphs import RowsDrafter
from kvstore.layout import KVCache

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from engine.models.base import CausalLM


class DraftModelDrafter(RowsDrafter):
    name = "draft"
    on_device = True
    takes_hidden = False

    def __init__(
        self, config: SpeculativeConfig, model: CausalLM, device: str, block_size: int
    ) -> None:
        super().__init__(config.max_draft)
        self.config = config
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_lookahead = config.max_draft
        self.cache: KVCache | None = None
        self._fresh: set[str] = set()  # requests whose draft KV is not there yet
        self._max_len = model.config.max_position_embeddings

    @classmethod
    def load(
        cls, config: SpeculativeConfig, target: LoadedModel, device: str, dtype: torch.dtype
    ) -> DraftModelDrafter:
        """Load ``config.draft_model`` beside ``target``; refuse one whose vocabulary is
        not the target's."""
        from engine.config import EngineConfig
        from engine.loader import load_model, resolve_cpu_weights

        weights = resolve_cpu_weights(EngineConfig(model=config.draft_model, device=device))
        draft = load_model(config.draft_model, device, dtype, progress=False, weights=weights)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft model {config.draft_model!r} has {draft.config.vocab_size} tokens, "
                f"the target {target.config.vocab_size}: it needs the target's tokenizer"
            )
        return cls(config, draft.model, device, 0)

    def kv_bytes_per_block(self, block_size: int) -> int:
        param = next(self.model.parameters())
        return self.model.kv_layout(block_size, param.dtype).bytes_per_block

    def bind(self, cache: KVCache, num_blocks: int, max_model_len: int) -> None:
        self.block_size = cache.layout.block_size
        param = next(self.model.parameters())
        layout = self.model.kv_layout(self.block_size, param.dtype)
        self.cache = KVCache(layout, num_blocks, self.device)
        cfg = self.model.config
        self.backend = build_backend(self.cache, cfg, self.model.attention_scale, str(self.device))
        self._max_len = min(self._max_len, max_model_len)

    def add(self, new: NewRequest) -> None:
        self._fresh.add(new.request_id)

    def drop(self, request_id: str) -> None:
        self._fresh.discard(request_id)

    def reset(self, request_id: str) -> None:
        self._fresh.add(request_id)

    def launch(self, step: LaunchStep) -> Drafting:
        from engine.runner import step_inputs

        fresh = {c.request_id for c in step.chunks} & self._fresh
        if fresh:  # the whole context up to the chunk's end, from the host's tokens
            whole = [ScheduledChunk(c.request_id, list(step.context(c.request_id)[: c.end_pos]),
                                    0, c.block_ids, False)
                     for c in step.chunks if c.request_id in fresh]  # fmt: skip
            inputs, _ = step_inputs(whole, self.block_size, self.device)
            self._layer(inputs.input_ids, inputs.positions, inputs.meta)
            self._fresh -= fresh
        others, rows = step.rows_of(lambda c: c.request_id not in fresh)
        if others:  # the step's rows, with its input tokens
            index = device_index(rows, self.device)
            ids = step.input_ids[index]
            if not all(c.is_decode for c in others):
                positions, meta = step.chunk_rows(others, self.block_size, index)
                self._layer(ids, positions, meta)
            else:  # decode rows: one token a row, positions on the device
                positions, tables, planned = step.token_rows(others, index)
                self._rows(ids, positions, None, tables, planned)
        if not step.requests:
            return Drafting([], Chained(0, []))
        tables = padded_tables([r.block_ids for r in step.requests])
        bounds = list(step.bounds)

        def one_token(active: list[int], tokens: torch.Tensor, at: list[int]) -> torch.Tensor:
            _, positions = step.placed(active, at)  # where they really go
            return self.model.compute_logits(self._rows(tokens, positions, None, tables[active],
                                                        at))  # fmt: skip

        everyone = list(range(len(bounds)))  # the token after each one's kept drafts
        logits = one_token(everyone, step.next_ids[step.last_rows], bounds)
        starts = [
            ChainStart(j, bound + 1, r.num_draft,
                       min(len(r.block_ids) * self.block_size, self._max_len))
            for j, (r, bound) in enumerate(zip(step.requests, bounds))
        ]  # fmt: skip
        chained = launch_chain(self.config, logits, starts, one_token,
                               self.model.config.vocab_size)  # fmt: skip
        chained.start_copy()
        return Drafting([r.request_id for r in step.requests], chained)

    def _layer(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Its final hidden states at each row (it takes no hidden states in)."""
        return self.model(ids, positions, ForwardContext(meta, self.backend))
