"""Speculative decoding on one GPU: dynamic verify length vs fixed k = 1..5 vs none.

    python -m bench.spec_decode_gpu --out $OUT/spec_decode_h200.json
    python -m bench.spec_decode_gpu --device cpu --preset tiny --dtype float32 \\
        --concurrency 1,4,16 --waves 1 --output-len 24 --budget-s 300 \\
        --kv-cache-memory-gb 0.5 --prefill-min-requests 4 --min-arm-tokens 0 \\
        --out bench/results/spec_decode_tiny_cpu.json    # a dry run

First the correctness checks: a tiny Llama (``dummy:tiny``) with prompt lookup (fixed
k = 3, dynamic K = 5) against no speculation, greedy, in float32 on the CPU (the share of
equal sequences must be 1); then the timed shape on the device, its random weights, prompt
lookup (fixed k = 3) against no speculation on a short greedy run: the share of equal
tokens (bf16 sums over more rows in another order can flip a near tie, so not exactly 1)
and of equal sequences. (TileLang's kernels take bf16/fp16 only, so the tiny float32
check does not run on CUDA, and a bf16 tiny one would compile kernels of its own.)

Then the timing: the preset (``llama3-8b`` by default, random weights) with its final norm
weight zeroed, so every logit is 0 and greedy decoding always picks token 0. No kernel of a
dense model decides its work from values, so every step costs what it costs with real
weights; what changes is that the right draft is known. ``RatesDrafter`` proposes it with
given per-position acceptance rates: at position j its draw keeps the draft with
probability ``rates[j]`` given the drafts before it were kept (a kept draft is token 0; the
first rejected one is token 1), and it reports ``rates`` as its confidence, the calibrated
drafter the dynamic policy assumes. The verifier is the engine's own. It drafts on the
device behind each step, as the MTP layer does, so the step after a verify step is planned
before its outcome (``--host-drafter``: on the host after each step, and that step waits).

Before the sweep, ``sync_points`` serves 32 prefill-heavy requests at 16 streams with
fixed k = 3 under CUDA's sync debug mode and records where the host waited for the
device (``sync_points`` in the JSON) and what the pinned host allocator did meanwhile
(``pinned_allocations``); the same load again under the profiler gives the CUDA runtime
calls the host made, the longest with where (``runtime_calls``); then 128 decode
requests at 64 streams with fixed k = 3 and with none give a step's host time to plan and
to launch it, with drafts and without, and under cProfile the functions a fixed-3 step
spends it in (``host_profile``). ``--diagnose-only`` stops there; ``--workloads`` picks
the workloads the sweep runs.

One ``EngineCore`` (weights, KV cache and CUDA graphs once) runs every arm: an arm is its
own ``SpecDecoding`` (its policy, cost model and realized-gain guard kept across points,
as a server keeps them) and the drafter or none. Workloads, each at every concurrency
(closed loop): ``decode`` (``--waves`` x the concurrency requests, at least
``--min-decode-tokens`` tokens out in all, short prompts, 128 tokens out: some 500 steps a
point, so the dynamic arm's estimators and guard settle and its exploration and probes are
a small part of the point; at one stream 512 tokens left the arms' acceptance draws ~5 %
apart, as much as what separates them) and ``prefill-heavy``
(``--prefill-waves`` x twice the concurrency, at least ``--prefill-min-requests``,
longer prompts and shorter answers, so that
new prompts' chunks share steps with the others' verification). A point whose requests
yield fewer than ``--min-arm-tokens`` tokens runs again, arms in the reverse order, until
each arm has yielded that many: the eager steps that prefill are issued from the host,
whose speed shifts for seconds at a time on a shared machine (the 32 prefills of one arm
at one stream took 18-20 ms each where another arm's took 11), and one pass of such a
point lasts about that long. Every arm errs alone: its
record holds the error and the run goes on; past ``--budget-s`` (sized so the whole sweep
ends within ~8 minutes on an H200) the points left are recorded as skipped.

Each record holds, beside tok/s: the drafts verified per verifying step and the policy's
budget per step it was asked, the step-cost model's relative error and the acceptance
estimate's mean error, the steps that verified, the guard's blocked and probe steps and
the steps that explored an unmeasured size. Every arm's steps are traced one line each
(``*_trace.jsonl``: arm, point, tokens, drafts, tokens yielded, wall interval, device
time, predicted time, the guard's cumulative blocked and probe counts, the median host
time of a step, the wait the policy prices a step with drafts at, and the host seconds
spent planning the step and launching it, and the decode graph bucket it replayed, 0
where it ran eagerly: ``HostClock``). At the end the
JSON, the PNG and the trace are packed into one ``.tar.gz`` beside the JSON (the trace
lives only there).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import machine_info
from bench.spec_decode import Job, arms, plot, run_arms, run_load
from engine import heap
from engine.attention.base import device_indices
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.plan import StepPlan, StepResult
from engine.sampling_params import SamplingParams
from engine.spec import Drafter, DraftStep, Proposal, register_drafter
from engine.spec.base import Drafting, LaunchStep
from engine.spec.chain import Chained
from engine.spec.manager import SpecDecoding
from engine.spec.ngram import NgramDrafter

RIGHT, WRONG = 0, 1  # the token a model of zero logits picks greedily (ties: the lowest id)


class RatesDrafter(Drafter):
    """Drafts kept with given per-position rates (module docstring). Its draw for a draft
    is a hash of (request id, the draft's position in the sequence), at ~1 us a draw (a
    seeded ``random.Random`` per proposal cost 30 us, 8 ms a step at 256 requests): every
    arm meets the same draw at the same position whatever step drafts it there (common
    random numbers; with a draw per (step start, draft index) instead, the arms' ratios
    at one stream spread ~2x more: ``bench.spec_decode_sim``'s drafter drawn either way
    over 12 seeds).

    ``on_device`` (the default): it drafts on the device behind each step, as the MTP
    layer does (``Drafter.launch``), from the positions the device knows, so the step
    after a verify step is planned before its outcome; False: on the host after each step
    (``propose``), and that step waits. The draws are the same either way."""

    name = "rates"
    sees_every_step = False

    def __init__(self, rates: Sequence[float], on_device: bool = True) -> None:
        super().__init__(len(rates))
        self.rates = list(rates)
        self.on_device = on_device
        self._keys: dict[str, int] = {}
        self._rates: torch.Tensor | None = None

    def drop(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def _rates_on(self, device: torch.device) -> torch.Tensor:
        """The rates on ``device``, copied there once: a tensor made from a list on CUDA
        at each launch waits for the device, and every step after a verify step with it."""
        if self._rates is None or self._rates.device != device:
            self._rates = torch.tensor(self.rates, device=device)
        return self._rates

    def _key(self, request_id: str) -> int:
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = zlib.crc32(request_id.encode()) % _PRIME
        return key

    def propose(self, step: DraftStep) -> dict[str, Proposal]:
        out = {}
        for r in step.requests:
            n = min(r.num_draft, self.max_draft)
            if n <= 0:
                continue
            start = len(r.token_ids)
            key = self._key(r.request_id)
            tokens = [RIGHT] * n
            for j in range(n):
                if _uniform(key, start + j) >= self.rates[j]:
                    tokens[j] = WRONG
                    break
            out[r.request_id] = Proposal(start, tokens, self.rates[:n])
        return out

    def launch(self, step: LaunchStep) -> Drafting:
        ids = [r.request_id for r in step.requests]
        if not ids:
            return Drafting([], Chained(0, []))
        device = step.next_ids.device
        rooms = [min(r.num_draft, self.max_draft) for r in step.requests]
        width = max(rooms)
        rows = [[d for d, room in enumerate(rooms) if room > depth] for depth in range(width)]
        depth_of = [depth for depth, active in enumerate(rows) for _ in active]
        at = [d * width + depth for depth, active in enumerate(rows) for d in active]
        keys, bounds, depth_of, at = device_indices(
            device, [self._key(rid) for rid in ids], step.bounds, depth_of, at)  # fmt: skip
        # the index of each request's first draft: past its last token, as the device has it
        start = bounds - step.back + 1
        j = torch.arange(width, device=device)
        rates = self._rates_on(device)
        fails = _uniform(keys[:, None], start[:, None] + j[None, :]) >= rates[:width]
        first_fail = fails & (fails.long().cumsum(1) == 1)
        tokens = torch.where(first_fail, WRONG, RIGHT).view(-1)[at]  # depth after depth
        chained = Chained.of_flat(len(ids), rows, tokens, rates[depth_of])
        chained.start_copy()
        return Drafting(ids, chained)


_PRIME = (1 << 31) - 1  # the hash's modulus: every product of two of its values fits int64


def _uniform(key, position):
    """A uniform in [0, 1) from ``key`` and ``position`` (host ints, or device tensors that
    broadcast): a few rounds of xor-shift and multiply modulo a 31-bit prime, in integers
    below 2^62, so the host and the device draw the same."""
    x = (key + position * 40503 + 69069) % _PRIME
    for _ in range(3):
        x = x ^ (x >> 13)
        x = (x * 48271) % _PRIME
        x = x ^ (x >> 7)
        x = (x * 16807 + 12345) % _PRIME
    return x / _PRIME


def use(core: EngineCore, spec: SpecDecoding, drafter: Drafter | None) -> EngineCore:
    """``core`` with ``spec`` (verify policy, cost model, counters) and ``drafter``."""
    if core.has_work:
        raise RuntimeError("an arm swapped in while requests run")
    core.scheduler.spec = spec
    core.runner.drafter = drafter if spec.enabled else None
    if core.runner.graphs is not None and core.runner.graphs.captured:
        spec.graphs(max(core.runner.graphs.sizes))
    return core


class HostClock:
    """The host seconds the engine spent planning each step and launching it (queueing
    its forward, sampling and drafting), by plan: ``core``'s scheduler and runner timed
    in place. On the H200 the graph step before an eager step with drafts took its
    outcome 3.5-9 ms late in every arm; these say in which of the two that time goes."""

    def __init__(self, core: EngineCore) -> None:
        self._spans: dict[int, list[float]] = {}
        schedule, launch = core.scheduler.schedule, core.runner.launch

        def timed_schedule() -> StepPlan:
            start = time.perf_counter()
            plan = schedule()
            self._spans[id(plan)] = [time.perf_counter() - start, 0.0, 0]
            return plan

        def timed_launch(plan: StepPlan):
            graphs = core.runner.graphs
            replays = graphs.replays if graphs is not None else 0
            start = time.perf_counter()
            launched = launch(plan)
            spans = self._spans.setdefault(id(plan), [0.0, 0.0, 0])
            spans[1] = time.perf_counter() - start
            if graphs is not None and graphs.replays > replays:
                spans[2] = graphs.replayed_size
            return launched

        core.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        core.runner.launch = timed_launch  # type: ignore[method-assign]

    def take(self, plan: StepPlan) -> tuple[float | None, float | None, int | None]:
        """The plan's (schedule, launch) seconds and the decode graph bucket its forward
        replayed (0: none, eager), once (None: not timed)."""
        spans = self._spans.pop(id(plan), None)
        if spans is None:
            return None, None, None
        return round(spans[0], 6), round(spans[1], 6), spans[2]


class TracedSpecDecoding(SpecDecoding):
    """``SpecDecoding`` that keeps one line per step it observes (module docstring)."""

    def __init__(self, *args, arm: str = "", host_clock: HostClock | None = None,
                 **kwargs) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.arm = arm
        self.host_clock = host_clock
        self.trace: list[list] = []

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        last = self._last_outcome
        decode = plan.is_decode
        predicted = None if plan.is_empty else self.policy.predicted_time(plan.num_tokens,
                                                                          decode)  # fmt: skip
        super().observe(plan, result)
        timing = result.timing
        if plan.is_empty or timing is None:
            return
        yielded = len(result.sampled) + sum(len(t) for t in result.accepted.values())
        point = plan.chunks[0].request_id.rsplit("-", 1)[0]
        interval = None if last is None else self._last_outcome - last
        guard = self.guard
        self.trace.append([
            self.arm, point, plan.num_tokens, plan.num_draft_tokens, yielded,
            None if interval is None else round(interval, 6),
            round(timing.forward_s + timing.sample_s + timing.draft_s, 6),
            None if predicted is None else round(predicted, 6),
            guard.blocked if guard else 0, guard.probes if guard else 0,
            round(self.host.value(), 6), round(self.exposed_host_s(), 6),
            *(self.host_clock.take(plan) if self.host_clock else (None, None, None)),
        ])  # fmt: skip


TRACE_FIELDS = ["arm", "point", "tokens", "drafts", "yielded", "interval_s", "device_s",
                "predicted_s", "guard_blocked", "guard_probes", "host_s",
                "exposed_host_s", "schedule_s", "launch_s", "graph"]  # fmt: skip


def arm_cores(core: EngineCore, drafter: Drafter, method: str) -> dict[str, Callable]:
    """Arm name -> readies ``core`` for that arm, each arm its own ``SpecDecoding``."""
    clock = HostClock(core)
    specs = {a.name: TracedSpecDecoding(a.speculative, 0, lagged=core.overlap, arm=a.name,
                                        on_device=drafter.on_device, host_clock=clock)
             for a in arms(method)}  # fmt: skip
    runs = {name: (lambda s=s: use(core, s, drafter)) for name, s in specs.items()}
    for name, spec in specs.items():
        runs[name].spec = spec  # type: ignore[attr-defined]
    return runs


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]  # bytes: the dummy tokenizer's range


def workloads(args: argparse.Namespace) -> dict[str, Callable[[int], list[Job]]]:
    def decode(c: int) -> list[Job]:
        rng = random.Random(c)
        n = max(args.waves * c, -(-args.min_decode_tokens // args.output_len))
        return [Job(_random_prompt(rng, args.input_len), args.output_len)
                for _ in range(n)]  # fmt: skip

    def prefill_heavy(c: int) -> list[Job]:
        rng = random.Random(1000 + c)
        n = max(2 * args.prefill_waves * c, args.prefill_min_requests)
        return [Job(_random_prompt(rng, args.prefill_len), args.prefill_output_len)
                for _ in range(n)]  # fmt: skip

    return {"decode": decode, "prefill-heavy": prefill_heavy}


# -- correctness ------------------------------------------------------------------------------

REPETITIVE = [
    [40, 41, 42, 43, 44] * 6,
    [7, 8, 9, 10, 11, 12, 13] * 4,
    [200, 3, 200, 3, 200, 3, 200, 3, 200],
    [100 + (i * 37) % 150 for i in range(40)],
]


def check_tiny() -> dict:
    """Greedy tokens of ``dummy:tiny`` (CPU, float32) with prompt lookup against without:
    the share of equal sequences (1 unless something is wrong)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def tokens(spec: SpeculativeConfig) -> tuple[list[list[int]], int]:
        llm = LLM(EngineConfig(
            model="dummy:tiny", device="cpu", dtype="float32", speculative=spec,
            cache=CacheConfig(block_size=16, num_blocks=128, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        ))  # fmt: skip
        out = [r.token_ids for r in llm.generate(REPETITIVE, greedy)]
        accepted = sum(llm.core.scheduler.stats().spec_draft_accepted)
        llm.core.check_integrity()
        return out, accepted

    reference, _ = tokens(SpeculativeConfig())
    result = {}
    for name, k, schedule in (("fixed-3", 3, "fixed"), ("dynamic-5", 5, "dynamic")):
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, schedule=schedule)
        out, accepted = tokens(spec)
        same = sum(a == b for a, b in zip(out, reference)) / len(reference)
        result[name] = {"sequences_equal": same, "drafts_accepted": accepted}
    return result


def check_shape(core: EngineCore, k: int = 3) -> dict:
    """The timed shape with its real random weights: prompt lookup (fixed k) against no
    speculation on a short greedy run, the share of output tokens that agree."""
    jobs = [Job(p, 24) for p in REPETITIVE * 2]
    none = SpecDecoding(SpeculativeConfig(), 0, lagged=core.overlap)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, schedule="fixed")
    ngram = SpecDecoding(config, 0, lagged=core.overlap, on_device=True)
    reference = run_load(use(core, none, None), jobs, len(jobs), "check")["tokens"]
    run = run_load(use(core, ngram, NgramDrafter(k)), jobs, len(jobs), "check")
    pairs = [(a, b) for ref, out in zip(reference, run["tokens"]) for a, b in zip(ref, out)]
    return {
        "tokens_equal": sum(a == b for a, b in pairs) / len(pairs),
        "sequences_equal": sum(r == o for r, o in zip(reference, run["tokens"])) / len(jobs),
        "drafts_accepted": sum(run["accepted_by_position"]),
    }


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--rates",
        default="0.8,0.7,0.6,0.5,0.4",
        help="per draft position, P(kept | the drafts before kept)",
    )
    ap.add_argument("--concurrency", default="1,16,64,128,256")
    ap.add_argument("--workloads", default="decode,prefill-heavy",
                    help="which of decode, prefill-heavy to run at each concurrency")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=4,
                    help="decode: this many x the concurrency requests, closed loop")
    ap.add_argument("--min-decode-tokens", type=int, default=2048,
                    help="decode: at least this many tokens out per point (small batch)")
    ap.add_argument("--prefill-waves", type=int, default=2,
                    help="prefill-heavy: this many x twice the concurrency requests")
    ap.add_argument("--prefill-min-requests", type=int, default=32,
                    help="prefill-heavy: at least this many requests (low concurrency)")
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prefill-output-len", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=24.0)
    ap.add_argument("--piecewise-graph-tokens", type=int,
                    default=EngineConfig.piecewise_graph_tokens,
                    help="steps with prompt tokens up to this many replay graph pieces")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--min-arm-tokens", type=int, default=2048,
                    help="a point runs more rounds until each arm yields this many tokens")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=440.0,
        help="points not started this long after start are skipped",
    )
    ap.add_argument("--host-drafter", action="store_true",
                    help="draft on the host after each step (the step after a verify step "
                         "then waits for its outcome) instead of on the device")
    ap.add_argument("--diagnose-only", action="store_true",
                    help="stop after the checks, the sync points and the runtime calls")
    ap.add_argument("--out", type=Path, default=Path("bench/results/spec_decode_h200.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    result: dict = {**machine_info(), "benchmark": "spec_decode_gpu", "args": dict(vars(args))}
    result["args"]["out"] = str(args.out)
    result["title"] = (f"dummy:{args.preset} ({args.dtype}), acceptance rates {args.rates}, "
                       f"{args.device}")  # fmt: skip
    log = print

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    try:
        result["check_tiny"] = check_tiny()
    except Exception as exc:  # noqa: BLE001 - reported, the timing still runs
        result["check_tiny"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"check, dummy:tiny on the CPU in float32: {result['check_tiny']}")
    save()

    register_drafter("rates", lambda config, target, device, dtype: RatesDrafter(
        rates, on_device=not args.host_drafter))  # fmt: skip
    try:
        core = _engine(args, rates, max(concurrencies))
    except Exception as exc:  # noqa: BLE001 - nothing to time without it: said, then out
        result["error"] = f"the engine: {type(exc).__name__}: {exc}"
        save()
        raise SystemExit(result["error"]) from exc
    rates_drafter = core.runner.drafter
    result["engine_ready_s"] = time.perf_counter() - start
    log(f"engine ready at {result['engine_ready_s']:.1f} s (overlap {core.overlap})")
    try:
        result["check_shape"] = check_shape(core)
    except Exception as exc:  # noqa: BLE001
        result["check_shape"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"check, dummy:{args.preset} {args.dtype}, prompt lookup: {result['check_shape']}")

    with torch.no_grad():
        core.runner.model.model.norm.weight.zero_()  # every logit 0: greedy picks RIGHT
    cores = arm_cores(core, rates_drafter, "rates")
    loads = workloads(args)
    timed = {name: loads[name] for name in args.workloads.split(",")}
    warm = random.Random(7)
    for name in cores:  # warm up: kernels of each step shape built, cost models seeded
        run_load(cores[name](), [Job(_random_prompt(warm, args.input_len), 16)] * 4, 4, "warm")
        run_load(cores[name](), [Job(_random_prompt(warm, args.prefill_len), 8)] * 2, 2, "warm")
    sync_jobs = loads["prefill-heavy"](16)[:32]  # steps with prefill and drafts among them
    result["sync_points"], result["pinned_allocations"] = sync_points(cores["fixed-3"],
                                                                      sync_jobs, 16)
    log(f"host waits for the device (fixed-3, prefill-heavy, 16 streams): "
        f"{result['sync_points'] or 'none recorded'}; pinned host allocator: "
        f"{result['pinned_allocations'] or 'nothing recorded'}")  # fmt: skip
    try:
        result["runtime_calls"] = runtime_calls(cores["fixed-3"], sync_jobs, 16)
    except Exception as exc:  # noqa: BLE001 - a diagnosis; the timing still runs
        result["runtime_calls"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"CUDA runtime calls (same load, profiled): {result['runtime_calls'] or 'none'}")
    try:
        result["host_profile"] = host_profile(cores, "fixed-3", loads["decode"](64)[:128], 64)
    except Exception as exc:  # noqa: BLE001 - a diagnosis; the timing still runs
        result["host_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"host time of a step (fixed-3 and none, decode, 64 streams): "
        f"{result['host_profile'].get('steps', result['host_profile'])}")
    save()
    if args.diagnose_only:
        save()
        archive = pack(args.out, cores["fixed-3"].spec.trace)  # type: ignore[attr-defined]
        log(f"wrote {args.out} and {archive} (diagnosis only)")
        return
    heap.freeze_startup()  # as a worker does once it is up: no full collection walks it all
    result["warm_s"] = time.perf_counter() - start
    log(f"warm at {result['warm_s']:.1f} s")
    save()
    records = run_arms(cores, timed, concurrencies, args.rounds, log,
                       deadline=start + args.budget_s, min_tokens=args.min_arm_tokens)  # fmt: skip
    result["records"] = records
    result["summary"] = summary(records)
    result["total_s"] = time.perf_counter() - start
    save()
    plot(records, args.out.with_suffix(".png"), result["title"])
    for line in result["summary"]:
        log(line)
    trace = [row for run in cores.values() for row in run.spec.trace]  # type: ignore[attr-defined]
    archive = pack(args.out, trace)
    log(f"wrote {args.out} and {archive} in {time.perf_counter() - start:.0f} s")


def sync_points(run: Callable[[], EngineCore], jobs: list[Job], concurrency: int,
                limit: int = 20) -> tuple[list[dict], dict[str, float]]:  # fmt: skip
    """Where the host waited for the device while ``run()``'s engine served ``jobs``
    (CUDA's sync debug mode: a warning, with its stack, at every call that synchronises),
    as the innermost engine or kernels frame of each and how many times, most first; and
    what the pinned host allocator did meanwhile (``torch.cuda.host_memory_stats``' counts
    and times, as differences: a new pinned block is a slow driver call). On the CPU
    nothing is recorded. Collecting a step waits by design (``finish``); anything else
    stalls the next step's launch: on the H200 the graph step before an eager step with
    drafts took its outcome ~8 ms late in every arm, whatever the drafts, and before an
    eager step without drafts on time."""
    import traceback
    import warnings
    from collections import Counter

    if not torch.cuda.is_available():
        return [], {}
    places: Counter[str] = Counter()

    def ours(filename: str) -> str | None:
        for root in ("/engine/", "/kernels/"):
            if (i := filename.rfind(root)) >= 0:
                return filename[i + 1 :]
        return None

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        for frame in reversed(traceback.extract_stack()[:-1]):
            if (path := ours(frame.filename)) is not None:
                places[f"{path}:{frame.lineno} {frame.name}"] += 1
                return
        places[f"{filename}:{lineno}"] += 1

    core = run()
    before = torch.cuda.host_memory_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_load(core, jobs, concurrency, "sync")
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    after = torch.cuda.host_memory_stats()
    pinned = {key: after[key] - before.get(key, 0) for key in sorted(after)
              if isinstance(after[key], int | float) and ("num_" in key or "time" in key)}
    return [{"where": where, "count": n} for where, n in places.most_common(limit)], pinned


def runtime_calls(run: Callable[[], EngineCore], jobs: list[Job], concurrency: int,
                  limit: int = 12) -> dict[str, list[dict]]:  # fmt: skip
    """The CUDA runtime calls the host made while ``run()``'s engine served ``jobs``, under
    the profiler: per call, how many and their host milliseconds in all and at most
    (``calls``); and the ``limit`` longest single calls, each with the three innermost
    engine or kernels frames of the operator that made it (``longest``). A call that waits for the
    device, or a driver allocation, shows as a long one; a launch-bound step as many
    short ``cudaLaunchKernel``. Empty on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    core = run()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=True) as prof:
        run_load(core, jobs, concurrency, "profiled")
    events = [e for e in prof.events() if e.name.startswith("cu") and e.cpu_time_total > 0]
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += e.cpu_time_total / 1e3
        entry[2] = max(entry[2], e.cpu_time_total / 1e3)
    calls = [{"call": name, "count": n, "total_ms": round(total, 2), "max_ms": round(most, 3)}
             for name, (n, total, most) in sorted(totals.items(), key=lambda kv: -kv[1][1])]

    def frame(event, depth: int = 3) -> str:  # with_stack: each Python call is an event
        frames = []
        while (event := event.cpu_parent) is not None and len(frames) < depth:
            name = event.name
            for root in ("engine/", "kernels/"):
                if (i := name.find(root)) >= 0 and "(" in name:
                    frames.append(name[i:])
                    break
        return " < ".join(frames) or "?"

    longest = sorted(events, key=lambda e: -e.cpu_time_total)[:limit]
    return {"calls": calls[:limit],
            "longest": [{"call": e.name, "ms": round(e.cpu_time_total / 1e3, 3),
                         "from": frame(e)} for e in longest]}  # fmt: skip


def host_profile(runs: dict[str, Callable[[], EngineCore]], arm: str, jobs: list[Job],
                 concurrency: int, limit: int = 25) -> dict:  # fmt: skip
    """Where the host's time goes in ``arm``'s steps while its engine serves ``jobs``:
    first unprofiled, each step's host time planning it and launching it, as medians over
    the steps that verify drafts and those that do not (``steps``; ``none`` alongside as
    the reference); then under cProfile, the ``limit`` functions with the most own time,
    per step launched (``functions``: the profiler's own overhead inflates them, the
    order holds). A verify step's launch is what the next step waits for once it exceeds
    the device's step."""
    import cProfile
    import pstats
    from statistics import median

    drafted, scheduled, launched = (TRACE_FIELDS.index(f) for f in ("drafts", "schedule_s",
                                                                     "launch_s"))  # fmt: skip
    steps = {}
    for name in (arm, "none"):
        trace = runs[name].spec.trace  # type: ignore[attr-defined]
        first = len(trace)
        run_load(runs[name](), jobs, concurrency, f"host-{name}")
        for drafts in (True, False):
            rows = [r for r in trace[first:]
                    if (r[drafted] > 0) == drafts and r[launched] is not None]  # fmt: skip
            if rows:
                steps[f"{name}, {'verify' if drafts else 'plain'}"] = {
                    "steps": len(rows),
                    "schedule_ms": round(1e3 * median(r[scheduled] for r in rows), 3),
                    "launch_ms": round(1e3 * median(r[launched] for r in rows), 3),
                }  # fmt: skip
    core, trace = runs[arm](), runs[arm].spec.trace  # type: ignore[attr-defined]
    first = len(trace)
    profiler = cProfile.Profile()
    profiler.enable()
    run_load(core, jobs, concurrency, "host-profiled")
    profiler.disable()
    ran = max(len(trace) - first, 1)  # a line for each step run
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, own, cumulative, _)
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:limit]
    root = str(Path(__file__).resolve().parents[1]) + "/"
    functions = [{"function": f"{f.replace(root, '')}:{line} {name}",
                  "own_ms_per_step": round(1e3 * own / ran, 3),
                  "cumulative_ms_per_step": round(1e3 * cum / ran, 3),
                  "calls_per_step": round(calls / ran, 1)}
                 for (f, line, name), (_, calls, own, cum, _) in top]  # fmt: skip
    return {"arm": arm, "concurrency": concurrency, "steps": steps, "launched": ran,
            "functions": functions}  # fmt: skip


def pack(out: Path, trace: list[list]) -> Path:
    """The JSON, its PNG (where drawn) and every arm's step trace in one archive."""
    archive = out.with_suffix(".tar.gz")
    lines = [json.dumps(TRACE_FIELDS)] + [json.dumps(row) for row in trace]
    with tarfile.open(archive, "w:gz") as tar:
        for path in (out, out.with_suffix(".png")):
            if path.exists():
                tar.add(path, arcname=path.name)
        data = ("\n".join(lines) + "\n").encode()
        info = tarfile.TarInfo(f"{out.stem}_trace.jsonl")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return archive


def _engine(args: argparse.Namespace, rates: list[float], max_seqs: int) -> EngineCore:
    """The timed engine: the preset, the rates drafter with K = len(rates), a token budget
    that holds a verify step of every sequence at K."""
    return EngineCore(EngineConfig(
        model=f"dummy:{args.preset}", device=args.device, dtype=args.dtype,
        speculative=SpeculativeConfig(method="rates", num_speculative_tokens=len(rates)),
        cache=CacheConfig(block_size=128 if args.device.startswith("cuda") else 16,
                          memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(
            args.max_num_batched_tokens, max_seqs * (len(rates) + 1)), max_model_len=4096),
        piecewise_graph_tokens=args.piecewise_graph_tokens,
    ))  # fmt: skip


def summary(records: list[dict]) -> list[str]:
    """Per point: dynamic's tok/s against none, the best fixed k and k = 5."""
    lines = []
    for rec in records:
        if rec["arm"] == "dynamic" and rec.get("vs_none") and rec.get("vs_best_fixed"):
            best = max((r for r in records if r["workload"] == rec["workload"]
                        and r["concurrency"] == rec["concurrency"] and "tok_s" in r
                        and r["arm"] != "dynamic"), key=lambda r: r["tok_s"])  # fmt: skip
            lines.append(
                f"{rec['workload']:>14} c={rec['concurrency']:<4} dynamic {rec['tok_s']:9.0f} "
                f"tok/s: x{rec['vs_none']:.3f} none, x{rec['vs_best_fixed']:.3f} best fixed, "
                f"x{rec['vs_fixed_5']:.3f} fixed-5; best other {best['arm']}, acceptance "
                f"length {rec['acceptance_length']:.2f}, budget "
                f"{rec['verify_budget_per_step']:.1f} per verifying step "
                f"({rec['verify_steps']}/{rec['steps']} steps verified), step time error "
                f"{rec['step_time_error']:.3f}, guard {rec['guard_blocked_steps']} blocked / "
                f"{rec['guard_probe_steps']} probes, {rec['explored_steps']} explored"
            )
    return lines


if __name__ == "__main__":
    main()
