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

``--ep N`` makes it an expert-parallel group of N ranks (``engine.ep``): this process
starts its host's ranks, one process each (``ferry worker`` again, with the rank, its
device, its address and the rendezvous added to the command line), and watches them.
Each rank is a worker of its own to the frontends, ``<name>/r<rank>``, listening on
``--listen``'s port plus its place on this host (or a free port each with port 0), and
joins them as any worker does; their ready messages name the group, so a frontend takes
the whole group out of rotation when one rank is gone. On one host (the default) the
ranks meet through a file in a private directory; a group that spans hosts runs one
``ferry worker --ep N`` per host, each told its place (``--ep-node-rank K``: it runs ranks
``K*M`` to ``K*M+M-1``, M being ``--ep-local-ranks``) and where the group meets
(``--ep-leader HOST:PORT``, served by node 0). A group lives and dies whole: when a rank
exits with an error this process kills its other ranks and exits with an error too (the
other hosts' ranks see their collectives fail and do the same), for whatever restarts
workers (a LeaderWorkerSet recreates the group). SIGTERM or SIGINT drains every rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from engine import logs
from engine.config import EngineConfig
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
    me.add_argument("--ep", type=serve.int_at_least(1), default=1, metavar="N",
                    help="an expert-parallel group of N ranks, one process each (one per GPU "
                         "with --device cuda), each a worker <name>/r<rank> listening on "
                         "--listen's port + its place on this host (default: %(default)s)")
    me.add_argument("--ep-node-rank", type=serve.int_at_least(0), default=0, metavar="K",
                    help="a group spanning hosts: this host's place, running ranks K*M to "
                         "K*M+M-1 (M: --ep-local-ranks; default: %(default)s)")
    me.add_argument("--ep-leader", metavar="HOST:PORT",
                    help="a group spanning hosts: where its ranks meet (node 0 serves it)")
    me.add_argument("--ep-local-ranks", type=serve.int_at_least(1), metavar="M",
                    help="ranks on this host (default: all N; with --ep-leader on CUDA, one "
                         "per visible GPU)")
    p.add_argument("--ep-rank", type=int, help=argparse.SUPPRESS)  # one rank, as started
    p.add_argument("--ep-rendezvous", help=argparse.SUPPRESS)  # by its host's group
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
    if args.ep > 1 and args.ep_rank is None:
        return run_group(args, name)
    group = None
    if args.ep_rank is not None:
        from engine.worker.config import GroupMember

        group = GroupMember(name, args.ep_rank, args.ep, args.ep_rendezvous,
                            _group_host(args))  # fmt: skip
        name = f"{name}/r{args.ep_rank}"
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
                          listen=channel.address, name=name, redis_url=args.redis or "",
                          exit_with_parent=group is not None, group=group)  # fmt: skip
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
    return serve_role(role, config, channel, secret, drain)


def _group_host(args: argparse.Namespace) -> str:
    """The address a rank's group connections bind: loopback for a group on one host, else
    the host of ``--listen`` (or this host's name's, when that is every interface)."""
    if not args.ep_leader:
        return "127.0.0.1"
    host = args.listen.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::", "*") else host


def _rank_plan(args: argparse.Namespace) -> tuple[range, list[str], list[str]]:
    """This host's ranks, their devices and their listen addresses."""
    device = args.device or EngineConfig.device
    local = args.ep_local_ranks
    if local is None:
        local = args.ep
        if args.ep_leader and device == "cuda":
            import torch

            local = torch.cuda.device_count()
    first = args.ep_node_rank * local
    if local < 1 or first + local > args.ep:
        raise SystemExit(f"ferry worker: ranks {first}..{first + local - 1} are not in a group "
                         f"of {args.ep} (--ep, --ep-node-rank, --ep-local-ranks)")  # fmt: skip
    if local < args.ep and not args.ep_leader:
        raise SystemExit("ferry worker: a group whose ranks are on other hosts too needs "
                         "--ep-leader HOST:PORT")  # fmt: skip
    if device == "cuda":
        devices = [f"cuda:{i}" for i in range(local)]
    elif device.startswith("cuda") and local > 1:
        raise SystemExit(f"ferry worker: {local} ranks need as many GPUs, one per rank: "
                         f"--device cuda, not {device}")  # fmt: skip
    else:
        devices = [device] * local
    scheme_host, _, port = args.listen.rpartition(":")
    if not port.isdigit():
        raise SystemExit(f"ferry worker: --ep needs a tcp://HOST:PORT --listen, not {args.listen}")
    ports = [0] * local if int(port) == 0 else [int(port) + i for i in range(local)]
    return range(first, first + local), devices, [f"{scheme_host}:{p}" for p in ports]


def run_group(args: argparse.Namespace, name: str) -> int:
    """Start this host's ranks of the group ``name`` and watch them (module docstring);
    the exit status is 0 only if every rank's is."""
    ranks, devices, addresses = _rank_plan(args)
    logs.configure(serve.log_config(args), name)
    private = None
    if args.ep_leader:
        rendezvous = f"tcp://{args.ep_leader}"
    else:
        private = tempfile.mkdtemp(prefix="ferry-ep-")  # only its owner can read it
        rendezvous = os.path.join(private, "group.rendezvous")
    argv = list(sys.argv[1:])  # as it was started; what follows wins
    procs = {}
    for rank, device, address in zip(ranks, devices, addresses):
        extra = ["--name", name, "--ep-rank", str(rank), "--ep-rendezvous", rendezvous,
                 "--device", device, "--listen", address]  # fmt: skip
        procs[rank] = subprocess.Popen([sys.executable, "-m", "server.cli", *argv, *extra])
    log.info("%s worker %s: ranks %d..%d of %d started (pids %s)", args.role, name,
             ranks[0], ranks[-1], args.ep, [p.pid for p in procs.values()])  # fmt: skip

    def drain(*_: Any) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain)
    failed = False
    try:
        while any(p.poll() is None for p in procs.values()):
            dead = [r for r, p in procs.items() if p.poll() not in (None, 0)]
            if dead and not failed:
                failed = True
                log.error("rank %d of %s exited with %d: stopping the group's other ranks",
                          dead[0], name, procs[dead[0]].returncode)  # fmt: skip
                for proc in procs.values():
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(0.2)
    finally:
        for proc in procs.values():  # this process is going: so is the group
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if private is not None:
            import shutil

            shutil.rmtree(private, ignore_errors=True)
    return 0 if all(p.returncode == 0 for p in procs.values()) else 1


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
