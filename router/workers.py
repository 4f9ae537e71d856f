"""A prefill or decode worker as the router sees it: a worker handle
(``engine.worker.handle``: channel, process, health, latest stats) plus the load this
frontend has put on it, which routing reads (``router.routing``)."""

from __future__ import annotations

from engine.worker.handle import WorkerHandle


class WorkerProcess(WorkerHandle):
    # what this frontend has sent it and not yet seen finish (the router's load view)
    inflight: int = 0
    queued_tokens: int = 0
