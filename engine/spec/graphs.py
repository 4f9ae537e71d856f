"""A drafter's layer over one-token rows, replayed from CUDA graphs by bucket of rows.

The MTP drafter (``engine.spec.mtp``) runs its layer, an MLA attention and a MoE feed
forward at the target's width, several times a step: over the rows of the step it
follows, then once per chained draft; a draft model (``engine.spec.draft_model``) runs
its whole forward as often. Run eagerly, each call is a few hundred kernel
launches; once the next step is planned while this one runs, those launches are what the
device waits for at one stream: at DeepSeek-V3's width a step with three drafts took
12.3 ms with them eager and 8.2 ms replayed (``bench/mtp_drafting.py``). Every such
call whose rows are each one token over its sequence's block table, attending to its
context up to itself (a chained draft; a verify step's rows), fits one graph per bucket
of rows, as the target's decode steps do
(``engine.cuda_graphs``): the rows' ids, positions and input hidden states are copied
into the bucket's buffers on the device (positions may be known only there: after a
verification), their slots and context lengths computed there, and the graph replayed.
Padding rows write the null block's slot 0, as the decode graphs' do.

The graphs hold the layer's output stream only; the logits of the rows a caller wants
(a few of the pass's, every chained draft's) are computed after, outside the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata, slots_of
from engine.cuda_graphs import NULL_SLOT, Buckets, batch_buckets, capture_graph, copy_in
from engine.models.base import CausalLM
from engine.spec.base import Drafter

log = logging.getLogger("ferry.spec")

# the layer: (token ids, positions, attention metadata, hidden states before) -> its output
Layer = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


@dataclass
class _Rows:
    size: int
    ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    hidden: torch.Tensor | None  # [size, H]; None: the layer takes no hidden states
    meta: AttentionMetadata  # its seq_lens, block tables and slots are buffers too
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # [size, H], the graph's output


class RowGraphs(Buckets):
    """``layer`` over up to ``max_rows`` one-token rows whose contexts fit
    ``max_seq_len``, one graph per bucket (module docstring). ``capture=False`` runs the
    same buffers without graphs (the CPU's way to exercise them). ``takes_hidden`` False:
    the layer reads no hidden states (a whole draft model: ``run`` gets None for them)."""

    def __init__(
        self, layer: Layer, model: CausalLM, backend, block_size: int, max_rows: int,
        max_seq_len: int, capture: bool = True, takes_hidden: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(model, backend, batch_buckets(max_rows))
        self.layer = layer
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_blocks = -(-max_seq_len // block_size)
        param = next(model.parameters())
        self._hidden = (model.config.hidden_size, param.dtype) if takes_hidden else None
        self._buckets = {b: self._allocate(b) for b in self.sizes}
        if capture:
            self.capture()

    def accepts(self, rows: int, context: int) -> bool:
        """Whether ``rows`` rows whose contexts are at most ``context`` tokens fit a
        bucket."""
        return 0 < rows <= self.largest and context <= self.max_seq_len

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
        tables: np.ndarray,
    ) -> torch.Tensor:  # fmt: skip
        """The layer's output at each row (``tables``: each row's block table, host);
        the graph's buffer: read it before the next run. Queues work only."""
        n = ids.shape[0]
        bucket = self._buckets[self.bucket_for(n)]
        self._fill(bucket, ids, positions, hidden, tables)
        if bucket.graph is None:
            return self._forward(bucket)[:n]
        bucket.graph.replay()
        return bucket.out[:n]

    def _allocate(self, size: int) -> _Rows:
        device = self.device
        ids = torch.zeros(size, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            block_tables=torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device),
            slot_mapping=torch.full((size,), NULL_SLOT, dtype=torch.long, device=device),
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_seq_len] * size,
        )  # fmt: skip
        hidden = None
        if self._hidden is not None:
            width, dtype = self._hidden
            hidden = torch.zeros(size, width, dtype=dtype, device=device)
        return _Rows(size, ids, torch.zeros_like(ids), hidden, meta)

    def _fill(
        self, bucket: _Rows, ids: torch.Tensor, positions: torch.Tensor,
        hidden: torch.Tensor | None, tables: np.ndarray,
    ) -> None:  # fmt: skip
        """The rows into the bucket's first buffers, padding after them."""
        n, meta = ids.shape[0], bucket.meta
        host = np.zeros((bucket.size, self.max_blocks), dtype=np.int32)
        blocks = min(tables.shape[1], self.max_blocks)  # those past the contexts: unread
        host[:n, :blocks] = tables[:, :blocks]
        copy_in(meta.block_tables, host)
        for buffer, rows, pad in ((bucket.ids, ids, 0), (bucket.positions, positions, 0),
                                  (meta.seq_lens, positions + 1, 1)):  # fmt: skip
            buffer[:n].copy_(rows)
            buffer[n:].fill_(pad)
        if bucket.hidden is not None:
            bucket.hidden[:n].copy_(hidden)
            bucket.hidden[n:].zero_()
        meta.slot_mapping[:n].copy_(slots_of(meta.block_tables[:n], positions, self.block_size))
        meta.slot_mapping[n:].fill_(NULL_SLOT)

    def _forward(self, bucket: _Rows) -> torch.Tensor:
        with torch.inference_mode():
            return self.layer(bucket.ids, bucket.positions, bucket.meta, bucket.hidden)

    def _padding(self, bucket: _Rows) -> None:
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        hidden = None if bucket.hidden is None else bucket.hidden[:0]
        self._fill(bucket, empty, empty, hidden, np.zeros((0, 1), np.int32))

    def dry_run(self) -> None:
        """One forward of every bucket over padding (inside ``parallel_builds``: the
        kernels the graphs need, built at once)."""
        self._dry_ran = True
        for size in self.sizes:
            self._padding(self._buckets[size])
            self._forward(self._buckets[size])

    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool."""
        start = time.perf_counter()
        pool = self._capture_pool()
        for size in reversed(self.sizes):
            bucket = self._buckets[size]
            self._padding(bucket)
            bucket.graph, bucket.out = capture_graph(lambda bucket=bucket: self._forward(bucket),
                                                     pool)  # fmt: skip
        torch.cuda.synchronize()
        self.captured = True
        log.info("captured the drafter's CUDA graphs for %s rows in %.1f s",
                 ",".join(map(str, self.sizes)), time.perf_counter() - start)  # fmt: skip


class RowsDrafter(Drafter):
    """A drafter that runs a model (``model``, over ``backend``) on one-token rows: a
    decode or verify step's rows, each chained draft; from its ``RowGraphs`` once
    ``capture_graphs`` made them, where the rows fit. ``_layer`` is what it runs;
    ``takes_hidden`` False: that reads no hidden states."""

    takes_hidden = True
    graphs: RowGraphs | None = None
    model: CausalLM
    backend: object
    block_size: int
    _max_len: int

    def _layer(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def capture_graphs(self, max_rows: int, max_seq_len: int, capture: bool = True) -> RowGraphs:
        """From now on, its calls over one-token rows (up to ``max_rows``, within
        ``max_seq_len``) replay CUDA graphs (``capture=False``: the same buffers, run
        eagerly)."""
        self.graphs = RowGraphs(self._layer, self.model, self.backend, self.block_size,
                                max_rows, min(max_seq_len, self._max_len), capture,
                                self.takes_hidden)  # fmt: skip
        return self.graphs

    def _rows(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
        tables: np.ndarray, planned: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """``_layer``'s output at one-token rows (``tables``: each row's block table, host;
        ``planned``: a host bound on each position), from the graphs where they fit."""
        graphs = self.graphs
        if graphs is not None and graphs.accepts(len(planned), max(planned) + 1):
            return graphs.run(ids, positions, hidden, tables)
        meta = AttentionMetadata.one_token_each(tables, positions, planned, self.block_size)
        return self._layer(ids, positions, meta, hidden)
