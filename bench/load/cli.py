"""``ferry bench``: load-test any OpenAI-compatible server, one point or a sweep.

    ferry bench --url http://127.0.0.1:8000 --workload random --concurrency 8 \\
        --num-requests 64 --out results.json   # default: ferry-bench-run-<time>.json here
    ferry bench sweep --url http://127.0.0.1:8000 --concurrency 1,4,16,64 \\
        --num-requests 64 --out sweep.json        # + sweep.png, sweep_{pareto,ttft,itl}.png

The ``ferry`` CLI registers it with :func:`add_parser` and dispatches to :func:`run`;
``python -m bench.load`` takes the same arguments. httpx, matplotlib and the runner are
imported inside :func:`run`, so building the ``ferry`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.load.workloads import ENDPOINTS, SYNTHETIC, WorkloadSpec
from server.cli import int_at_least, number_at_least, positive_int, positive_number

USAGE = "%(prog)s [run|sweep] --url URL (--concurrency N[,N...] | --rate R[,R...]) [options]"
SUMMARY = "load-test an OpenAI-compatible server (streaming chat completions or Responses API)"
DESCRIPTION = SUMMARY[0].upper() + SUMMARY[1:] + "."


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``; its handler is :func:`run`."""
    parser = subparsers.add_parser("bench", help=SUMMARY, description=DESCRIPTION, usage=USAGE)
    configure_parser(parser)
    return parser


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add every ``bench`` argument to ``p``."""
    p.add_argument(
        "mode",
        nargs="?",
        choices=("run", "sweep"),
        default="run",
        help="one load point (default) or a sweep over comma-separated loads",
    )
    p.add_argument("--url", type=_url, required=True,
                   help="server base URL (with or without /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="chat",
        help="send to /v1/chat/completions (default) or, the same conversations, /v1/responses",
    )
    p.add_argument(
        "--workload",
        type=_workload,
        default="random",
        help=f"one of {', '.join(SYNTHETIC)}, or a JSONL file of chat requests",
    )
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--concurrency",
        type=_counts,
        help="closed loop: concurrent users (comma-separated list for a sweep)",
    )
    load.add_argument(
        "--rate",
        type=_floats,
        help="open loop: Poisson arrivals per second (comma-separated list for a sweep)",
    )
    p.add_argument("--num-requests", type=positive_int, default=64,
                   help="requests per load point")
    p.add_argument("--input-len", type=positive_int, default=256,
                   help="prompt (or new message) words")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="max_tokens of each request")
    p.add_argument(
        "--range-ratio",
        type=_ratio,
        default=0.0,
        help="input lengths uniform in input-len * [1-r, 1+r], 0 <= r < 1",
    )
    p.add_argument("--num-prefixes", type=positive_int, default=4,
                   help="shared-prefix: system prompts")
    p.add_argument("--prefix-len", type=positive_int, default=512,
                   help="shared-prefix: prefix words")
    p.add_argument("--turns", type=positive_int, default=4,
                   help="multiturn: turns per conversation")
    p.add_argument(
        "--think-time",
        type=number_at_least(0),
        default=0.5,
        help="multiturn: mean think time between turns (s, exponential)",
    )
    p.add_argument("--image-size", type=_size, default="448x448", metavar="WxH",
                   help="images: the generated images' size in pixels")
    p.add_argument("--images-per-request", type=positive_int, default=1,
                   help="images: per request")
    p.add_argument("--image-seed", type=int, default=0,
                   help="images: which images (the same seed: the same images, a warm cache)")
    p.add_argument("--seed", type=int, default=0,
                   help="which prompts, of which lengths, arriving when (the same seed: the "
                        "same requests)")
    p.add_argument("--slo-ttft-ms", type=positive_number, default=None,
                   help="goodput: TTFT bound (ms)")
    p.add_argument(
        "--slo-itl-ms",
        type=positive_number,
        default=None,
        help="goodput: bound on each request's mean inter-token latency (ms)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to ignore EOS so outputs are exactly --output-len",
    )
    p.add_argument("--warmup", type=int_at_least(0), default=0,
                   help="unrecorded requests before each point")
    p.add_argument("--timeout", type=positive_number, default=600.0,
                   help="per-request timeout (s)")
    p.add_argument(
        "--streams-per-client",
        type=positive_int,
        default=16,
        help="concurrent streams per HTTP client (connection pool)",
    )
    p.add_argument("--label", default=None, help="series name in plots (default: model @ url)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--out", type=Path, help="results JSON path; a sweep writes its plots "
                   "beside it (default: ferry-bench-<run|sweep>-<time>.json here)")


def run(args: argparse.Namespace) -> int:
    """Run the bench described by ``args`` (from :func:`configure_parser`); exit status."""
    from bench.load.stats import SLO, format_summary
    from bench.load.sweep import run_point, run_sweep, write_json, write_sweep

    loads = args.concurrency or args.rate
    if args.workload == "images" and args.endpoint != "chat":
        print("ferry bench: the images workload sends chat completions", file=sys.stderr)
        return 2
    if args.mode == "run" and len(loads) != 1:
        print("ferry bench: give one load value, or use 'ferry bench sweep'", file=sys.stderr)
        return 2
    base = _base_url(args.url)
    model = args.model or _first_model(base, args.api_key)
    out = args.out or Path(f"ferry-bench-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    spec, cfg = _workload_spec(args), _load_config(args, base, model)
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    header = _header(args, base, model, out)
    load_kind = "concurrency" if args.concurrency else "rate"
    if args.mode == "sweep":
        points = run_sweep(spec, cfg, loads, slo, args.warmup)
        label = args.label or f"{model} @ {base}"
        for path in write_sweep(out, header, points, load_kind, label):
            print(f"wrote {path}")
    else:
        point = run_point(spec, cfg, slo, args.warmup)
        print(format_summary(point.summary))
        write_json(out, {**header, **point.to_json(load_kind, with_requests=True)})
    print(f"wrote {out}")
    return 0


def _workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        kind=args.workload, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, turns=args.turns,
        think_time_s=args.think_time, image_width=args.image_size[0],
        image_height=args.image_size[1], images_per_request=args.images_per_request,
        image_seed=args.image_seed,
    )  # fmt: skip


def _load_config(args: argparse.Namespace, base: str, model: str):
    """The first load point's config (a sweep replaces the load for each point)."""
    from bench.load.runner import LoadConfig

    return LoadConfig(
        chat_url=f"{base}/chat/completions", model=model, endpoint=args.endpoint,
        api_key=args.api_key,
        concurrency=int(args.concurrency[0]) if args.concurrency else None,
        rate=args.rate[0] if args.rate else None, seed=args.seed, timeout_s=args.timeout,
        streams_per_client=args.streams_per_client, ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=DESCRIPTION,
                                     usage=USAGE)
    configure_parser(parser)
    return run(parser.parse_args(argv))


def _counts(text: str) -> list[float]:
    """Concurrencies: comma-separated whole numbers of at least 1."""
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be whole numbers: {text}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text}") from e
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"loads must be positive numbers: {text}")
    return values


def _ratio(text: str) -> float:
    value = number_at_least(0)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"an http:// or https:// URL, not {text!r}")
    return text


def _workload(text: str) -> str:
    if text in SYNTHETIC or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"one of {', '.join(SYNTHETIC)}, or a JSONL file; "
                                     f"{text!r} is neither")  # fmt: skip


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a WIDTHxHEIGHT size: {text}") from e
    if min(width, height) < 1:
        raise argparse.ArgumentTypeError(f"image sides must be positive: {text}")
    return width, height


def _base_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _first_model(base: str, api_key: str | None) -> str:
    """The first model the server lists; 'default' if it lists none or cannot be asked."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/models", headers=headers, timeout=30, trust_env=False)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"ferry bench: could not list models ({e!r}); using 'default'", file=sys.stderr)
        return "default"


def _header(args: argparse.Namespace, base: str, model: str, out: Path) -> dict[str, Any]:
    given = {**vars(args), "out": out}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items()}
    config.pop("api_key", None)
    config = {k: v for k, v in config.items() if not callable(v)}
    return {"tool": "ferry bench", **_machine(), "url": base, "model": model, "config": config}


def _machine() -> dict[str, Any]:
    try:
        from bench.common import machine_info
    except ImportError:  # torch missing: benchmarking a remote server from a light machine
        return {}
    return machine_info()
