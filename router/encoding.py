"""One request's images through the encode pool: the frontend's part of the protocol
between a prefill worker, the encode workers and the frontend.

1. A prefill worker without a vision tower of its own asks for the embeddings of a
   request's images (``EmbeddingsWanted``: a destination in its inbox and a transfer id
   per image).
2. For each image the encode pool's policy picks a worker (``Router.choose``: the prefix
   index knows from the encode workers' block events which of them holds the image's
   embeddings; the load is what this frontend has sent each one) and sends it an
   ``EncodeRequest``: the image file (kept here since the request arrived), its content
   hash, its destination. The embeddings go from the encode worker straight into the
   prefill worker's inbox through the KV transport, never through here.
3. ``Encoded`` becomes ``EmbeddingsReady`` to the prefill worker. ``EncodeFailed`` with
   ``retry`` (its send broke) or the death of the encode worker sends the image to one not
   tried yet; a bad image, no encode worker left, the client gone or the destination's
   deadline passed become ``EmbeddingsFailed``. Every image a prefill worker asked for
   gets exactly one of the two answers, since it frees the image's blocks only then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from encode.keys import embedding_keys
from encode.messages import Encoded, EncodeFailed, EncodeRequest
from engine.messages import Abort, MediaItem
from kvstore.transport.base import KVDestination
from prefill.messages import EmbeddingsFailed, EmbeddingsReady, EmbeddingsWanted
from router.metrics import EncodeMetrics
from router.pools import WorkerPools
from router.routing import Router
from router.workers import WorkerProcess

log = logging.getLogger("ferry.router")


@dataclass
class _Image:
    """One image on its way to a prefill worker's inbox."""

    request_id: str  # the prefill's wire id
    index: int
    item: MediaItem  # with its file
    destination: KVDestination
    transfer_id: str
    prefill: WorkerProcess
    trace_id: str = ""  # the HTTP request it belongs to
    started: float = field(default_factory=time.perf_counter)
    encoder: WorkerProcess | None = None
    queued_tokens: int = 0
    tried: set[str] = field(default_factory=set)


class Encoding:
    def __init__(self, pools: WorkerPools, router: Router, metrics: EncodeMetrics) -> None:
        self.pools = pools
        self.router = router
        self.metrics = metrics
        self._images: dict[str, _Image] = {}  # by transfer id

    @property
    def num_in_flight(self) -> int:
        return len(self._images)

    def want(self, prefill: WorkerProcess, msg: EmbeddingsWanted,
             media: Sequence[MediaItem] | None, trace_id: str = "") -> None:  # fmt: skip
        """``prefill`` asks for the images of its request ``msg.request_id``; ``media``:
        the request's images with their files (None: the client has left); ``trace_id``:
        the HTTP request they belong to."""
        for i, (dest, tid) in enumerate(zip(msg.destinations, msg.transfer_ids)):
            if media is None or i >= len(media) or not media[i].data:
                prefill.send(EmbeddingsFailed(msg.request_id, i, "the request is gone"))
                continue
            image = _Image(msg.request_id, i, media[i], dest, tid, prefill, trace_id)
            self._images[tid] = image
            self._dispatch(image)

    def _dispatch(self, image: _Image) -> None:
        live = [w for w in self.pools.live("encode") if w.name not in image.tried]
        if not live:
            self._fail(image, "no live encode worker could encode it")
            return
        if time.time() > image.destination.deadline:
            self._fail(image, "its destination's deadline passed")
            return
        item = image.item
        extra = live[0].ready.hash_extra if live[0].ready else b""
        keys = embedding_keys(extra, item.content_hash, item.length, self.pools.embed_block_size)
        worker, hit = self.router.choose("encode", live, keys, item.length,
                                         block_size=self.pools.embed_block_size)  # fmt: skip
        image.encoder = worker
        image.tried.add(worker.name)
        image.queued_tokens = max(0, item.length - hit)
        worker.inflight += 1
        worker.queued_tokens += image.queued_tokens
        worker.send(EncodeRequest(image.transfer_id, item.data, item.content_hash, item.length,
                                  image.destination, image.trace_id))  # fmt: skip

    def received(self, worker: WorkerProcess, msg: Encoded | EncodeFailed) -> None:
        image = self._images.get(msg.request_id)
        if image is None or image.encoder is not worker:
            return
        self._settle(image)
        if isinstance(msg, Encoded):
            del self._images[msg.request_id]
            seconds = time.perf_counter() - image.started
            self.metrics.delivered(msg.cache, seconds, msg.encode_seconds, msg.num_bytes)
            image.prefill.send(EmbeddingsReady(image.request_id, image.index))
        elif msg.retry and not msg.aborted:
            log.warning("encoding image %d of %s on %s failed (%s); trying another",
                        image.index, image.request_id, worker.name, msg.error)  # fmt: skip
            self.metrics.retries.inc()
            self._dispatch(image)
        else:
            self._fail(image, msg.error)

    def _settle(self, image: _Image) -> None:
        """Its encode worker is done with it: stop counting it there."""
        if image.encoder is not None:
            image.encoder.inflight -= 1
            image.encoder.queued_tokens -= image.queued_tokens
        image.encoder, image.queued_tokens = None, 0

    def _fail(self, image: _Image, error: str) -> None:
        self._images.pop(image.transfer_id, None)
        self.metrics.failures.inc()
        image.prefill.send(EmbeddingsFailed(image.request_id, image.index, error))

    def abort(self, request_id: str) -> None:
        """The client left: stop what the encode workers still have queued of it (each
        image still gets its answer, which the prefill worker waits for)."""
        for image in [i for i in self._images.values() if i.request_id == request_id]:
            if image.encoder is not None:
                image.encoder.send(Abort([image.transfer_id]))

    def died(self, worker: WorkerProcess) -> None:
        """An encode worker died (or went silent): its images go elsewhere. A prefill
        worker died: nobody waits for its images any more."""
        for image in list(self._images.values()):
            if image.encoder is worker:
                self._settle(image)
                self.metrics.retries.inc()
                self._dispatch(image)
            elif image.prefill is worker:
                del self._images[image.transfer_id]
                if image.encoder is not None:
                    image.encoder.send(Abort([image.transfer_id]))
                    self._settle(image)
