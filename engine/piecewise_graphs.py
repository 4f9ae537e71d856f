"""Steps with prompt tokens replayed from CUDA graphs, piece by piece between attentions.

``DecodeGraphs`` holds decode steps whole: one token per sequence, so a step's attention
has the shape of its batch. A step with a prompt's chunk (a prefill, prefill beside
decode rows, verification beside a prefill) gives the attention a new shape with every
sequence's query length, so it ran eagerly, kernel call by kernel call from Python: at
the 8B shape ~290 µs of host time per layer, a step's host work (9.4 ms) above its device
time (bench/results/launch_overhead_h200.json), for steps of a few hundred tokens.

Here each bucket of token counts T (``TOKEN_BUCKETS`` up to ``max_tokens``) gets the model's
forward as L + 1 graphs cut at its attention calls (``ForwardContext.attention`` /
``mla_attention``): graph i runs from layer i-1's attention output (its o projection,
norms, MLP or MoE) to layer i's attention inputs, which it copies into static buffers;
the attention itself runs eagerly between two replays, over the step's real rows and
with the step's own metadata (it writes their KV), into the static buffer graph i + 1
reads. A step of n <= T tokens fills the first n rows of the bucket's input ids and
positions; the padding rows run through the per-token work of the graphs (the rows of
an earlier step, or zeros) but reach neither an attention nor the KV cache, and their
hidden states are not returned.

The runner takes this path where the per-token work is the model's alone: no image
embeddings spliced in, no M-RoPE positions (the engine builds it only without an
expert-parallel exchange, whose dispatcher is not captured inside a step). A bucket whose
capture fails leaves every step to run eagerly, with a warning. ``capture=False`` runs
the same buffers, padding and attention calls without graphs (the CPU's way to test
them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, MLABackend
from engine.cuda_graphs import Buckets
from engine.models.base import CausalLM

log = logging.getLogger("ferry.cuda_graphs")

# every 16 tokens up to 128, every 32 up to 512: past ~180 tokens an 8B step is bound by
# its products' arithmetic, so a step pays for its padding rows (doubling buckets took
# 1-prompt-of-274-tokens mixed steps to 512 rows and cut serving throughput 7 %)
TOKEN_BUCKETS = (*range(16, 129, 16), *range(160, 513, 32))


def token_buckets(max_tokens: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> tuple[int, ...]:
    """The bucket sizes up to ``max_tokens``, which is the last one (none for 0)."""
    if max_tokens <= 0:
        return ()
    return tuple(sorted({b for b in buckets if b < max_tokens} | {max_tokens}))


@dataclass
class _Cut:
    """Where a piece ends: layer ``layer``'s attention (None: the forward's end), with the
    weight an MLA attention takes (``kv_b``)."""

    graph: torch.cuda.CUDAGraph
    layer: int | None = None
    kv_b: torch.Tensor | None = None


class _PieceContext(ForwardContext):
    """The forward context of a padded step: each attention call stages its inputs in the
    static buffers and either runs the attention over the real rows now (eager) or ends
    the graph being captured there and begins the next (``capturing``)."""

    def __init__(self, owner: PiecewiseGraphs, meta: AttentionMetadata, rows: int,
                 capturing: list[_Cut] | None = None) -> None:  # fmt: skip
        super().__init__(meta, owner.backend)
        self.owner, self.rows, self.capturing = owner, rows, capturing

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self._cut(layer, None, q, k, v)

    def mla_attention(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                      kv_b: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self._cut(layer, kv_b, q, latent)

    def _cut(self, layer: int, kv_b: torch.Tensor | None, *inputs: torch.Tensor) -> torch.Tensor:
        owner, size = self.owner, inputs[0].shape[0]
        owner.stage(inputs)
        if self.capturing is None:
            owner.attend(layer, kv_b, self.rows, self.meta)
        else:
            cut = self.capturing[-1]
            cut.graph.capture_end()
            cut.layer, cut.kv_b = layer, kv_b
            graph = torch.cuda.CUDAGraph()
            self.capturing.append(_Cut(graph))
            graph.capture_begin(pool=owner.pool)
        return owner.out[:size]


class PiecewiseGraphs(Buckets):
    """Static buffers and per-bucket graph pieces for steps of up to ``max_tokens``
    tokens (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend | MLABackend,
        max_tokens: int,
        buckets: Sequence[int] = TOKEN_BUCKETS,
        capture: bool = True,
    ) -> None:
        sizes = token_buckets(max_tokens, buckets)
        if not sizes:
            raise ValueError("piecewise graphs need a positive token count")
        super().__init__(model, backend, sizes)
        self.ids = torch.zeros(self.largest, dtype=torch.long, device=self.device)
        self.positions = torch.zeros_like(self.ids)
        self.staged: list[torch.Tensor] = []  # each attention input, [max_tokens, ...]
        self.out = torch.empty(0)  # the attention's output, [max_tokens, ...]
        self.pool = None
        self._pieces: dict[int, list[_Cut]] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # each bucket's final hidden states
        if capture:
            self.capture()

    def accepts(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.largest

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """The final hidden states of the step's ``n`` tokens (rows of a static buffer
        when replayed: read them before the next step). Queues work only."""
        n = input_ids.shape[0]
        size = self.bucket_for(n)
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        pieces = self._pieces.get(size)
        if pieces is None:
            return self._forward(size, n, meta)[:n]
        for cut in pieces:
            cut.graph.replay()
            if cut.layer is not None:
                self.attend(cut.layer, cut.kv_b, n, meta)
        return self._hidden[size][:n]

    # -- the steps between pieces -----------------------------------------------------------

    def stage(self, inputs: Sequence[torch.Tensor]) -> None:
        """Copy an attention's inputs into the static buffers (allocated at the first
        call, which is a forward of the largest bucket)."""
        if not self.staged:
            self.staged = [torch.zeros(self.largest, *t.shape[1:], dtype=t.dtype,
                                       device=self.device) for t in inputs]  # fmt: skip
        for buffer, t in zip(self.staged, inputs):
            buffer[: t.shape[0]].copy_(t)

    def attend(self, layer: int, kv_b: torch.Tensor | None, rows: int,
               meta: AttentionMetadata) -> None:  # fmt: skip
        """The attention of ``layer`` over the first ``rows`` staged rows, into ``out``."""
        inputs = [t[:rows] for t in self.staged]
        if kv_b is None:
            result = self.backend.forward(layer, *inputs, meta)
        else:
            result = self.backend.forward(layer, *inputs, kv_b, meta)
        if self.out.shape[0] != self.largest:
            self.out = torch.zeros(self.largest, *result.shape[1:], dtype=result.dtype,
                                   device=self.device)  # fmt: skip
        self.out[:rows].copy_(result)

    # -- the forward and its capture --------------------------------------------------------

    def _forward(self, size: int, rows: int, meta: AttentionMetadata,
                 capturing: list[_Cut] | None = None) -> torch.Tensor:  # fmt: skip
        """The bucket's forward over its buffers, attending over ``rows`` real rows (or
        cut into the graphs ``capturing`` holds)."""
        with torch.inference_mode():
            ctx = _PieceContext(self, meta, rows, capturing)
            return self.model(self.ids[:size], self.positions[:size], ctx)

    def _padding(self, size: int) -> AttentionMetadata:
        """What the warm-up forwards attend over: ``size`` tokens in the null block."""
        block = self.backend.cache.layout.block_size
        return AttentionMetadata.over_null_block(size, block, self.device)

    def dry_run(self) -> None:
        """One eager forward of every bucket over padding (largest first: it sizes the
        buffers), inside a ``parallel_builds`` section: what asks for the kernels the
        pieces need, so that they are built at once."""
        for size in reversed(self.sizes):
            self.ids[:size].zero_()
            self.positions[:size].zero_()
            self._forward(size, size, self._padding(size))
        self._dry_ran = True

    def capture(self) -> None:
        """Capture every bucket, largest first, all pieces in one memory pool (until now
        the buckets ran eagerly). A bucket that fails to capture leaves every bucket
        eager, with a warning."""
        start = time.perf_counter()
        self.pool = self._capture_pool()
        try:
            for size in reversed(self.sizes):
                self._capture(size)
        except RuntimeError as exc:
            self._pieces.clear()
            self._hidden.clear()
            log.warning("steps with prompt tokens run eagerly: capturing their graph pieces "
                        "failed (%s)", exc)  # fmt: skip
            return
        torch.cuda.synchronize()
        self.captured = True
        log.info("captured prefill/mixed step graphs for %s tokens, %d pieces each, in %.1f s",
                 ",".join(map(str, self.sizes)), len(self._pieces[self.largest]),
                 time.perf_counter() - start)  # fmt: skip

    def _capture(self, size: int) -> None:
        meta = self._padding(size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: kernels, cuBLAS workspaces
                self._forward(size, size, meta)
            torch.cuda.synchronize()
            first = torch.cuda.CUDAGraph()
            pieces = [_Cut(first)]
            first.capture_begin(pool=self.pool)
            try:
                hidden = self._forward(size, size, meta, capturing=pieces)
            finally:
                pieces[-1].graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self._pieces[size] = pieces
        self._hidden[size] = hidden
