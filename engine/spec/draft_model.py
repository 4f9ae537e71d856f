"""A draft model: a small model with the target's tokenizer proposes the next tokens.

The draft model (any model ``engine.loader`` loads: SmolLM2-135M drafting for a larger
Llama-family target, say) keeps its KV in a cache of its own with the target's block
count and block size, indexed by the target's block tables: a request's draft KV for
position p sits in the same slot as its target KV. So it needs no allocator of its own:
the scheduler keeps ``kv_lookahead`` (K) slots past each step's tokens for the drafts it
feeds itself.

Per request it remembers how many leading positions of its KV are right (``valid``).
After each step it runs, in one forward for every request of the step, the tokens from
there to the last known one (a prefill chunk's tokens; a decode's sampled token, and the
kept drafts it had not fed itself), then, for the requests that go on, drafts K tokens
one forward at a time (``engine.spec.chain``). A kept draft's KV was written when it was
fed back, so the next step usually runs one token per request. A preempted request, and a
prefix that came from the cache, a tier or another worker, is recomputed from 0: the
draft KV in shared blocks is not trusted (rewriting it with the same tokens is harmless).
Confidence: the draft model's probability of its token at the position's calibration
temperature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import build_backend
from engine.attention.base import ForwardContext
from engine.config import SpeculativeConfig
from engine.plan import NewRequest, ScheduledChunk
from engine.spec.base import Drafter, DraftStep, Proposal
from engine.spec.chain import ChainStart, chain
from kvstore.layout import KVCache

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from engine.models.base import CausalLM


class DraftModelDrafter(Drafter):
    name = "draft"

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
        self._valid: dict[str, int] = {}  # request -> leading positions whose KV is right
        self._fed: dict[str, int] = {}  # request -> drafts fed back at the last proposal
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
        self._valid[new.request_id] = 0

    def drop(self, request_id: str) -> None:
        self._valid.pop(request_id, None)
        self._fed.pop(request_id, None)

    def reset(self, request_id: str) -> None:
        self._valid[request_id] = 0

    def observe(self, request_id: str, num_verified: int, num_kept: int) -> None:
        if request_id in self._valid:  # the kept drafts it fed itself hold the right KV
            self._valid[request_id] += min(num_kept, self._fed.get(request_id, 0))

    def propose(self, step: DraftStep) -> dict[str, Proposal]:
        proposing = {r.request_id: r for r in step.requests}
        catch_up: list[ScheduledChunk] = []
        starts: list[tuple[str, int, int]] = []  # (request, last row, its position)
        for i, chunk in enumerate(step.chunks):
            rid = chunk.request_id
            if rid not in self._valid:
                continue
            self._fed[rid] = 0
            known = step.token_ids[i]
            end = chunk.start_pos + step.num_real[i]  # positions before it are computed
            if rid in proposing:
                end += 1  # and the token just sampled is known
            end = min(end, len(known), len(chunk.block_ids) * self.block_size)
            begin = self._valid[rid]
            if end <= begin:
                continue
            catch_up.append(ScheduledChunk(rid, list(known[begin:end]), begin,
                                           chunk.block_ids, rid in proposing))  # fmt: skip
            self._valid[rid] = end
        if not catch_up:
            return {}
        logits = self._forward(catch_up)
        row = 0
        for c in catch_up:
            if c.sample:
                starts.append((c.request_id, row, c.end_pos))
                row += 1
        chain_starts = [
            ChainStart(row, pos, proposing[rid].num_draft,
                       min(len(proposing[rid].block_ids) * self.block_size, self._max_len))
            for rid, row, pos in starts
        ]  # fmt: skip
        ids = [rid for rid, _, _ in starts]
        tables = {rid: proposing[rid].block_ids for rid in ids}

        def forward(active: list[int], tokens: torch.Tensor, positions: list[int]):
            chunks = [  # the token ids are the device's (``tokens``)
                ScheduledChunk(ids[a], [0], p, tables[ids[a]], True)
                for a, p in zip(active, positions)
            ]
            for a in active:
                self._fed[ids[a]] += 1
            return self._forward(chunks, tokens)

        drafted = chain(self.config, logits, chain_starts, forward, self.model.config.vocab_size)
        out = {}
        for rid, (tokens, conf) in zip(ids, drafted):
            out[rid] = Proposal(len(proposing[rid].token_ids), tokens, conf)
        return out

    def _forward(self, chunks: list[ScheduledChunk],
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The draft model over ``chunks`` (their token ids, or ``token_ids`` on the
        device); logits of their sampled rows."""
        from engine.runner import step_inputs

        inputs, _ = step_inputs(chunks, self.block_size, self.device)
        ctx = ForwardContext(inputs.meta, self.backend)
        ids = inputs.input_ids if token_ids is None else token_ids
        hidden = self.model(ids, inputs.positions, ctx)
        return self.model.compute_logits(hidden[inputs.sample_rows])
