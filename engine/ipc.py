"""The worker side of a frontend channel: requests in over PULL, results out over PUSH."""

from __future__ import annotations

import zmq


def worker_sockets(input_addr: str, output_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Connect to the frontend's bound sockets; returns (inbox, outbox)."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    return inbox, outbox
