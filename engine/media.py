"""A request's images inside one engine: where their embeddings come from, and where they
stay until the request ends.

- ``MediaGate``: requests whose images this engine encodes itself (their ``MediaItem``s
  carry the image files: the aggregated engine, or a prefill worker with no encode pool)
  wait here, outside the scheduler, as constrained requests wait in ``GrammarGate``;
  ``take_ready`` runs the vision encoder over the images of the waiting requests, a
  batch at a time, and hands back those that are ready. It also keeps the embeddings of
  every request that has them (encoded here, or ``put`` by a role that received them from
  an encode worker) until ``release``: a preempted request recomputes its image tokens
  from them. The runner reads them through ``get``.
- ``embedding_layout``: embeddings as blocks of ``block_size`` rows of one "layer", so
  that the KV transports (``kvstore.transport``) move them and the KV tiers store them,
  unchanged: an encode worker's cache and a prefill worker's inbox are ``KVCache``s of
  this layout.
- ``EmbeddingInbox``: a prefill worker's receiving end: blocks reserved per image,
  written by an encode worker's sender through the transport, read out once landed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.config import EMBED_BLOCK_SIZE
from engine.kv_cache.block_pool import Block, BlockPool
from engine.messages import RequestOutput
from engine.request import Request
from engine.vision import ImageError, VisionEncoder
from kvstore.layout import KVCache, KVCacheLayout, KVComponent
from kvstore.transport.base import KVReceiver, KVTransport

log = logging.getLogger("ferry.engine")

ENCODE_BATCH_TOKENS = 16384  # image tokens one encoder call takes at most (one image more)


def embedding_layout(hidden_size: int, dtype: torch.dtype,
                     block_size: int = EMBED_BLOCK_SIZE) -> KVCacheLayout:  # fmt: skip
    """One image token's embedding per row, ``block_size`` rows per block, one layer."""
    return KVCacheLayout(1, block_size, (KVComponent("embed", (hidden_size,)),), dtype)


def blocks_for(num_tokens: int, block_size: int = EMBED_BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def read_rows(cache: KVCache, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
    """A copy of the first ``num_tokens`` embedding rows held in ``block_ids``."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.storage.device)
    rows = cache.layers[0].index_select(0, ids).reshape(-1, cache.layout.token_width)
    return rows[:num_tokens].clone()


def write_rows(cache: KVCache, block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """Write embedding rows [n, hidden] into ``block_ids`` (the last one's tail is left
    as it was)."""
    size = cache.layout.block_size
    for i, block in enumerate(block_ids):
        part = rows[i * size : (i + 1) * size]
        cache.layers[0][block, : len(part)].copy_(part)


class MediaGate:
    """Requests waiting for their images to be encoded by this engine, and the embeddings
    of every request that has them (see the module docstring)."""

    def __init__(self, encoder: VisionEncoder | None) -> None:
        self.encoder = encoder
        self._waiting: dict[str, Request] = {}
        self._embeddings: dict[str, list[torch.Tensor]] = {}
        self.images_encoded = 0  # cumulative

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        """Encode ``request``'s images (its items carry the files) before it is scheduled."""
        if self.encoder is None:
            raise ValueError("this engine has no vision encoder")
        self._waiting[request.request_id] = request

    def put(self, request_id: str, embeddings: list[torch.Tensor]) -> None:
        """The embeddings of a request's images, one tensor per image, in order."""
        self._embeddings[request_id] = embeddings

    def get(self, request_id: str) -> list[torch.Tensor] | None:
        return self._embeddings.get(request_id)

    def has(self, request_id: str) -> bool:
        return request_id in self._embeddings

    def release(self, request_id: str) -> None:
        self._embeddings.pop(request_id, None)

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)
            self.release(rid)

    def take_ready(self) -> tuple[list[Request], list[RequestOutput]]:
        """Encode the images of waiting requests, in arrival order, up to
        ``ENCODE_BATCH_TOKENS`` image tokens in one forward; returns the requests now
        ready (their items' files dropped) and an error output for each whose image
        could not be decoded."""
        batch: list[Request] = []
        tokens = 0
        for req in self._waiting.values():
            if batch and tokens + sum(m.length for m in req.media) > ENCODE_BATCH_TOKENS:
                break
            batch.append(req)
            tokens += sum(m.length for m in req.media)
        ready, failed = [], []
        for req in batch:
            del self._waiting[req.request_id]
        try:
            encoded = self._encode(batch)
        except ImageError:  # one bad image: find it, encode the rest one by one
            encoded = {}
            for req in batch:
                try:
                    encoded.update(self._encode([req]))
                except ImageError as exc:
                    failed.append(RequestOutput(req.request_id, [], "error", error=f"image: {exc}"))
        for req in batch:
            if req.request_id in encoded:
                self.put(req.request_id, encoded[req.request_id])
                req.media = tuple(m.without_data() for m in req.media)
                ready.append(req)
        return ready, failed

    def _encode(self, requests: list[Request]) -> dict[str, list[torch.Tensor]]:
        assert self.encoder is not None
        files = [m.data for req in requests for m in req.media]
        out = iter(self.encoder.encode(files))
        self.images_encoded += len(files)
        return {req.request_id: [next(out) for _ in req.media] for req in requests}


class EmbeddingInbox:
    """Where an encode worker's sender writes a prefill worker's image embeddings: a
    cache of ``embedding_layout`` blocks that the transport can write into (``receiver``
    gives peers its endpoint), and the pool its blocks are reserved from."""

    def __init__(self, transport: KVTransport, layout: KVCacheLayout, num_blocks: int,
                 device: str, host: str) -> None:  # fmt: skip
        self.cache = transport.allocate_cache(layout, num_blocks, device)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.receiver: KVReceiver = transport.receiver(self.cache, host)
        self.block_size = layout.block_size

    def reserve(self, num_tokens: int) -> list[Block] | None:
        """Blocks for one image of ``num_tokens`` tokens; None while too few are free."""
        need = blocks_for(num_tokens, self.block_size)
        return self.pool.allocate(need) if need <= self.pool.num_free else None

    def read(self, blocks: Sequence[Block], num_tokens: int) -> torch.Tensor:
        return read_rows(self.cache, [b.block_id for b in blocks], num_tokens)

    def free(self, blocks: Sequence[Block]) -> None:
        self.pool.free(list(blocks))

    def close(self) -> None:
        self.receiver.close()
