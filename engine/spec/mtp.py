"""DeepSeek-V3's multi-token prediction layer as the drafter, chained for up to K tokens.

``model.mtp[0]`` (``MultiTokenPredictor``) at position p takes the target's final hidden
state ``h_p`` and the embedding of the token at p + 1, and predicts the token at p + 2.
Its attention has a KV layer of its own (one more MLA latent per token), which the engine
adds to the target's KV cache (``kv_layers``): it lives in the request's blocks, so prefix
caching, the KV tiers and a prefill worker's transfer to a decode worker carry it with
the target's layers (a prefill worker runs this pass without drafting, so the decode
worker's MTP attends over the prompt's latents).

It drafts on the device (``Drafter.on_device``): right behind each step's forward and
verification, before anything is read back, one pass of the layer runs over every row of
the step, with the target's hidden states of those rows and the token that follows each
as the device has it (sampled and verified tokens included). That writes the layer's KV
of those positions with what the target computed; the rows past a verify chunk's kept
drafts write KV at positions the next step writes again before anything attends to them.
For the requests that go on, the pass's output at the last real row (found on the device
from the kept count) gives the first draft; each next draft feeds the layer its own
previous output hidden state and the draft before (``engine.spec.chain``), at positions
the device places after the kept tokens, writing KV at lookahead slots that the next
step's pass overwrites with the real thing. The drafts come back with the step's tokens.

Confidence: the head's probability of its token at the position's calibration
temperature (``SpeculativeConfig.confidence_temperatures``, checked at start to be
exactly K values). Known limit: the KV of a block's last position depends on the token
after the block, so a request that shares a prefix only up to a block boundary attends
there over another continuation's latent (its drafts may be worse; outputs are exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import build_backend
from engine.attention.base import AttentionMetadata, ForwardContext, padded_tables
from engine.config import SpeculativeConfig
from engine.spec.base import Drafting, LaunchStep
from engine.spec.chain import Chained, ChainStart, launch_chain
from engine.spec.graphs import RowsDrafter
from kvstore.layout import KVCache

if TYPE_CHECKING:
    from engine.models.base import CausalLM


class MTPDrafter(RowsDrafter):
    name = "mtp"
    needs_hidden = True
    on_device = True

    def __init__(self, config: SpeculativeConfig, model: CausalLM) -> None:
        super().__init__(config.max_draft)
        layers = getattr(model, "mtp", None)
        if not layers:
            raise ValueError(
                f"--speculative mtp: {model.config.name} has no multi-token prediction "
                "layers (num_nextn_predict_layers with weights in the checkpoint)"
            )
        self.config = config
        self.model = model
        self.layer = layers[0]
        self.kv_lookahead = config.max_draft
        self.device = next(model.parameters()).device
        self.block_size = 0
        self._max_len = model.config.max_position_embeddings

    def kv_layers(self) -> int:
        return 1

    def bind(self, cache: KVCache, num_blocks: int, max_model_len: int) -> None:
        self.block_size = cache.layout.block_size
        cfg = self.model.config
        self.backend = build_backend(cache, cfg, self.model.attention_scale, str(self.device))
        self._max_len = min(self._max_len, max_model_len)

    def launch(self, step: LaunchStep) -> Drafting:
        """One pass of the layer over every row of the step, then the chain of each
        drafting request from its last real row (module docstring), all queued."""
        chunks = step.chunks
        n = sum(c.num_tokens for c in chunks)
        decode = all(c.is_decode for c in chunks)
        if self.graphs is not None and decode:
            # decode rows: one row a sequence, positions known on the device (moved back
            # by ``shift`` when the step was planned before the one before it was known)
            positions, tables, planned = step.token_rows(chunks)
            stream = self._rows(step.next_ids, positions, step.hidden[:n], tables, planned)
        else:
            positions, meta = step.chunk_rows(chunks, self.block_size)
            stream = self._layer(step.next_ids, positions, meta, step.hidden[:n])
        ids = [r.request_id for r in step.requests]
        if not ids:
            return Drafting([], Chained(0, []))
        state = {"hidden": stream[step.last_rows]}  # the layer's output, per drafting request
        starts = [
            ChainStart(j, bound, r.num_draft,
                       min(len(r.block_ids) * self.block_size, self._max_len))
            for j, (r, bound) in enumerate(zip(step.requests, step.bounds))
        ]  # fmt: skip
        tables = padded_tables([r.block_ids for r in step.requests])

        def forward(active: list[int], tokens: torch.Tensor, bounds: list[int]) -> torch.Tensor:
            index, positions = step.placed(active, bounds)  # where the drafts really go
            out = self._rows(tokens, positions, state["hidden"][index], tables[active], bounds)
            full = state["hidden"].clone()
            full[index] = out
            state["hidden"] = full
            return self._logits(out)

        chained = launch_chain(self.config, self._logits(state["hidden"]), starts, forward,
                               self.model.config.vocab_size)  # fmt: skip
        chained.start_copy()
        return Drafting(ids, chained)

    def _layer(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The layer's output stream at each row: ``token_ids`` are the tokens that follow
        each position, ``hidden`` the hidden states before (the target's, or the layer's
        own for a chained draft)."""
        layer = self.layer
        embed = self.model.model.embed_tokens(token_ids)
        x = layer.eh_proj(torch.cat((layer.enorm(embed), layer.hnorm(hidden.to(embed.dtype))), -1))
        out, residual = layer(x, None, positions, ForwardContext(meta, self.backend))
        return out + residual

    def _logits(self, stream: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.layer.shared_head["norm"](stream))
