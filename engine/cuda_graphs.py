"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes.

A decode step of an 8B model is a few hundred kernel launches around ~15 GB of weight
reads; run eagerly, the CPU cannot issue them as fast as the GPU retires them, so a
batch-1 step takes several times its HBM floor. Here each bucket size ``b`` (1, 2, 4,
... up to ``max_batch``) gets one graph holding the whole model forward and the logits,
captured once over static input buffers; a decode step of ``n <= b`` sequences fills the
first ``n`` rows of the smallest bucket that fits and replays its graph.

A speculative verify step whose chunks are each one token plus drafts arrives here as one
single-token row per token (``engine.runner``), so it replays the bucket of its row count.

Padding rows are real rows of the batch that nobody reads: token 0 at position 0, one
token of context, a block table of zeros, and their KV goes to slot 0 of block 0 (the null
block, never handed out), so they never touch a real block. Steps with more than one
token for some sequence (prefill, chunked prefill, mixed batches), with more sequences
than the largest bucket or with a longer context than the buffers were sized for run
eagerly.

``capture=False`` runs the same buffers and padding without a graph: the padded forward
then also runs where CUDA graphs do not exist (the CPU), which is how the padding is
tested there.

On the CPU ``capture`` records programs instead: a decode step of a model whose layers
run on the C kernels (``kernels.cpu``: quantized products, norms, RoPE, the KV store and
attention) is, after the embedding, nothing but those kernels' calls over static
buffers, so each bucket's calls are recorded once and replayed in one call
(``CpuKernels.record``), without the ~6 ms of Python a SmolLM2-135M step spent between
them on a 2-core CPU. A torch op that computes inside the recorded forward (a model or
a weight format the kernels do not cover) refuses the recording, and so does a replay
that does not reproduce the recorded forward's hidden states: that bucket runs eagerly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    padded_tables,
)
from engine.cpu_kernels import cpu_kernels
from engine.models.base import CausalLM
from engine.models.quant import decode_rows
from engine.plan import ScheduledChunk
from kernels import parallel_builds
from kernels.cpu import Program, Recording

log = logging.getLogger("ferry.cuda_graphs")

# past 256 rows: the verify steps of speculative decoding (each request's token and its
# drafts, a row each), captured only where a step can hold that many rows
# (``EngineCore._graph_rows``). Eager, a verify step of 512 rows of the 8B shape took 19.7
# ms on the H200 where the graphs' 25-30 us a row past 256 rows (10.6 ms) come to ~17.5.
# No bucket at 448 rows: there cuBLAS's bf16 GEMM of the 8B shape's gate/up projection took
# 315 us against 180 at 512 rows on an H100, and the whole forward 21.4 ms against 18.7 at
# 512 (bench/results/decode_buckets_h100.json): 385-512 rows replay the 512-row graph.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 320, 384, 512)
# on the CPU a padding row costs what a real one does in every product, and a program is
# cheap to record: finer buckets
CPU_BUCKETS = (*range(1, 9), 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96, 128, 192, 256)
NULL_SLOT = 0  # slot 0 of block 0, the null block: where padding rows write their KV


def batch_buckets(max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The bucket sizes up to ``max_batch``; ``max_batch`` itself is the last one."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    return tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))


@dataclass
class _Bucket:
    size: int
    int64: torch.Tensor  # [3, size]: input ids, positions, slots
    int32: torch.Tensor  # [size * (1 + max_blocks)]: seq_lens, then the block table
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [size, V] float32, the graph's output
    hidden: torch.Tensor | None = None  # [size, H], the final hidden states it computed
    program: Program | None = None  # on the CPU: the recorded kernel calls
    embedded: torch.Tensor | None = None  # the program's input: the step's embeddings
    keep: list[torch.Tensor] | None = None  # every tensor the program's calls point into
    refused: str | None = None  # why its step could not be recorded


class Buckets:
    """What every kind of padded step shares: the model and attention backend it runs,
    its bucket sizes (ascending; the last is the largest step it takes), the smallest
    bucket that holds a step, and whether its buckets are captured (until then they run
    eagerly)."""

    def __init__(self, model: CausalLM, backend, sizes: tuple[int, ...]) -> None:
        self.model = model
        self.backend = backend
        self.device = next(model.parameters()).device
        self.sizes = sizes
        self.captured = False
        self._dry_ran = False

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, size: int) -> int:
        return next(b for b in self.sizes if b >= size)

    def dry_run(self) -> None:
        raise NotImplementedError

    def _capture_pool(self):
        """Before capturing on CUDA: the kernels built (one dry run, unless the engine's
        start-up ran it), and the memory pool every bucket's graphs share."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not {self.device}")
        if not self._dry_ran:
            with parallel_builds():
                self.dry_run()
        return torch.cuda.graph_pool_handle()


class DecodeGraphs(Buckets):
    """Static buffers and captured graphs for decode steps of up to ``max_batch`` sequences
    whose contexts fit ``max_seq_len`` tokens."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        block_size: int,
        max_batch: int,
        max_seq_len: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        capture: bool = True,
    ) -> None:
        super().__init__(model, backend, batch_buckets(max_batch, buckets))
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_blocks = math.ceil(max_seq_len / block_size)
        self._buckets = {b: self._allocate(b) for b in self.sizes}
        self._recorder = None  # on the CPU, once programs are checked: (kernels, embedding)
        self.replays = 0  # steps replayed from a captured graph, and the latest one's bucket
        self.replayed_size = 0
        # fills in what a step still running left on the device (ModelRunner.resolve_inputs)
        self.resolve_inputs = None
        if capture:
            self.capture()

    def accepts(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """True when this step can replay a graph: one token per sequence, and the batch
        and every context fit the buffers."""
        return (
            0 < len(chunks) <= self.largest
            and all(c.num_tokens == 1 for c in chunks)
            and max(c.end_pos for c in chunks) <= self.max_seq_len
            and max(len(c.block_ids) for c in chunks) <= self.max_blocks
        )

    def run(
        self, chunks: Sequence[ScheduledChunk], offsets: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Logits ``[bucket, V]`` of the step (row i is ``chunks[i]``; rows past
        ``len(chunks)`` are padding). The tensor is the graph's: read it before the next
        step. Queues work only: never waits for the device. ``offsets``: what each row's
        rotary position adds to its token index (M-RoPE past a prompt's images)."""
        bucket = self._buckets[self.bucket_for(len(chunks))]
        self._fill(bucket, chunks, offsets)
        self._last = bucket
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            self.replayed_size = bucket.size
            return bucket.logits
        if bucket.program is not None:
            self._replay(bucket, self._recorder[1])
        elif self._recorder is not None and bucket.refused is None:
            bucket.refused = self._record(bucket, *self._recorder)  # this step, recorded
            if bucket.refused is not None:
                log.info("decode steps of %d rows run eagerly: %s", bucket.size, bucket.refused)
        else:
            bucket.hidden, logits = self._forward(bucket)
            return logits
        with torch.inference_mode():
            return self.model.compute_logits(bucket.hidden)

    def input_ids(self, n: int) -> torch.Tensor:
        """The input tokens of the first ``n`` rows of the last ``run``, as the device had
        them (the graph's buffer: read it before the next step)."""
        return self._last.int64[0, :n]

    def hidden(self, n: int) -> torch.Tensor:
        """The final hidden states of the first ``n`` rows of the last ``run`` (the
        graph's buffer: read it before the next step)."""
        return self._last.hidden[:n]

    # -- buffers --------------------------------------------------------------------------

    def _allocate(self, size: int) -> _Bucket:
        int64 = torch.zeros(3, size, dtype=torch.long, device=self.device)
        int32 = torch.zeros(size * (1 + self.max_blocks), dtype=torch.int32, device=self.device)
        query_start = torch.arange(size + 1, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=query_start,
            seq_lens=int32[:size],
            block_tables=int32[size:].view(size, self.max_blocks),
            slot_mapping=int64[2],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_seq_len] * size,
        )
        return _Bucket(size, int64, int32, meta)

    def _fill(
        self, bucket: _Bucket, chunks: Sequence[ScheduledChunk],
        offsets: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """Write the step's rows into the bucket's buffers, padding the rest."""
        size, n = bucket.size, len(chunks)
        host64 = np.zeros((3, size), dtype=np.int64)  # padding: token 0, position 0, slot 0
        host32 = np.zeros(size * (1 + self.max_blocks), dtype=np.int32)
        seq_lens = host32[:size]
        tables = host32[size:].reshape(size, self.max_blocks)
        seq_lens[:] = 1  # a padding row attends to the one token it wrote into the null block
        host64[0, :n] = [c.token_ids[0] for c in chunks]
        positions = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n)
        host64[1, :n] = positions if offsets is None else positions + np.asarray(offsets)
        seq_lens[:n] = positions + 1
        if n:
            tables[:n] = padded_tables([c.block_ids for c in chunks], self.max_blocks)
        bs = self.block_size
        host64[2, :n] = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        host64[2, n:] = NULL_SLOT
        copy_in(bucket.int64, host64)
        copy_in(bucket.int32, host32)
        if self.resolve_inputs is not None:
            self.resolve_inputs(bucket.int64[0], bucket.int64[1], bucket.meta, host64[0],
                                [c.request_id for c in chunks])  # fmt: skip

    # -- the forward and its capture ------------------------------------------------------

    def _forward(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's hidden states and logits."""
        ids, positions = bucket.int64[0], bucket.int64[1]
        with torch.inference_mode():
            hidden = self.model(ids, positions, ForwardContext(bucket.meta, self.backend))
            return hidden, self.model.compute_logits(hidden)

    def dry_run(self) -> None:
        """One forward of every bucket over padding, inside a ``parallel_builds`` section:
        what asks for the kernels the graphs need, so that they are built at once (on the
        CPU nothing is built: none)."""
        self._dry_ran = True
        if self.device.type == "cpu":
            return
        for size in self.sizes:
            self._fill(self._buckets[size], [])
            self._forward(self._buckets[size])
        self._dry_ran = True

    def capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool (until now the
        buckets ran eagerly). First a dry run inside ``parallel_builds``, so that the
        kernels they need and nothing built yet are built at once (154 s one after another
        on a new machine for deepseek-v3-4l, 138 of them building;
        bench/results/startup_h200_2aae27c.json); an engine's start-up has built them in
        the dry run it shares with its warm-up (``EngineCore``), and this one is skipped."""
        if self.device.type == "cpu":
            self._record_programs()
            return
        start = time.perf_counter()
        pool = self._capture_pool()
        for size in reversed(self.sizes):
            bucket = self._buckets[size]
            self._fill(bucket, [])  # all padding: writes only the null block
            bucket.graph, (bucket.hidden, bucket.logits) = capture_graph(
                lambda bucket=bucket: self._forward(bucket), pool)
        torch.cuda.synchronize()
        self.captured = True
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            ",".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )


    # -- CPU programs ---------------------------------------------------------------------

    @staticmethod
    def _replay(bucket: _Bucket, embed: torch.nn.Module) -> None:
        """The step's embeddings into the program's input, then the program: the step's
        hidden states in ``bucket.hidden``."""
        with torch.inference_mode():
            bucket.embedded.copy_(embed(bucket.int64[0]))
            bucket.program()

    def _record_programs(self) -> None:
        """Record the smallest bucket's decode step as a program of kernel calls and check
        that its replay reproduces it (module docstring); the other buckets are recorded
        by their first step (``run``), which costs that step nothing more. A model whose
        step cannot be replayed stays eager."""
        start = time.perf_counter()
        kernels = cpu_kernels()
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if kernels is None or embed is None:
            log.info("decode steps run eagerly: no CPU kernels or no embedding to start from")
            return
        bucket = self._buckets[self.sizes[0]]
        self._fill(bucket, [])  # all padding: writes only the null block
        reason = self._record(bucket, kernels, embed, check=True)
        if reason is not None:
            log.info("decode steps run eagerly: %s", reason)
            return
        self.captured = True
        self._recorder = (kernels, embed)
        # the ready line says the time (graphs); the rest matters to whoever reads the programs
        log.debug("decode steps replay recorded kernel calls (%d a step; checked in %.2f s)",
                  len(bucket.program), time.perf_counter() - start)  # fmt: skip

    def _record(self, bucket: _Bucket, kernels, embed: torch.nn.Module,
                check: bool = False) -> str | None:  # fmt: skip
        """Record ``bucket``'s forward (over what its buffers hold) from its embeddings on,
        leaving its hidden states in ``bucket.hidden``; ``check``: replay it once and
        compare. None, or why it cannot be replayed."""
        embedded = []

        def started(module, args, out) -> None:
            embedded.append(out)
            rec.start()

        with kernels.record() as rec, _KeepAllocations(rec) as keep:
            handles = (embed.register_forward_pre_hook(lambda module, args: keep.embedding()),
                       embed.register_forward_hook(started))  # fmt: skip
            try:
                with torch.inference_mode(), decode_rows(True):
                    ctx = ForwardContext(bucket.meta, self.backend)
                    hidden = self.model(bucket.int64[0], bucket.int64[1], ctx)
            finally:
                for handle in handles:
                    handle.remove()
        bucket.hidden = hidden
        if rec.refused is not None or not rec.calls:
            return rec.refused or "no kernel calls"
        bucket.program = kernels.program(rec)
        bucket.embedded, bucket.keep = embedded[0], keep.tensors
        if not check:
            return None
        expected = hidden.clone()
        self._replay(bucket, embed)
        if not torch.equal(bucket.hidden, expected):
            bucket.program = bucket.embedded = bucket.keep = None
            return "its replay does not reproduce the forward"
        return None


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}  # fmt: skip


class _KeepAllocations(TorchDispatchMode):
    """While a CPU program records: keeps every tensor allocated once it has started (its
    calls point into them), and refuses the recording at the first torch op that
    computes anything outside the embedding (a program replays the kernels' calls only;
    a replay runs the embedding itself, and nothing the forward computes before it)."""

    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec
        self.tensors: list[torch.Tensor] = []
        self._embedding = False

    def embedding(self) -> None:
        """The embedding starts: what it computes is the replay's own work."""
        self._embedding = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.rec.active:
            if not self._embedding and func not in _ALLOCATIONS and not _is_view(func):
                self.rec.refuse(f"torch computes {func} before the embedding")
            return out
        if func in _ALLOCATIONS:
            self.tensors.append(out)
        elif not _is_view(func):
            self.rec.refuse(f"torch computes {func} between the kernels")
        return out


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def capture_graph(forward, pool=None, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """``forward()`` run ``warmups`` times on a side stream (kernels built, library
    handles and workspaces made), then captured into ``pool`` (None: a pool of its own):
    the graph and what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def copy_in(dst: torch.Tensor, host: np.ndarray) -> None:
    """Host array → device buffer; on CUDA from pinned memory, without waiting."""
    src = torch.from_numpy(host)
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
