"""DeepSeek-V3's multi-token prediction layer as the drafter, chained for up to K tokens.

``model.mtp[0]`` (``MultiTokenPredictor``) at position p takes the target's final hidden
state ``h_p`` and the embedding of the token at p + 1, and predicts the token at p + 2.
Its attention has a KV layer of its own (one more MLA latent per token), which the engine
adds to the target's KV cache (``kv_layers``): it lives in the request's blocks, so prefix
caching, the KV tiers and a prefill worker's transfer to a decode worker carry it with
the target's layers (a prefill worker runs this pass without drafting, so the decode
worker's MTP attends over the prompt's latents).

After each step, one pass of the layer runs over every real token of the step (a prefill
chunk's, a verify chunk's input and kept drafts), with the target's hidden states of those
rows and the token that follows each: that writes the layer's KV of those positions with
what the target computed. For the requests that go on, the pass's output at the last real
position gives the first draft; each next draft feeds the layer its own previous output
hidden state and the draft before (``engine.spec.chain``), writing KV at lookahead slots
that the next step's pass overwrites with the real thing.

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
from engine.attention.base import ForwardContext
from engine.config import SpeculativeConfig
from engine.plan import ScheduledChunk
from engine.spec.base import Drafter, DraftStep, Proposal
from engine.spec.chain import ChainStart, chain
from kvstore.layout import KVCache

if TYPE_CHECKING:
    from engine.models.base import CausalLM


class MTPDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

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

    def propose(self, step: DraftStep) -> dict[str, Proposal]:
        if step.hidden is None:
            raise ValueError("the MTP drafter needs the step's hidden states")
        proposing = {r.request_id: r for r in step.requests}
        rows, chunks = [], []
        for i, chunk in enumerate(step.chunks):
            known = step.token_ids[i]
            n = min(step.num_real[i], len(known) - chunk.start_pos - 1)  # rows with a next token
            if n <= 0:
                continue
            rows += step.rows(i)[:n]
            nxt = list(known[chunk.start_pos + 1 : chunk.start_pos + 1 + n])
            sample = chunk.request_id in proposing and n == step.num_real[i]
            chunks.append(ScheduledChunk(chunk.request_id, nxt, chunk.start_pos,
                                         chunk.block_ids, sample))  # fmt: skip
        if not chunks:
            return {}
        hidden_in = step.hidden[torch.tensor(rows, device=step.hidden.device)]
        logits, hidden_out, sample_rows = self._forward(chunks, hidden_in)
        starts, ids = [], []
        for j, c in enumerate(c for c in chunks if c.sample):
            r = proposing[c.request_id]
            limit = min(len(r.block_ids) * self.block_size, self._max_len)
            starts.append(ChainStart(j, c.end_pos, r.num_draft, limit))
            ids.append(c.request_id)
        state = {"hidden": hidden_out[sample_rows]}  # the layer's output, per drafting request

        def forward(active: list[int], tokens: torch.Tensor, positions: list[int]):
            prev = state["hidden"][torch.tensor(active, device=tokens.device)]
            step_chunks = [  # the token ids are the device's (``tokens``)
                ScheduledChunk(ids[a], [0], p, proposing[ids[a]].block_ids, True)
                for a, p in zip(active, positions)
            ]
            out_logits, out_hidden, _ = self._forward(step_chunks, prev, tokens)
            full = state["hidden"].clone()
            full[torch.tensor(active, device=tokens.device)] = out_hidden
            state["hidden"] = full
            return out_logits

        drafted = chain(self.config, logits, starts, forward, self.model.config.vocab_size)
        return {
            rid: Proposal(len(proposing[rid].token_ids), tokens, conf)
            for rid, (tokens, conf) in zip(ids, drafted)
        }

    def _forward(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The layer over ``chunks`` (their token ids, or ``token_ids`` on the device, are
        the tokens that follow each position) with the previous hidden states ``hidden``:
        logits of the sampled rows, the output hidden states of every row, and the sampled
        rows' indices."""
        from engine.runner import step_inputs

        inputs, _ = step_inputs(chunks, self.block_size, self.device)
        layer = self.layer
        ids = inputs.input_ids if token_ids is None else token_ids
        embed = self.model.model.embed_tokens(ids)
        x = layer.eh_proj(torch.cat((layer.enorm(embed), layer.hnorm(hidden.to(embed.dtype))), -1))
        out, residual = layer(x, None, inputs.positions, ForwardContext(inputs.meta, self.backend))
        stream = out + residual
        chosen = stream[inputs.sample_rows]
        logits = self.model.compute_logits(layer.shared_head["norm"](chosen))
        return logits, stream, inputs.sample_rows
