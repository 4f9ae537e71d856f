"""``ferry worker``: one prefill, decode or encode worker, started on its own, that joins
frontends.

The worker binds its channel (``--listen``, a ZMQ address frontends can reach), loads
the model, and announces itself: to each ``--frontend`` URL (a frontend's control plane,
``POST /internal/workers``, retried until it is accepted) and, with ``--redis``, in the
worker registry there, where every frontend on that Redis finds it
(``kvstore.registry``). Frontends then connect and route requests to it like to the
workers they started themselves. SIGTERM or SIGINT drains it: it tells its frontends to
send nothing new, finishes what it has, and exits. Workers exchange KV directly, so
every worker of a deployment uses the same ``--kv-transport`` (``shm`` only on one host;
``tcp`` across hosts).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from engine import logs
from server import serve
from server.topology import section

log = logging.getLogger("ferry.worker")

_ANNOUNCE_RETRY_S = 1.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("worker", help="run a prefill, decode or encode worker that joins "
                              "frontends",
                              usage="%(prog)s --role prefill|decode|encode [--config FILE] "
                              "[options]",
                              description="Run one prefill, decode or encode worker that joins "
                              "frontends (their control plane, or Redis).")  # fmt: skip
    serve.add_config_flag(p)
    me = section(p, "worker", "this worker")
    me.add_argument("--role", choices=["prefill", "decode", "encode"], required=True,
                    help="what it computes: prompts (prefill), the tokens after (decode), or "
                         "a vision-language model's image embeddings (encode), which go to "
                         "the prefill workers")
    me.add_argument("--vision", action=argparse.BooleanOptionalAction, default=None,
                    help="prefill: run the vision tower here (default: yes for a "
                         "vision-language model; --no-vision when encode workers do it)")
    me.add_argument("--listen", default="tcp://127.0.0.1:0",
                    help="ZMQ address to bind for frontends; port 0 picks a free one")
    me.add_argument("--name", help="unique worker name (default: <role>-<host>-<pid>)")
    me.add_argument("--frontend", action="append", default=[], metavar="URL",
                    help="the control plane of a ferry serve to join, as it prints it "
                         "(ferry: control plane on URL; repeatable)")
    control = section(p, "control", "the control plane (workers, not clients, use it)")
    serve.add_secret_flag(control)
    control.add_argument("--redis", metavar="URL",
                         help="register in this Redis and publish KV events there")
    serve.add_engine_flags(p)
    serve.add_transfer_flags(section(p, "transfer", "how KV moves from prefill to decode "
                                     "workers"))
    return p  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import zmq

    from engine.worker.channel import WorkerChannel
    from engine.worker.config import WorkerConfig
    from engine.worker.shell import serve as serve_role
    from kvstore.auth import bearer_token

    if args.role == "prefill":
        from prefill.worker import PrefillWorker as role
    elif args.role == "decode":
        from decode.worker import DecodeWorker as role
    else:
        from encode.worker import EncodeWorker as role

    name = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    logs.configure(serve.log_config(args), name)
    serve.check_model(args.model)
    try:
        engine, transfer = serve.engine_config(args), serve.transfer_config(args)
    except ValueError as exc:
        raise SystemExit(f"ferry worker: {exc}") from None
    if not args.frontend and not args.redis:
        log.warning("no --frontend and no --redis: no frontend will find this worker")
    secret = serve.cluster_secret(args, "a worker started on its own")
    try:
        channel = WorkerChannel(args.listen, role.codec, secret)
    except zmq.ZMQError as exc:
        raise SystemExit(f"ferry: cannot listen on {args.listen}: {exc}") from None
    if _on_every_interface(channel.address):
        log.warning("listening on every interface (%s): any host that reaches it can try; "
                    "only frontends that prove the cluster secret are heard, and nothing on "
                    "the channel is encrypted", channel.address)  # fmt: skip
    vision = args.role == "encode" or (args.role == "prefill" and args.vision is not False)
    config = WorkerConfig(args.role, engine.replace(vision=vision), transfer,
                          listen=channel.address, name=name,
                          redis_url=args.redis or "")  # fmt: skip
    drain = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: drain.set())
    announcement = {"name": name, "role": args.role, "address": channel.address}
    token = bearer_token(secret)
    for url in args.frontend:
        threading.Thread(target=announce, args=(url, announcement, token, drain),
                         daemon=True).start()  # fmt: skip
    logs.announce(f"{args.role} worker {name} listening on {channel.address}", worker=name,
                  role=args.role, address=channel.address)  # fmt: skip
    serve_role(role, config, channel, secret, drain)
    return 0


def _on_every_interface(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("0.0.0.0", "::", "*")


def announce(url: str, announcement: dict, token: str, stop: threading.Event) -> None:
    """POST the worker to a frontend's control plane until it accepts (it may not be up
    yet); ``url`` is what the frontend printed as its control plane."""
    request = urllib.request.Request(
        url.rstrip("/") + "/internal/workers", json.dumps(announcement).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )  # fmt: skip
    while not stop.is_set():
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                log.info("joined %s (%s)", url, response.status)
                return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                log.error("%s refused this worker: %s", url, exc.read().decode(errors="replace"))
                return
        except OSError:
            pass  # not up yet
        time.sleep(_ANNOUNCE_RETRY_S)
