"""``ferry serve``: prefill and decode workers (or one engine) behind the OpenAI server.

By default the frontend runs one prefill and one decode worker process and moves KV
between them (``--prefill N --decode M``, ``--kv-transport``); ``--aggregated`` runs one
engine process that does both.

Flags (and a topology file, ``--config``: ``server.topology``) build a frozen
``EngineConfig``, ``PDConfig`` and ``ServerConfig``. Before anything starts, the model
is checked and the ports are bound, so a bad ``--model`` or a taken port is one line at
once. Then the engines start — each worker says what runs where when it is ready — and
uvicorn serves the app until SIGINT/SIGTERM. Once it serves, stdout says ``ferry: serving
<model> on http://<host>:<port>`` (the real port, also with ``--port 0``), ``ferry:
control plane on <url>`` and whether it is ready (``engine.logs.announce``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from encode.inputs import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    MediaLimits,
)
from engine import envs, heap, logs
from engine.config import (
    SPEC_SCHEDULES,
    CacheConfig,
    EngineConfig,
    ExpertParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from engine.kv_cache.sizing import available_memory_bytes, host_tier_bytes
from engine.logs import FORMATS, LogConfig
from engine.worker.config import TransferConfig
from router.config import PDConfig
from router.policies import POLICIES
from server.body import DEFAULT_MAX_BODY_MB
from server.cli import (
    int_at_least,
    int_in,
    number_at_least,
    positive_int,
    positive_number,
    tcp_port,
)
from server.config import MAX_TOKENS_DEFAULT, ServerConfig
from server.topology import section

# The decode kernel reads a 128-token block as one tile; 16-token blocks run it 2.3x
# slower at batch 64 (bench/README.md, GPU). The CPU keeps the finer prefix-cache grain.
CUDA_BLOCK_SIZE = 128
DEFAULT_SPECULATIVE_TOKENS = 3  # K when --speculative is given without --num-speculative-tokens
MAX_SPECULATIVE_TOKENS = 16  # SpeculativeConfig's bound on K
# What the engine takes (engine.core._DTYPES, engine.spec.DRAFTERS), named here so that
# the frontend checks them at parse time without importing torch
DTYPES = ("float32", "bfloat16", "float16")
DRAFTERS = ("ngram", "mtp")  # and draft:PATH
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# On the CPU the KV cache is sized for two contexts of this many tokens unless told (the
# default model's own 8k would be 0.75 GB of float32 KV per worker, this 0.19 GB).
CPU_MAX_MODEL_LEN = 2048

log = logging.getLogger("ferry.server")


USAGE = "%(prog)s [--config FILE] [--model PATH|default|dummy:PRESET] [options]"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI API", usage=USAGE,
                              description="Serve a model over the OpenAI API: the HTTP "
                              "frontend and the workers behind it.")  # fmt: skip
    add_config_flag(p)
    add_engine_flags(p)
    section(p, "model").add_argument(
        "--served-model-name", help="model id clients see (default: the file or folder name)"
    )
    api = section(p, "server", "the HTTP API")
    api.add_argument("--host", default=ServerConfig.host, help="address to listen on")
    api.add_argument("--port", type=tcp_port, default=ServerConfig.port,
                     help="0 picks a free port")
    api.add_argument("--api-key", help=f"require this bearer key on /v1/* (or "
                     f"${envs.API_KEY.name}; default: none)")  # fmt: skip
    add_api_flags(api)
    add_media_flags(section(p, "images", "what a request's images may be (vision-language "
                            "models)"))
    control = section(p, "control", "the control plane (workers, not clients, use it)")
    control.add_argument("--internal-host", default=ServerConfig.internal_host,
                         help="address of the listener workers announce themselves to")
    control.add_argument("--internal-port", type=tcp_port,
                         help="its port (default: --port + 1; a free one with --port 0)")
    add_secret_flag(control)
    control.add_argument("--redis", metavar="URL", help="share workers and KV events with "
                         "other frontends through Redis (default: none)")  # fmt: skip
    pools = section(p, "pools", "the workers this frontend starts (default: 1 prefill + 1 decode)")
    pools.add_argument("--aggregated", action="store_true",
                       help="one engine process does prefill and decode (no KV transfer)")
    pools.add_argument("--prefill", type=int_at_least(0), default=PDConfig.num_prefill,
                       metavar="N",
                       help="prefill workers to start (more may join: ferry worker)")
    pools.add_argument("--decode", type=int_at_least(0), default=PDConfig.num_decode,
                       metavar="M",
                       help="decode workers to start (more may join: ferry worker)")
    pools.add_argument("--encode", type=int_at_least(0), metavar="E",
                       help="encode workers to start, which run the vision tower of a "
                            "vision-language model (default: 1 for such a model, 0 for a "
                            "text model; 0: the prefill workers encode images themselves)")
    pools.add_argument("--router-policy", choices=sorted(POLICIES), default=PDConfig.policy,
                       help="how the prefill and the decode worker of a request are chosen")
    pools.add_argument("--prefill-ep", type=int_at_least(1), default=PDConfig.prefill_ep,
                       metavar="N", help="each prefill worker is an expert-parallel group of N "
                       "rank processes (one per GPU with --device cuda)")
    pools.add_argument("--decode-ep", type=int_at_least(1), default=PDConfig.decode_ep,
                       metavar="N", help="each decode worker is an expert-parallel group of N "
                       "rank processes (one per GPU with --device cuda)")
    add_transfer_flags(section(p, "transfer", "how KV moves from prefill to decode workers"))
    pools.add_argument("--restart-workers", action=argparse.BooleanOptionalAction,
                       default=PDConfig.restart_workers,
                       help="start a worker this frontend spawned again when it dies or hangs")
    pools.add_argument("--worker-silence-timeout", type=positive_number, metavar="S",
                       default=PDConfig.silence_timeout_s,
                       help="a worker unheard this long is hung: a spawned one is killed (and "
                       "restarted), one that joined is out of rotation until heard again")
    return p  # fmt: skip


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="a topology file (YAML): its sections are "
                   "the option groups below, its keys their flags without the dashes; flags "
                   "given on the command line override it (server.topology)")  # fmt: skip


def log_level(value: str) -> str:
    """A level's name in any case; ``warn`` is ``warning``, as ``$FERRY_LOG_LEVEL`` and
    ``logging`` take it."""
    value = value.lower()
    return "warning" if value == "warn" else value


def add_log_flags(group: Any) -> None:
    group.add_argument("--log-level", type=log_level, choices=LOG_LEVELS, metavar="LEVEL",
                       help=f"{', '.join(LOG_LEVELS)} (default: ${envs.LOG_LEVEL.name} or "
                            f"{envs.LOG_LEVEL.default})")  # fmt: skip
    group.add_argument("--log-format", choices=FORMATS,
                       help="text for people, json for log collectors (one object per line), "
                            "for this process and the workers it starts (default: "
                            f"${envs.LOG_FORMAT.name} or {envs.LOG_FORMAT.default})")  # fmt: skip


def log_config(args: argparse.Namespace) -> LogConfig:
    """``--log-level`` / ``--log-format``, else their environment variables (a bad value
    there is one line naming the variable)."""
    level = (args.log_level or envs.LOG_LEVEL.get()).lower()
    try:
        return LogConfig(level, (args.log_format or envs.LOG_FORMAT.get()).lower())
    except ValueError as exc:
        var = envs.LOG_FORMAT if "format" in str(exc) else envs.LOG_LEVEL
        raise SystemExit(f"ferry: ${var.name}: {exc}") from None


def add_api_flags(p: Any) -> None:
    """What the HTTP API takes and what it does when a request leaves a value open
    (``ServerConfig``)."""
    p.add_argument("--max-body-mb", type=number_at_least(1e-3), default=DEFAULT_MAX_BODY_MB,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--max-tokens-default", type=int_at_least(0), default=MAX_TOKENS_DEFAULT,
                   metavar="N", help="output tokens of a request without max_tokens (0: fill "
                   f"the context; default {MAX_TOKENS_DEFAULT})")
    p.add_argument("--max-tokens-limit", type=int_at_least(1), metavar="N",
                   help="most tokens any request generates; one asking for more gets N "
                        "(default: as many as the context holds)")
    p.add_argument("--max-queued-requests", type=int_at_least(1),
                   default=ServerConfig.max_queued_requests, metavar="N",
                   help="sequences that may wait for their first token; more get 429")
    p.add_argument("--max-queued-tokens", type=int_at_least(1),
                   default=ServerConfig.max_queued_tokens, metavar="N",
                   help="prompt tokens that may wait for a first token; more get 429")
    p.add_argument("--request-timeout", type=number_at_least(0.0),
                   default=ServerConfig.request_timeout_s, metavar="S",
                   help="seconds one request may run before it ends with an error (0: none)")
    p.add_argument("--drain-timeout", type=number_at_least(0.0),
                   default=ServerConfig.drain_timeout_s, metavar="S",
                   help="on SIGTERM or Ctrl-C: seconds requests in flight may take to finish")
    p.add_argument("--response-store-size", type=int_at_least(0),
                   default=ServerConfig.response_store_size, metavar="N",
                   help="Responses API: stored responses kept for previous_response_id")
    p.add_argument("--response-store-ttl", type=number_at_least(0.0),
                   default=ServerConfig.response_store_ttl_s, metavar="S",
                   help="Responses API: seconds a stored response is kept")  # fmt: skip


def add_media_flags(p: Any) -> None:
    """What a request's images may be (``encode.inputs.MediaLimits``)."""
    p.add_argument("--max-image-mb", type=number_at_least(1e-3),
                   default=DEFAULT_MAX_IMAGE_BYTES / 2**20,
                   help="largest image file accepted (decoded from its data URL, or fetched)")
    p.add_argument("--max-image-pixels", type=int_at_least(1), default=DEFAULT_MAX_IMAGE_PIXELS,
                   metavar="N", help="most pixels of one image (read from its header, before "
                   "it is decoded)")
    p.add_argument("--max-images-per-request", type=int_at_least(1), default=DEFAULT_MAX_IMAGES,
                   metavar="N", help="most images in one request, over all its messages")
    p.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="HOST",
                   help="hosts (and their subdomains) whose http(s) image URLs are fetched; "
                   "none by default: only data URLs are read, file:// never")
    p.add_argument("--media-fetch-timeout", type=number_at_least(1e-3),
                   default=DEFAULT_FETCH_TIMEOUT_S, metavar="S",
                   help="seconds fetching one image URL may take")  # fmt: skip


def add_secret_flag(group: Any) -> None:
    group.add_argument("--cluster-secret", metavar="SECRET",
                       help="the secret every frontend and worker of a deployment proves to "
                            f"the others (or ${envs.CLUSTER_SECRET.name}; default: one made "
                            "up for the workers this frontend starts)")


def cluster_secret(args: argparse.Namespace, needs_shared: str | None = None) -> str:
    """``--cluster-secret`` or ``$FERRY_CLUSTER_SECRET``; else, unless ``needs_shared``
    says why other processes must know it, a fresh random one."""
    from kvstore.auth import make_secret

    secret = args.cluster_secret or envs.CLUSTER_SECRET.get()
    if secret:
        return secret
    if needs_shared:
        raise SystemExit(f"ferry: {needs_shared} needs a cluster secret that every frontend "
                         f"and worker shares: give each --cluster-secret or "
                         f"${envs.CLUSTER_SECRET.name}")  # fmt: skip
    return make_secret()


def add_transfer_flags(group: Any) -> None:
    """How KV moves between workers: a frontend passes these to the workers it starts; a
    worker started on its own (``ferry worker``) takes them itself."""
    group.add_argument("--kv-transport", choices=["shm", "tcp", "nccl", "cuda_ipc"],
                       help="how KV moves from prefill to decode workers (default: shm on "
                            "the CPU; on CUDA cuda_ipc when the workers share a GPU, nccl "
                            "when they are spread over several; tcp across hosts)")
    group.add_argument("--local-prefill-tokens", type=int_at_least(0),
                       default=TransferConfig.local_prefill_tokens,
                       help="a decode worker prefills a prompt itself when at most this many "
                            "of its tokens are not in its prefix cache")
    group.add_argument("--kv-transfer-timeout", type=positive_number,
                       default=TransferConfig.timeout_s,
                       help="seconds a prompt's KV may take to arrive once its prefill has "
                            "started")
    group.add_argument("--kv-queue-timeout", type=number_at_least(0),
                       default=TransferConfig.queue_timeout_s,
                       help="seconds a prompt may wait for a prefill worker to start it "
                            "(its decode worker holds blocks for it meanwhile)")
    group.add_argument("--kv-host", default=TransferConfig.kv_host,
                       help="address the KV receivers of decode workers bind")  # fmt: skip


def add_engine_flags(p: Any) -> None:
    """The flags that make an ``EngineConfig`` (``engine_config``), and the log flags."""
    model = section(p, "model", "the model and where it runs")
    model.add_argument("--model", default=EngineConfig.model, metavar="PATH",
                       help="a GGUF file, a Hugging Face folder, dummy:<preset> (random weights "
                            "at a real shape) or 'default', SmolLM2-135M-Instruct as setup.sh "
                            "installs it (default: %(default)s)")
    model.add_argument("--device", type=device,
                       help=f"cpu, cuda or cuda:N (default: {EngineConfig.device})")
    model.add_argument("--dtype", choices=DTYPES, help="of the weights, activations and KV "
                       f"cache (default: {EngineConfig.dtype})")
    model.add_argument("--max-model-len", type=positive_int, metavar="N",
                       help=f"context length in tokens, at most the model's own (default: "
                            f"the model's own on CUDA, {CPU_MAX_MODEL_LEN} on the CPU)")
    model.add_argument("--cpu-weights", choices=["auto", "fp32", "int8", "int4"],
                       help="CPU matrices: int4 (4-bit projections, 8-bit embeddings; a GGUF's "
                            "own blocks), int8, or fp32 (default: auto, int4 for GGUF)")
    model.add_argument("--quantization", choices=["none", "fp8"],
                       help="fp8: a MoE model's routed experts in FP8 e4m3 with a scale per "
                            "output channel, half their bytes (on CUDA: a Hopper GPU and "
                            "--dtype bfloat16); other "
                            "layers stay in --dtype (default: none)")
    model.add_argument("--threads", type=positive_int,
                       help="torch CPU threads (default: torch's)")
    model.add_argument("--seed", type=int_in(-(2**63), 2**63 - 1),
                       help=f"engine seed for unseeded requests (default: {EngineConfig.seed})")
    engine = section(p, "engine", "batching, the KV cache and kernels")
    engine.add_argument("--block-size", type=positive_int, metavar="N",
                        help="KV cache block size in tokens: any on the CPU, a power of two on "
                             f"CUDA (default: {CUDA_BLOCK_SIZE} on CUDA, "
                             f"{CacheConfig.block_size} on the CPU)")
    engine.add_argument("--kv-cache-memory-gb", type=positive_number, metavar="GB",
                        help="memory for each worker's KV cache (default: two contexts of "
                             "--max-model-len, at most 1)")
    engine.add_argument("--max-num-seqs", type=positive_int, help="most sequences in one batch "
                        f"(default: {SchedulerConfig.max_num_seqs})")
    engine.add_argument("--max-num-batched-tokens", type=positive_int,
                        help="token budget of one step "
                             f"(default: {SchedulerConfig.max_num_batched_tokens})")
    engine.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="plan each step while the previous one runs "
                        "(default: on CUDA)")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="no CUDA graphs (CUDA) or recorded decode programs (CPU): "
                             "run every step eagerly")
    engine.add_argument("--piecewise-graph-tokens", type=int_at_least(0), metavar="N",
                        help="CUDA: steps with prompt tokens of up to N tokens replay CUDA "
                             "graphs between eager attentions; 0: eagerly (default: "
                             f"{EngineConfig.piecewise_graph_tokens})")
    engine.add_argument("--grammar-cache-mb", type=int_at_least(0),
                        help="memory for compiled grammars, LRU "
                             f"(default: {StructuredOutputConfig.grammar_cache_mb})")
    engine.add_argument("--grammar-compile-threads", type=positive_int, help="threads compiling "
                        f"grammars (default: {StructuredOutputConfig.compile_threads})")
    ep = section(p, "ep", "expert-parallel groups of MoE models (--decode-ep, --prefill-ep)")
    ep.add_argument("--ep-redundant-experts", type=int_at_least(0),
                    default=ExpertParallelConfig.redundant_experts, metavar="R",
                    help="extra physical expert slots per group, for replicas of hot experts "
                         "(a multiple of the group's size)")
    ep.add_argument("--eplb-interval", type=int_at_least(0),
                    default=ExpertParallelConfig.eplb_interval, metavar="STEPS",
                    help="rebalance the experts every this many steps (0: never)")
    ep.add_argument("--eplb-window", type=int_at_least(1),
                    default=ExpertParallelConfig.eplb_window, metavar="STEPS",
                    help="the steps whose routed tokens a rebalance counts")
    ep.add_argument("--routing-trace", metavar="DIR",
                    help="record each step's tokens per layer and expert, one file per "
                         "worker rank in DIR (bench/eplb_replay.py replays them)")
    spec = section(p, "speculative", "draft tokens and verify them in one forward")
    spec.add_argument("--speculative", type=drafter, default="none", metavar="DRAFTER",
                      help="who drafts: ngram (prompt lookup), mtp (the model's own "
                           "multi-token-prediction layers), draft:PATH (a small model with "
                           "the target's tokenizer), or none (default)")
    spec.add_argument("--num-speculative-tokens", type=int_in(0, MAX_SPECULATIVE_TOKENS),
                      default=0,
                      metavar="K", help="most drafts verified per request and step "
                                        "(default 3 with a drafter)")
    spec.add_argument("--spec-schedule", choices=list(SPEC_SCHEDULES), default="dynamic",
                      help="dynamic: each step, the verify budget that maximises expected "
                           "accepted tokens per second, to the requests with the most to "
                           "gain; fixed: up to K drafts for every request")
    spec.add_argument("--spec-confidence-temperatures", type=_floats, default=(),
                      metavar="T,T,...",
                      help="per draft position, the temperature calibrating a model "
                           "drafter's confidence: exactly K values (default: 1 each)")
    add_log_flags(section(p, "log", "what this process and its workers log"))
    tiers = section(p, "tiers", "KV tiers below each worker's KV cache")
    tiers.add_argument("--kv-tiers", type=_tier_list,
                       help="which tiers: 'host', 'file', 'host,file' or 'none' (default: "
                            "file on the CPU, host too with --host-kv-cache-gb; host on CUDA, "
                            "file too with --kv-dir)")
    tiers.add_argument("--host-kv-cache-gb", type=number_at_least(0.0),
                       help="host memory per worker for KV blocks evicted from its cache "
                            "(default: 2%% of the memory available at start, shared by the "
                            "workers started, at most 4; on the CPU no host tier unless given)")
    tiers.add_argument("--kv-dir", help="file tier directory, shared by every worker of the "
                       f"machine (default: ${envs.KV_DIR.name} or ~/.cache/ferry/kv)")
    tiers.add_argument("--kv-file-capacity-gb", type=number_at_least(1e-6),
                       default=CacheConfig.file_capacity_gb,
                       help="most bytes of KV files; least recently used go first")
    tiers.add_argument("--kv-file-ttl-hours", type=number_at_least(1e-6),
                       default=CacheConfig.file_ttl_hours, help="a KV file unused this long "
                       "is removed")
    tiers.add_argument("--kv-file-mode", type=_file_mode, default=CacheConfig.file_mode,
                       metavar="OCTAL", help="permission bits of KV block files, which hold "
                       "what prompts computed (default: 600, the owner only)")
    # fmt: skip


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated positive numbers (temperatures)."""
    try:
        return tuple(positive_number(v) for v in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"comma-separated numbers above 0, not "
                                         f"{text!r}") from None  # fmt: skip


def device(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    kind, colon, index = text.partition(":")
    if (kind, colon) == ("cpu", "") or kind == "cuda" and (not colon or index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"cpu, cuda or cuda:N, not {text!r}")


def drafter(text: str) -> str:
    """``--speculative``: ``none``, one of ``DRAFTERS`` or ``draft:PATH``."""
    method, colon, path = text.partition(":")
    if text in ("none", *DRAFTERS) or (method == "draft" and path):
        return text
    raise argparse.ArgumentTypeError(f"{', '.join(DRAFTERS)}, draft:PATH or none, not {text!r}")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """``--speculative`` and its companions; a clear exit on a bad combination."""
    k = args.num_speculative_tokens
    if args.speculative != "none" and not k:
        k = DEFAULT_SPECULATIVE_TOKENS
    try:
        return SpeculativeConfig.parse(
            args.speculative, num_speculative_tokens=k, schedule=args.spec_schedule,
            confidence_temperatures=args.spec_confidence_temperatures,
        )  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"ferry: {exc}") from None


def _tier_list(text: str) -> frozenset[str]:
    names = frozenset(t.strip() for t in text.split(",") if t.strip())
    if names == {"none"}:
        return frozenset()
    if not names or not names <= {"host", "file"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected host, file, host,file or none")
    return names


def _file_mode(text: str) -> int:
    """An octal mode in which the owner reads and writes: 600, 0640, 0o644."""
    from kvstore.tiers.fileio import check_file_mode  # kvstore.tiers loads torch: not at import

    try:
        return check_file_mode(int(text.removeprefix("0o"), 8))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: an octal mode such as 600; {exc}") from None


def default_kv_dir() -> str:
    """``$FERRY_KV_DIR``, else ``ferry/kv`` in the user's cache directory."""
    return envs.KV_DIR.get() or os.path.join(envs.user_cache_dir(), "ferry", "kv")


def _on_cuda(args: argparse.Namespace) -> bool:
    """Whether ``--device`` puts the engines on CUDA (the defaults below differ there)."""
    return (args.device or "cpu").split(":")[0] == "cuda"


def kv_tiers(args: argparse.Namespace) -> frozenset[str]:
    """``--kv-tiers``, or the default for the device. On CUDA a block is 16 MB at the 8B
    shape and writing each one through to local files cut serving throughput 3x on the
    H200 (bench/README.md), so files are used there only when asked for (``--kv-dir``:
    a fast shared file system such as 3FS). On the CPU the KV cache is host memory
    already: a host tier would keep a second copy of evicted blocks in the same memory,
    which the file tier's pages in the OS page cache hold anyway (on the default model it
    filled its 0.2 GB per worker within one benchmark and served 128 tokens of hits), so
    the CPU default is the file tier alone, with the host tier when ``--host-kv-cache-gb``
    gives it a size."""
    if args.kv_tiers is not None:
        return args.kv_tiers
    if not _on_cuda(args):
        return frozenset({"host", "file"}) if args.host_kv_cache_gb else frozenset({"file"})
    return frozenset({"host", "file"}) if args.kv_dir else frozenset({"host"})


def host_tier_gb(args: argparse.Namespace) -> float:
    """``--host-kv-cache-gb``, or each started worker's share of the memory available now
    (``engine.kv_cache.sizing.host_tier_bytes``; ``ferry worker`` counts as one)."""
    if args.host_kv_cache_gb is not None:
        return args.host_kv_cache_gb
    workers = 1
    if not getattr(args, "aggregated", True):
        workers = max(1, args.prefill * args.prefill_ep + args.decode * args.decode_ep
                      + num_encode(args))
    return host_tier_bytes(available_memory_bytes(), workers) / 2**30


def _tier_fields(args: argparse.Namespace) -> dict[str, Any]:
    kv_dir = args.kv_dir or default_kv_dir()
    tiers = kv_tiers(args)
    return {
        "host_memory_gb": host_tier_gb(args) if "host" in tiers else 0.0,
        "kv_dir": os.path.abspath(os.path.expanduser(kv_dir)) if "file" in tiers else "",
        "file_capacity_gb": args.kv_file_capacity_gb,
        "file_ttl_hours": args.kv_file_ttl_hours,
        "file_mode": args.kv_file_mode,
    }


def _given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """Config field → value for the flags the user gave (``fields``: field → flag dest)."""
    picked = {field: getattr(args, dest) for field, dest in fields.items()}
    return {k: v for k, v in picked.items() if v is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    sizes = _given(args, block_size="block_size", memory_gb="kv_cache_memory_gb")
    if args.block_size is None and _on_cuda(args):
        sizes["block_size"] = CUDA_BLOCK_SIZE
    elif _on_cuda(args) and args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size {args.block_size}: on CUDA a power of two (16, 32, 64, "
                         "128, ...), whose blocks the attention kernels' tiles divide")  # fmt: skip
    cache = CacheConfig(**sizes, **_tier_fields(args))
    limits = _given(args, max_num_seqs="max_num_seqs",
                    max_num_batched_tokens="max_num_batched_tokens", max_model_len="max_model_len")
    if args.max_model_len is None and not _on_cuda(args):
        limits["max_model_len"] = CPU_MAX_MODEL_LEN  # the model's own if shorter
    scheduler = SchedulerConfig(**limits)  # fmt: skip
    structured = StructuredOutputConfig(
        **_given(
            args,
            grammar_cache_mb="grammar_cache_mb",
            compile_threads="grammar_compile_threads",
        )
    )
    top = _given(
        args, seed="seed", num_threads="threads", device="device", dtype="dtype",
        cpu_weights="cpu_weights", quantization="quantization", enforce_eager="enforce_eager",
        piecewise_graph_tokens="piecewise_graph_tokens", overlap_scheduling="overlap_scheduling",
    )  # fmt: skip
    ep = ExpertParallelConfig(
        redundant_experts=args.ep_redundant_experts, eplb_interval=args.eplb_interval,
        eplb_window=args.eplb_window,
        routing_trace=os.path.abspath(args.routing_trace) if args.routing_trace else "",
    )  # fmt: skip
    return EngineConfig(
        model=args.model, cache=cache, scheduler=scheduler, structured=structured, ep=ep,
        speculative=speculative_config(args), **top,
    )  # fmt: skip


def kv_transport(args: argparse.Namespace) -> str:
    """``--kv-transport``, or the one for the device: shm between CPU caches; on CUDA
    cuda_ipc (device to device, no host staging) when the workers share one GPU — a
    ``--device cuda:N``, or one GPU visible — and nccl when a bare ``--device cuda``
    spreads them over several (``router.pools.worker_devices``). Workers on other hosts
    need ``--kv-transport tcp``."""
    if args.kv_transport:
        return args.kv_transport
    if not _on_cuda(args):
        return "shm"
    if args.device != "cuda":
        return "cuda_ipc"
    import torch

    return "cuda_ipc" if torch.cuda.device_count() <= 1 else "nccl"


def num_encode(args: argparse.Namespace) -> int:
    """``--encode``, or 1 for a vision-language model and 0 for a text model."""
    if args.encode is not None:
        return args.encode
    from engine.loader import has_vision

    return 1 if has_vision(args.model) else 0


def pd_config(args: argparse.Namespace) -> PDConfig | None:
    """The disaggregated topology, or None with ``--aggregated``."""
    if args.aggregated:
        if args.decode_ep > 1 or args.prefill_ep > 1:
            raise SystemExit("ferry: expert parallelism (--decode-ep, --prefill-ep) runs in the "
                             "disaggregated topology, not with --aggregated")  # fmt: skip
        if args.encode:
            raise SystemExit("ferry: --encode needs the disaggregated topology (the "
                             "--aggregated engine encodes its images itself)")  # fmt: skip
        return None
    return PDConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_encode=num_encode(args),
        transfer=transfer_config(args),
        policy=args.router_policy,
        redis_url=args.redis or "",
        prefill_ep=args.prefill_ep,
        decode_ep=args.decode_ep,
        restart_workers=args.restart_workers,
        silence_timeout_s=args.worker_silence_timeout,
    )


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    """How KV moves, from the transfer flags (``add_transfer_flags``)."""
    return TransferConfig(
        transport=kv_transport(args),
        timeout_s=args.kv_transfer_timeout,
        queue_timeout_s=args.kv_queue_timeout,
        local_prefill_tokens=args.local_prefill_tokens,
        kv_host=args.kv_host,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    if args.port == 65535 and args.internal_port is None:
        raise ValueError("--port 65535 leaves no port for the control plane (--port + 1): "
                         "give --internal-port")  # fmt: skip
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.API_KEY.get(),
        served_model_name=args.served_model_name,
        max_body_mb=args.max_body_mb,
        max_tokens_limit=args.max_tokens_limit,
        max_tokens_default=args.max_tokens_default,
        response_store_size=args.response_store_size,
        response_store_ttl_s=args.response_store_ttl,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        internal_host=args.internal_host,
        internal_port=args.internal_port,
        media=MediaLimits(
            max_image_bytes=int(args.max_image_mb * 2**20),
            max_image_pixels=args.max_image_pixels,
            max_images=args.max_images_per_request,
            allowed_domains=tuple(d.lower().rstrip(".") for d in args.allowed_media_domains),
            fetch_timeout_s=args.media_fetch_timeout,
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Check what can be checked at once (the flags, the model, the ports), then serve.
    Each problem found before the engines start is one line on stderr, exit code 1."""
    logs.configure(log_config(args))
    check_model(args.model)  # before the sizing, which reads the model's config
    try:
        config = server_config(args)
        engine = engine_config(args)
        pd = pd_config(args)
        if engine.quantization != "none":
            from engine.loader import check_quantization, load_model_config

            check_quantization(engine.quantization, load_model_config(args.model),
                               engine.device, engine.dtype, gpu=False)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"ferry serve: {exc}") from None
    check_device(engine.device, pd)
    shared = "--redis (workers shared between frontends)" if pd and pd.redis_url else None
    secret = cluster_secret(args, shared)
    listeners = _bind(config)
    return asyncio.run(serve(config, engine, pd, secret, listeners, args.max_model_len))


def check_device(device: str, pd: PDConfig | None) -> None:
    """Exit with one line when ``--device`` names a GPU that is not there, before anything
    starts (a frontend that starts no workers needs none)."""
    if device == "cpu" or (pd and not (pd.num_prefill or pd.num_decode or pd.num_encode)):
        return
    import torch

    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if not count:
        raise SystemExit(f"ferry: --device {device}, but no GPU is visible (--device cpu runs "
                         "on the CPU)")  # fmt: skip
    if index >= count:
        raise SystemExit(f"ferry: --device {device}, but {count} GPU(s) are visible: "
                         f"cuda:0 to cuda:{count - 1}")  # fmt: skip


def check_model(spec: str) -> None:
    """Exit with one line when ``--model`` names nothing that can load (no file, not a
    GGUF file, an unknown preset), before any process starts; the header alone is read."""
    from engine.loader import model_name

    try:
        model_name(spec)
    except (OSError, ValueError, KeyError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise SystemExit(f"ferry: --model {spec}: {reason}") from None


def _bind(config: ServerConfig) -> tuple[socket.socket, socket.socket]:
    """The public and the control-plane sockets, bound before any model loads (so a taken
    port or a wrong host fails at once, in one line naming the flag)."""
    public = _listen(config.host, config.port, "--host", "--port")
    try:
        control = _listen(config.internal_host, config.control_port, "--internal-host",
                          "--internal-port" if config.internal_port is not None
                          else "--internal-port, by default --port + 1,")  # fmt: skip
    except SystemExit:
        public.close()
        raise
    return public, control


def _listen(host: str, port: int, host_flag: str, port_flag: str) -> socket.socket:
    """A listening socket on ``host:port``; else exit with one line that says which flag
    to change and how."""
    hosts = f"{host_flag} 127.0.0.1 listens on this machine only, 0.0.0.0 on every interface"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        return socket.create_server((host, port))
    except socket.gaierror:
        problem = f"{host_flag} {host} is neither an address nor a name this machine resolves "
        problem += f"({hosts})"
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno == errno.EADDRNOTAVAIL:
            problem = f"{host_flag} {host} is not an address of this machine ({hosts})"
        elif exc.errno == errno.EADDRINUSE:
            problem = (f"{reason}; is another ferry serve running? ({port_flag} picks another "
                       "port, 0 a free one)")  # fmt: skip
        elif exc.errno == errno.EACCES and 0 < port < 1024:
            problem = f"{reason}: ports below 1024 need root ({port_flag} picks another)"
        else:
            problem = f"{reason} ({host_flag} / {port_flag} pick others)"
    raise SystemExit(f"ferry: cannot listen on {host}:{port}: {problem}")


def _servers(public: Any, control: Any, config: ServerConfig) -> tuple[Any, Any]:
    """The public server, which takes SIGINT and SIGTERM as the signal to drain and does
    not raise them again once it has (the process then exits 0), and the control-plane
    listener beside it, which stops when the public one does. A second signal while it
    drains (Ctrl-C again) ends the requests in flight now, but the shutdown stays in order
    (engines stopped, no traceback); only a third forces uvicorn out."""
    import uvicorn

    class PublicServer(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals += 1
            if self.signals == 2:
                logs.announce("stopping now: requests in flight end with an error "
                              "(Ctrl-C again forces the exit)")  # fmt: skip
                return
            super().handle_exit(sig, frame)

        @property
        def hurried(self) -> bool:
            """A second signal came: stop waiting for requests in flight."""
            return self.signals >= 2

        @contextlib.contextmanager
        def capture_signals(self):
            handlers = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    class ControlServer(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()

    level = _quieter(logs.current().level)  # uvicorn logs through ferry's handler
    return (
        PublicServer(uvicorn.Config(public, log_level=level, log_config=None, access_log=False,
                                    timeout_graceful_shutdown=config.drain_timeout_s + 5)),
        ControlServer(uvicorn.Config(control, log_level=level, log_config=None,
                                     access_log=False, lifespan="off")),
    )  # fmt: skip


async def serve(
    config: ServerConfig, engine: EngineConfig, pd: PDConfig | None, secret: str,
    listeners: tuple[socket.socket, socket.socket] | None = None,
    context_asked: int | None = None,
) -> int:  # fmt: skip
    """Start the engines, then serve until SIGINT/SIGTERM; returns the process exit code.
    ``pd``: prefill and decode worker pools; None: one engine process. ``secret``: the
    cluster secret. ``listeners``: the public and control sockets (``_bind``; bound here
    if not given). ``context_asked``: ``--max-model-len`` as given, said to be cut when
    the engines serve less. The control plane starts listening once the engines are
    ready. An engine that cannot start is one line (exit code 1), and so is a signal
    meanwhile."""

    from engine.client import EngineClient
    from router.disagg import DisaggClient
    from server.app import create_app
    from server.control import create_control_app

    public_sock, control_sock = listeners or _bind(config)
    client = EngineClient(engine, secret) if pd is None else DisaggClient(engine, pd, secret)
    began = time.monotonic()
    logs.announce(f"starting {_what_runs(engine, pd)}", model=engine.model,
                  device=engine.device)  # fmt: skip
    if not await _start(client):
        return 1
    if cut := context_cut(context_asked, client.max_model_len):
        logs.announce(cut, level="WARNING", asked=context_asked, context=client.max_model_len)
    app = create_app(config, client)
    server, control = _servers(app, create_control_app(client, secret), config)
    controlling: list[asyncio.Task] = []

    async def lifecycle() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        controlling.append(asyncio.create_task(control.serve(sockets=[control_sock])))
        _announce(server, client, config, control_sock, time.monotonic() - began)
        heap.freeze_startup()  # started: what exists now lives as long as the process
        pauses = heap.pauses()
        while not server.should_exit:
            await asyncio.sleep(0.1)
            pauses.report()
        await _drain(app, client, config, lambda: server.hurried)

    watcher = asyncio.create_task(lifecycle())
    try:
        await server.serve(sockets=[public_sock])
    finally:
        watcher.cancel()
        control.should_exit = True
        await asyncio.gather(watcher, *controlling, return_exceptions=True)
    return 0 if server.started else 1


def context_cut(asked: int | None, served: int) -> str | None:
    """What to say when the engines serve a shorter context than ``--max-model-len``
    asked for (``asked``; None: not given): the model's own is shorter, or the KV cache
    (``--kv-cache-memory-gb``) holds less. ``served`` 0: no worker has said yet."""
    if not asked or not 0 < served < asked:
        return None
    return (f"--max-model-len {asked} is more than the model or its KV cache holds; serving "
            f"a context of {served}")


def _what_runs(engine: EngineConfig, pd: PDConfig | None) -> str:
    from engine.loader import describe

    where = f"{describe(engine.model)} on {engine.device}"
    # what only a first start on a machine does (later ones load the kernels it built)
    once = ("; a first start also builds the GPU kernels (a minute or more; TileLang's cache "
            "keeps them)" if engine.device.startswith("cuda") else
            f"; a first start also builds the CPU kernels into {envs.cpu_kernels_dir()}")
    if pd is None:
        return f"one engine process (--aggregated) for {where}{once}"
    if not pd.num_prefill and not pd.num_decode:
        return f"a frontend for {where}; workers join it (ferry worker)"
    return (f"{pd.num_prefill} prefill + {pd.num_decode} decode worker(s) for {where}, KV over "
            f"{pd.transfer.transport}{once}")  # fmt: skip


async def _start(client: Any) -> bool:
    """Start the engines (``client.start``); False, with one line said, when they cannot
    start or a SIGINT/SIGTERM comes first (what did start is stopped)."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(client.start())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
        return True
    except asyncio.CancelledError:
        logs.announce("stopped while starting")
    except Exception as exc:  # a worker that failed to start says why in its own line
        log.debug("start failed", exc_info=True)
        logs.announce(f"could not start: {exc}", level="ERROR")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    await client.shutdown()
    return False


def _quieter(level: str) -> str:
    """uvicorn's own level: it says nothing at info that ferry's lines do not say."""
    return level if level in ("debug", "trace", "warning", "error", "critical") else "warning"


async def _drain(app: Any, client: Any, config: ServerConfig,
                 hurried: Callable[[], bool]) -> None:  # fmt: skip
    """Shutting down (SIGTERM, Ctrl-C): readiness goes to 503, the listener stops taking
    connections (uvicorn), requests in flight get ``drain_timeout_s`` to finish (unless
    ``hurried()`` turns true: a second signal), and then whatever still runs ends with a
    clean error, before the engines are stopped."""
    app.state.draining = True
    busy = client.num_in_flight
    logs.announce(f"shutting down; {busy} request(s) in flight get up to "
                  f"{config.drain_timeout_s:g} s", in_flight=busy)  # fmt: skip
    deadline = time.monotonic() + config.drain_timeout_s
    while client.num_in_flight and time.monotonic() < deadline and not hurried():
        await asyncio.sleep(0.1)
    if client.num_in_flight:
        client.stop_all("the server is shutting down")


def _announce(server: Any, client: Any, config: ServerConfig, control: socket.socket,
              seconds: float) -> None:  # fmt: skip
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    name = config.served_model_name or client.model_name
    logs.announce(f"serving {name} on http://{host}:{port}", model=name,
                  url=f"http://{host}:{port}")  # fmt: skip
    chost, cport = control.getsockname()[:2]
    logs.announce(f"control plane on http://{chost}:{cport}", url=f"http://{chost}:{cport}")
    if client.is_healthy:
        logs.announce(f"ready in {seconds:.1f} s (/ready answers 200)", seconds=seconds)
    else:
        logs.announce("waiting for workers: /ready answers 503 until a prefill and a decode "
                      "worker have joined", seconds=seconds)  # fmt: skip
