"""The encode worker: ``python -m encode.worker``, a role of the worker shell.

It loads a vision-language model's vision tower alone (``engine.loader.load_vision_model``:
no language-model weights are read) and answers ``EncodeRequest``s: each step takes the
queued images (up to ``ENCODE_BATCH_TOKENS`` tokens), finds the embeddings of each in its
cache by content hash (``encode.cache``: memory, then files), decodes and preprocesses
the rest (transformers' image processor, ``engine.vision``) and runs them through the
tower in one forward, keeps them in the cache, and sends every image's blocks into the
prefill worker's inbox blocks named by the request (``KVDestination``) through the KV
transport, on a thread of its own. Every request ends in exactly one ``Encoded`` or
``EncodeFailed``, sent once its send is over; a bad image fails alone (its batch goes
on), and nothing a request carries can stop the worker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from encode.cache import EmbeddingCache, FileTierConfig, Hit
from encode.messages import CODEC, Encoded, EncodeFailed, EncodeRequest
from engine.config import EngineConfig
from engine.kv_cache.block_pool import Block
from engine.loader import load_vision_model
from engine.media import ENCODE_BATCH_TOKENS, blocks_for, embedding_layout
from engine.messages import Abort, EngineStats, WorkerReady, WorkerStats
from engine.vision import MAX_DECODE_PIXELS, DecodedImage, ImageError, VisionEncoder, decode_image
from engine.worker.config import WorkerConfig
from engine.worker.shell import Outbox, WorkerRole, main
from kvstore.transport import TransferStats, get_transport

log = logging.getLogger("ferry.encode")

DEFAULT_CACHE_GB = 1.0  # embedding memory of an encode worker without --kv-cache-memory-gb
_SENDING_POLL_MS = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Send:
    request: EncodeRequest
    blocks: list[Block]
    future: Future[TransferStats]
    cache: str
    encode_seconds: float


class EncodeWorker(WorkerRole):
    role = "encode"
    codec = CODEC

    def __init__(self, config: WorkerConfig, secret: str) -> None:
        engine = config.engine
        if engine.num_threads > 0:
            torch.set_num_threads(engine.num_threads)
        dtype = _DTYPES[engine.dtype]
        vision = load_vision_model(engine.model, engine.device, dtype, seed=engine.seed)
        self.model_name = vision.name
        self.device = engine.device
        self.encoder = VisionEncoder(vision.tower, vision.processor, MAX_DECODE_PIXELS)
        self.fingerprint = f"{vision.config.fingerprint}:{vision.processor.key.decode()}"
        layout = embedding_layout(vision.config.vision.out_hidden_size, dtype)
        transport = get_transport(config.transfer.transport, secret=secret)
        cache = transport.allocate_cache(layout, _num_blocks(engine, layout.bytes_per_block),
                                         engine.device)  # fmt: skip
        self.cache = EmbeddingCache(cache, self.fingerprint, _files(engine))
        self.sender = transport.sender(cache)
        self.timeout = config.transfer.timeout_s
        self.queue: deque[EncodeRequest] = deque()
        self.sends: list[_Send] = []
        self.tokens_per_s = 0.0
        self.lookups = self.hit_tokens = self.looked_up_tokens = 0
        self._out = Outbox()
        self._touched = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="embed-send")

    def ready(self) -> WorkerReady:
        pool = self.cache.pool
        layout = self.cache.kv.layout
        return WorkerReady(self.role, pool.num_blocks, self.cache.block_size, 0, self.model_name,
                           self.cache.extra, device=self.device,
                           kv_cache_bytes=pool.num_blocks * layout.bytes_per_block)  # fmt: skip

    @property
    def busy(self) -> bool:
        # sends in flight do not make it busy: the shell then polls every
        # _SENDING_POLL_MS and ticks (collecting finished sends) instead of spinning on
        # step(), which took a core from the frontend and the prefill worker
        return bool(self.queue)

    @property
    def settled(self) -> bool:
        return not self.queue and not self.sends

    @property
    def wait_ms(self) -> int:
        return _SENDING_POLL_MS if self.sends else super().wait_ms

    # -- messages ---------------------------------------------------------------------------

    def handle(self, msg: msgspec.Struct) -> EncodeRequest | None:
        self._touched = True
        if isinstance(msg, Abort):
            dropped = set(msg.request_ids)
            for req in [r for r in self.queue if r.request_id in dropped]:
                self.queue.remove(req)
                self._fail(req, "aborted", aborted=True)
            return None
        self.queue.append(msg)
        return msg

    def _fail(self, req: EncodeRequest, error: str, retry: bool = False,
              aborted: bool = False) -> None:  # fmt: skip
        self._out.replies.append((EncodeFailed(req.request_id, error, retry, aborted), True))

    # -- steps ------------------------------------------------------------------------------

    def step(self) -> Outbox:
        batch = self._take()
        if batch:
            self._touched = True
            self._encode(batch)
        return self.tick()

    def tick(self) -> Outbox:
        self._collect()
        out, self._out = self._out, Outbox()
        if self._touched or out.replies:
            out.stats = self.stats()
        self._touched = False
        return out

    def _take(self) -> list[EncodeRequest]:
        """Queued requests for one step: up to ``ENCODE_BATCH_TOKENS`` image tokens whose
        blocks fit the cache now (the rest waits for sends to free theirs)."""
        batch: list[EncodeRequest] = []
        tokens = blocks = 0
        while self.queue:
            req = self.queue[0]
            need = blocks_for(req.num_tokens, self.cache.block_size)
            if batch and (tokens + req.num_tokens > ENCODE_BATCH_TOKENS
                          or blocks + need > self.cache.pool.num_free):  # fmt: skip
                break
            if need > self.cache.pool.num_usable:
                self.queue.popleft()
                self._fail(req, f"an image of {req.num_tokens} tokens does not fit the "
                                "embedding cache")  # fmt: skip
                continue
            if need > self.cache.pool.num_free:
                break  # wait for running sends to give blocks back
            batch.append(self.queue.popleft())
            tokens += req.num_tokens
            blocks += need
        return batch

    def _encode(self, batch: list[EncodeRequest]) -> None:
        started = time.perf_counter()
        misses: list[tuple[EncodeRequest, DecodedImage]] = []
        for req in batch:
            self.lookups += 1
            self.looked_up_tokens += req.num_tokens
            hit = self.cache.lookup(req.content_hash, req.num_tokens)
            if hit is not None:
                self.hit_tokens += req.num_tokens
                self._send(req, hit, 0.0)
                continue
            try:
                image = decode_image(req.data, MAX_DECODE_PIXELS)
            except ImageError as exc:
                self._fail(req, f"image: {exc}")
                continue
            grid = self.encoder.processor.grid(image.width, image.height)
            if self.encoder.processor.num_tokens(grid) != req.num_tokens:
                self._fail(req, f"the image takes {self.encoder.processor.num_tokens(grid)} "
                                f"tokens here, not {req.num_tokens}: the frontend's image "
                                "processor settings differ from this worker's")  # fmt: skip
                continue
            misses.append((req, image))
        if not misses:
            return
        try:
            rows = self.encoder.encode_decoded([image for _, image in misses])
        except Exception as exc:  # noqa: BLE001 - the tower failing must not end the worker
            log.exception("encoding a batch of %d images failed", len(misses))
            for req, _ in misses:
                self._fail(req, f"encoding failed: {type(exc).__name__}: {exc}", retry=True)
            return
        seconds = time.perf_counter() - started
        tokens = sum(req.num_tokens for req, _ in misses)
        rate, old = tokens / max(seconds, 1e-9), self.tokens_per_s
        self.tokens_per_s = 0.8 * old + 0.2 * rate if old else rate
        for (req, _), embeddings in zip(misses, rows):
            blocks = self.cache.store(req.content_hash, embeddings)
            self._send(req, Hit(blocks, ""), seconds / len(misses))

    def _send(self, req: EncodeRequest, hit: Hit, encode_seconds: float) -> None:
        dest = req.destination
        if len(dest.block_ids) != len(hit.blocks):
            self.cache.release(hit.blocks)
            self._fail(req, f"{len(hit.blocks)} embedding blocks for {len(dest.block_ids)} "
                            "reserved")  # fmt: skip
            return
        if time.time() > dest.deadline:
            self.cache.release(hit.blocks)
            self._fail(req, "the prefill worker's deadline for this image has passed")
            return
        src = [b.block_id for b in hit.blocks]
        future = self._pool.submit(self.sender.send, dest.endpoint, req.request_id, src,
                                   list(dest.block_ids), self.timeout)  # fmt: skip
        self.sends.append(_Send(req, hit.blocks, future, hit.tier, encode_seconds))

    def _collect(self) -> None:
        for send in [s for s in self.sends if s.future.done()]:
            self.sends.remove(send)
            self.cache.release(send.blocks)
            req = send.request
            try:
                stats = send.future.result()
            except Exception as exc:  # TransferError, or anything the backend raised
                log.warning("sending the embeddings of %s failed: %s", req.request_id, exc)
                self._fail(req, f"embedding transfer failed: {exc}", retry=True)
                continue
            done = Encoded(req.request_id, send.cache, send.encode_seconds, stats.num_bytes,
                           stats.seconds)  # fmt: skip
            self._out.replies.append((done, True))

    def stats(self) -> WorkerStats:
        pool = self.cache.pool
        engine = EngineStats(
            num_running=len(self.sends), num_waiting=len(self.queue),
            kv_blocks_used=pool.num_usable - pool.num_free, kv_blocks_total=pool.num_usable,
            prefix_query_tokens=self.looked_up_tokens, prefix_hit_tokens=self.hit_tokens,
        )  # fmt: skip
        return WorkerStats(engine, len(self.sends), self.cache.drain_events(), self.tokens_per_s,
                           self.draining)  # fmt: skip

    def check_integrity(self) -> None:
        self.cache.check_integrity([s.blocks for s in self.sends])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sender.close()
        self.cache.close()


def _num_blocks(engine: EngineConfig, bytes_per_block: int) -> int:
    gb = engine.cache.memory_gb or DEFAULT_CACHE_GB
    return max(2, int(gb * 2**30) // bytes_per_block + 1)


def _files(engine: EngineConfig) -> FileTierConfig:
    cache = engine.cache
    return FileTierConfig(cache.kv_dir, int(cache.file_capacity_gb * 2**30),
                          cache.file_ttl_hours * 3600.0, cache.file_mode)  # fmt: skip


if __name__ == "__main__":
    main(EncodeWorker)
