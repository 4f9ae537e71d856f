"""Speculative decoding's scheduling against a synthetic H200: none, fixed k = 1..5, dynamic.

    PYTHONPATH=. .venv/bin/python -m bench.spec_decode_sim [--concurrency 1,16,64,128,256]
        [--workloads decode,prefill-heavy] [--scale N] [--seed N] [--no-overlap]
        [--machine h200|h100]

No model and no device: the engine's own ``Scheduler``, ``KVCacheManager`` and
``SpecDecoding`` (verify policy, step-cost model, realized-gain guard) run as
``EngineCore.step`` drives them (``SimEngine``: plan and launch, collect the step in
flight, leave the new one running: overlap scheduling, ``lagged``), against a fake runner
on a fake clock; ``host_time``, ``observe`` and ``idle`` are fed as the engine feeds them,
and the cost model is told of the graphs as ``EngineCore`` tells it on CUDA. The runner
is ``bench.spec_decode_gpu``'s: a model whose greedy token is always the same one, and
one drafter for every arm that drafts on the device behind each step (as that benchmark's
does, and the MTP layer): as deep as ``draft_depth`` of the drafts each request verified
there, the draft at position j kept with probability ``rates[j]`` given the ones before,
drawn from a hash of the request and the token's index in it (every arm meets the same
draws; ``--seed`` draws others); it reports ``rates`` as its confidence; the drafts after
the first wrong one are right again, as its are. The plan after a step verifies those
drafts as placeholders, and the step's tokens are placed after the ones really kept.

Its times (``H200Costs``) are fitted to the trace of b69a605's sweep
(``bench/results/traces/spec_decode_h200_b69a605.tar.gz``: llama3-8b in bf16, 25k steps)
by ``bench.spec_decode_fit``: a decode step's forward by CUDA graph bucket up to 256 rows
(4.2 ms at 1 row, 10 at 256; the verify steps' graphs from 320 to 512 rows, which that
sweep ran eagerly, extrapolated: 28 us a row more), eager past them at 2.76 ms + 35 us a
row; a step with drafts
adds 0.23 ms of verification and one that proposes 0.25 ms of drafting; steps with prefill
eager, 2.36 ms + 23 us a token and, holding drafts, 1.49 ms + 33 us a draft more (at least
6.2 ms), their kernels issued by the host one by one in 6 ms while the device runs them, 8
ms more when they hold drafts (on the H200 the graph step before such a step took its
outcome that much later than the one before a step with prefill and no drafts, in every
arm, whatever the drafts); the host's work per step (planning and launching, ~30 us more
per request with drafts, folding tokens back, reading drafts back, looking up and pricing
the candidates) hidden under overlap; every time jitters (2 % on the device, 10 % on the
host, seeded). Over four seeds 51 of the 60 none and fixed points come within 10 % of the
H200's tok/s; fixed-4 at 64-256 streams and fixed-3 at 256 are 13-27 % fast (those arms
moved up to 25 % between two H200 sweeps), fixed-1..5 prefill-heavy at one stream 10-14 %
slow. The workloads and the order of points are the GPU benchmark's (``decode``: 4 waves
of the concurrency, at least 16 requests, 64-token prompts, 128 tokens out;
``prefill-heavy``: twice the concurrency twice over, at least 32, 256-token prompts, 16
out; ``--scale``: as many times the requests), each arm keeping its ``SpecDecoding``
across points as that run does, after the same warm-up.

``--spells STEP:STEPS,..`` runs every decode point with slow spells of the host
(``SimEngine.slow``) at those steps of its run, as the H200 met one at 128 streams.
``--kv-block-cost US`` adds to each decode step's time US microseconds per row and
128-token block of KV it reads, so that steps grow dearer within a wave as their contexts
cross a block and cheaper when the next wave starts, as the H100's did (its 256-row step
10.3 to 11.4 ms within a wave: ~3.5 us).

``--out PATH`` writes the records as JSON, with the commit and the machine.

Beside tok/s each point counts its steps with prefill, the dynamic policy's wall time per
choice on this machine (the one real time here: ``SpecDecoding`` asked, its policy
priced), and the steps that sampled but verified no draft, by cause
(``Traced``): ``policy`` (the policy chose none), ``guard`` (the guard vetoed the
policy's drafts), ``probe`` (the guard's no-draft probe), ``rest`` (the drafter rested,
so there were no drafts to verify) and ``new`` (no proposal yet: a request's first step,
or the step planned while that one ran).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.common import machine_info
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.plan import StepPlan, StepResult, StepTiming
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec.base import Proposal, draft_depth
from engine.spec.manager import SpecDecoding

RATES = (0.8, 0.7, 0.6, 0.5, 0.4)
KV_BLOCK = 128  # tokens of a KV cache block on CUDA
RIGHT, WRONG = 0, 1  # the model's greedy token; a draft's wrong guess
MAX_K = 5


@dataclass(frozen=True)
class H200Costs:
    """Step times in seconds, fitted to the H200 run (module docstring)."""

    graph_s: tuple[tuple[int, float], ...] = (  # decode forward per graph bucket of rows
        (1, 4.23e-3), (2, 4.45e-3), (4, 4.84e-3), (8, 4.90e-3), (16, 5.02e-3),
        (32, 5.52e-3), (64, 5.64e-3), (128, 6.70e-3), (256, 9.95e-3),
    )  # fmt: skip
    # the verify steps' graphs past 256 rows (``engine.cuda_graphs.DEFAULT_BUCKETS``), which
    # the sweep fitted ran eagerly: not measured, the 256-row graph plus 28 us a row (the
    # eager steps past it grew by 30-32 us a row)
    verify_graph_s: tuple[tuple[int, float], ...] = (
        (320, 11.74e-3), (384, 13.53e-3), (512, 17.12e-3),
    )  # fmt: skip
    eager_s: float = 2.76e-3  # a decode step past the graphs: this + per row
    eager_row_s: float = 34.6e-6
    mixed_s: float = 2.36e-3  # a step with prefill: this + per token + per draft
    mixed_token_s: float = 23e-6
    mixed_draft_s: float = 32.5e-6  # (a draft costs more there than a prompt's token)
    mixed_drafts_s: float = 1.49e-3  # ... + this when it holds any draft
    eager_floor_s: float = 6.2e-3  # an eager forward's launch-bound least
    eager_issue_s: float = 6.0e-3  # host: issuing an eager step's kernels, one by one (the
    # device runs them as they come, so the step cannot end before the last is issued) ...
    issue_drafts_s: float = 7.96e-3  # ... + this for a step with prefill and drafts
    issue_draft_s: float = 0.0  # ... + this per draft in it (fitted: -22 us, none)
    sample_s: float = 0.05e-3  # sampling one token per request (device)
    verify_s: float = 0.23e-3  # verification (device), per step with drafts
    draft_s: float = 0.25e-3  # the drafter's chained passes behind a step that proposes
    plan_s: float = 0.3e-3  # host: planning and launching a step
    plan_chunk_s: float = 5e-6
    verify_chunk_s: float = 30e-6  # ... and per chunk with drafts (rows, verification)
    update_s: float = 0.3e-3  # host: folding a step's tokens back
    update_chunk_s: float = 4e-6
    collect_s: float = 0.05e-3  # host: reading the drafts back
    collect_request_s: float = 2e-6
    lookup_s: float = 3e-6  # host: per candidate the scheduler looks up
    price_s: float = 2e-6  # host: per candidate the dynamic policy prices ...
    price_step_s: float = 15e-6  # ... and per step it does
    device_noise: float = 0.02  # each device time times exp(N(0, this))
    host_noise: float = 0.10  # each host time times exp(N(0, this))
    # a decode step's attention per row and 128-token block of KV it reads, a chunk's rows
    # at its longest context (0: none, the fits' times hold the contexts their sweeps had;
    # ``--kv-block-cost``)
    kv_block_row_s: float = 0.0

    HOST = ("plan_s", "plan_chunk_s", "verify_chunk_s", "update_s", "update_chunk_s",
            "collect_s", "collect_request_s", "lookup_s", "price_s", "price_step_s")

    def host_times(self, factor: float) -> H200Costs:
        """These costs on a host ``factor`` times as slow: each per-step host time in
        ``HOST`` (not ``eager_issue_s`` and ``issue_drafts_s``, the fit's issue of an
        eager step's kernels, which a decode step replayed from a graph has none of)."""
        return replace(self, **{f: getattr(self, f) * factor for f in self.HOST})

    @property
    def graphs(self) -> tuple[tuple[int, float], ...]:
        """Every decode graph bucket's forward, verify steps' included."""
        return self.graph_s + self.verify_graph_s

    def replayed(self, plan: StepPlan) -> bool:
        """Whether a CUDA graph replays the step (decode, within the largest bucket)."""
        return plan.is_decode and plan.num_tokens <= self.graphs[-1][0]

    def forward(self, plan: StepPlan) -> float:
        rows = plan.num_tokens
        if plan.is_decode:
            blocks = (sum(c.num_tokens * -(-(c.start_pos + c.num_tokens) // KV_BLOCK)
                          for c in plan.chunks) if self.kv_block_row_s else 0)  # fmt: skip
            return self._decode_forward(plan) + self.kv_block_row_s * blocks
        drafts = plan.num_draft_tokens
        mixed = (self.mixed_s + self.mixed_token_s * (rows - drafts) + self.mixed_draft_s * drafts
                 + (self.mixed_drafts_s if drafts else 0.0))  # fmt: skip
        return max(self.eager_floor_s, mixed)

    def _decode_forward(self, plan: StepPlan) -> float:
        rows = plan.num_tokens
        if self.replayed(plan):
            graphs = self.graphs
            return graphs[bisect.bisect_left([b for b, _ in graphs], rows)][1]
        return max(self.eager_floor_s, self.eager_s + self.eager_row_s * rows)

    def issue(self, plan: StepPlan) -> float:
        """Host time issuing the step's kernels: a graph replay's is in ``plan``."""
        if self.replayed(plan):
            return 0.0
        drafts = 0 if plan.is_decode else plan.num_draft_tokens
        return self.eager_issue_s + (self.issue_drafts_s + self.issue_draft_s * drafts
                                     if drafts else 0.0)  # fmt: skip

    def sample(self, plan: StepPlan) -> float:
        return self.sample_s + (self.verify_s if plan.num_draft_tokens else 0.0)

    def plan(self, plan: StepPlan) -> float:
        verifying = sum(1 for c in plan.chunks if c.num_draft)
        return self.plan_s + self.plan_chunk_s * len(plan.chunks) + self.verify_chunk_s * verifying

    def update(self, plan: StepPlan) -> float:
        return self.update_s + self.update_chunk_s * len(plan.chunks)

    def collect(self, requests: int) -> float:
        return self.collect_s + self.collect_request_s * requests if requests else 0.0


# the H100's (``bench.spec_decode_fit --graph-rows 512`` on the trace of 492089f's sweep,
# bench/results/traces/spec_decode_h100.tar.gz, 25k steps; over two seeds 56 of its 60 none
# and fixed points come within 10 % of the H100's tok/s, 50 within 3 %: prefill-heavy at one
# stream 6-16 % slow). The host's costs stay the H200's: the trace has none of them.
H100_COSTS = H200Costs(
    graph_s=((1, 5.64e-3), (2, 5.791e-3), (4, 5.997e-3), (8, 6.588e-3), (16, 6.475e-3),
             (32, 6.939e-3), (64, 7.071e-3), (128, 8.245e-3), (256, 10.788e-3)),
    verify_graph_s=((320, 12.609e-3), (384, 14.155e-3), (512, 17.591e-3)),
    eager_s=3.16e-3, eager_row_s=29.31e-6, mixed_s=2.985e-3, mixed_token_s=23.36e-6,
    mixed_draft_s=30.42e-6, mixed_drafts_s=1.058e-3, issue_drafts_s=0.054e-3,
    verify_s=-0.254e-3,  # a step with drafts took less than one without, less the drafting
)  # fmt: skip
MACHINES = {"h200": H200Costs(), "h100": H100_COSTS}


class Clock:
    """The fake wall clock ``SpecDecoding`` measures steps with."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


REASONS = ("verified", "policy", "guard", "probe", "rest", "new")


class Traced(SpecDecoding):
    """``SpecDecoding`` that says, per step it plans, why it verified no draft (module
    docstring), and how many candidates it looked up and priced (host work)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reasons: Counter[str] = Counter()
        self.looked_up = self.priced = 0  # candidates, since the engine last took them
        self.policy_s: list[float] = []  # this machine's wall time of each dynamic choice
        self._recent: deque[bool] = deque([True, True], maxlen=2)  # plans' ``proposes``

    def lengths(self, candidates, base_tokens, base_yield, decode=None, limit=None):
        resting = not self.proposes or not all(self._recent)  # no drafts: from a rest
        c = self.counters
        probes, blocked = c.guard_probes, c.guard_blocked
        out = super().lengths(candidates, base_tokens, base_yield, decode, limit)
        self._recent.append(self.proposes)
        self.looked_up += len(candidates)
        if base_yield:
            if any(out):
                reason = "verified"
            elif not candidates or resting:
                reason = "rest" if resting else "new"
            elif c.guard_probes > probes:
                reason = "probe"
            elif c.guard_blocked > blocked:
                reason = "guard"
            else:
                reason = "policy"
            self.reasons[reason] += 1
        return out

    def _ask(self, candidates, *args):
        if self.config.schedule != "dynamic":
            return super()._ask(candidates, *args)
        self.priced += len(candidates)
        start = time.perf_counter()
        out = super()._ask(candidates, *args)
        self.policy_s.append(time.perf_counter() - start)
        return out

    def host_work(self) -> tuple[int, int]:
        """Candidates looked up and priced since the last call."""
        out = self.looked_up, self.priced
        self.looked_up = self.priced = 0
        return out


@dataclass
class _Launched:
    plan: StepPlan
    forward_s: float
    sample_s: float
    draft_s: float  # the drafter's, on the device behind the step
    done: float  # when the device finishes it


@dataclass
class SimEngine:
    """``EngineCore.step`` on a fake runner and clock (module docstring)."""

    spec: SpecDecoding
    costs: H200Costs = field(default_factory=H200Costs)
    rates: Sequence[float] = RATES
    max_seqs: int = 256
    max_tokens: int = 4096
    overlap: bool = True
    seed: int = 0
    spell_host: float = 2.0  # a slow spell's host times, as many times as usual ...
    spell_device: float = 1.35  # ... and its device times (``slow``)

    def __post_init__(self) -> None:
        kv = KVCacheManager(BlockPool(4 * self.max_seqs + 16, enable_caching=False), 128)
        config = SchedulerConfig(max_num_seqs=self.max_seqs,
                                 max_num_batched_tokens=self.max_tokens)  # fmt: skip
        self.scheduler = Scheduler(config, kv, 4096, self.spec)
        self.spec.graphs(self.costs.graphs[-1][0])  # as EngineCore tells it on CUDA
        self.clock = self.spec.clock if isinstance(self.spec.clock, Clock) else Clock()
        self.spec.clock = self.clock
        self.rng = random.Random(self.seed)
        self._noise = random.Random(self.seed + 1)
        self.host = 0.0  # the host's clock
        self.device = 0.0  # when the device is done with what it was given
        self._inflight: _Launched | None = None
        self._tokens: dict[str, int] = {}  # the runner's count of each request's tokens
        self._drafted: dict[str, list[int]] = {}  # the drafts made behind the last step
        self._slow = 0  # steps left of a slow spell
        self.mixed = 0  # steps with prefill run so far

    def slow(self, steps: int) -> None:
        """The next ``steps`` steps run in a slow spell of the host (``spell_host`` times
        its usual times, ``spell_device`` times the device's, which waits for it): on the
        H200 at 128 streams a spell of ~15 steps took a verifying step from 10.6 to 14.2
        ms of device time and its launch from 5.8 to 11 ms."""
        self._slow = steps

    @property
    def now(self) -> float:
        return self.host

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        prompt = [3 + self.rng.randrange(247) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add(Request(request_id, prompt, params))
        self._tokens[request_id] = prompt_len

    def _jitter(self, seconds: float, sigma: float) -> float:
        return seconds * math.exp(self._noise.gauss(0.0, sigma)) if sigma else seconds

    def _host(self, seconds: float) -> float:
        seconds = self._jitter(seconds, self.costs.host_noise)
        if self._slow:
            seconds *= self.spell_host
        self.host += seconds
        return seconds

    def _launch(self, plan: StepPlan) -> _Launched:
        looked_up, priced = self.spec.host_work() if isinstance(self.spec, Traced) else (0, 0)
        costs = self.costs
        asked = costs.price_step_s + costs.price_s * priced if priced else 0.0
        self._host(costs.plan(plan) + costs.lookup_s * looked_up + asked)
        device = self.costs.device_noise
        slow = self.spell_device if self._slow else 1.0
        forward = slow * self._jitter(self.costs.forward(plan), device)
        sample = slow * self._jitter(self.costs.sample(plan), device)
        drafts = self.spec.enabled and plan.propose and any(c.sample for c in plan.chunks)
        draft = slow * self._jitter(self.costs.draft_s, device) if drafts else 0.0
        start = max(self.host, self.device)
        self._host(costs.issue(plan))
        forward = max(start + forward, self.host) - start  # as the device's clock has it
        self.device = start + forward + sample + draft
        return _Launched(plan, forward, sample, draft, self.device)

    def _finish(self, launched: _Launched) -> StepResult:
        """Wait for the step, verify its drafts (the model always picks RIGHT; a draft
        made on the device behind the step before is that step's proposal), draw the
        drafter's proposals behind it: as deep as ``draft_depth`` of what each request
        verified, as the device drafts."""
        self.host = max(self.host, launched.done)
        plan = launched.plan
        sampled, accepted, proposals = {}, {}, {}
        k = self.spec.max_draft
        for chunk in plan.chunks:
            rid = chunk.request_id
            if rid not in self._tokens or not chunk.sample:
                continue  # ended while the step ran, or a prompt's chunk
            drafted = self._drafted.pop(rid, ())
            kept = 0
            for j, token in enumerate(chunk.draft_token_ids):
                if token < 0:  # made on the device behind the step before
                    token = drafted[j] if j < len(drafted) else WRONG
                if token != RIGHT:
                    break
                kept += 1
            sampled[rid] = RIGHT
            if kept:
                accepted[rid] = [RIGHT] * kept
            self._tokens[rid] += kept + 1
            req = self.scheduler.requests.get(rid)
            if req is None or not plan.propose or not k:
                continue
            done = self._tokens[rid] - req.num_prompt_tokens
            room = min(draft_depth(chunk.num_draft, k), req.sampling.max_tokens - done - 1)
            if room <= 0:
                continue
            start, key = self._tokens[rid], zlib.crc32(f"{self.seed}:{rid}".encode())
            tokens = [RIGHT] * room
            for j in range(room):
                if _uniform(key, start + j) >= self.rates[j]:
                    tokens[j] = WRONG
                    break
            proposals[rid] = Proposal(start, tokens, list(self.rates[:room]))
            self._drafted[rid] = tokens
        self._host(self.costs.collect(len(proposals)))
        return StepResult(sampled, accepted=accepted, proposals=proposals,
                          timing=StepTiming(launched.forward_s, launched.sample_s,
                                            launched.draft_s))  # fmt: skip

    def _update(self, launched: _Launched, result: StepResult) -> list:
        self.clock.now = self.host
        outputs = self.scheduler.update(launched.plan, result)
        self._host(self.costs.update(launched.plan))
        for out in outputs:
            if out.finish_reason is not None:
                self._tokens.pop(out.request_id, None)
                self._drafted.pop(out.request_id, None)
        return outputs

    def step(self) -> list:
        """``EngineCore.step``: plan and launch, collect the step in flight, and leave the
        new one running (overlap: its drafts, if any, are made on the device)."""
        outputs = []
        self._slow = max(self._slow - 1, 0)
        previous, self._inflight = self._inflight, None
        launched = None
        host = self.host
        if self.scheduler.has_work:
            plan = self.scheduler.schedule()
            self.mixed += not plan.is_empty and not plan.is_decode
            launched = self._launch(plan)
        host_s = self.host - host
        if previous is not None:
            result = self._finish(previous)
            host = self.host
            outputs += self._update(previous, result)
            host_s += self.host - host
        if launched is not None:
            if self.overlap and (not launched.plan.num_draft_tokens or self.spec.on_device):
                self.scheduler.assume_sampled(launched.plan)
                self._inflight = launched
            else:
                result = self._finish(launched)
                host = self.host
                outputs += self._update(launched, result)
                host_s += self.host - host
            self.spec.host_time(host_s, launched.plan)
        return outputs


_MASK = (1 << 64) - 1


def _uniform(key: int, j: int) -> float:
    """A uniform in [0, 1) from ``key`` and ``j`` (splitmix64's finaliser, as
    ``bench.spec_decode_gpu``'s drafter draws): every arm meets the same draws."""
    z = (key + (j + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) / 2.0**64


@dataclass(frozen=True)
class Job:
    prompt_len: int
    max_tokens: int


Spell = tuple[int, int]  # a slow spell: from this step of a point's run, this many steps


def run_load(engine: SimEngine, jobs: Sequence[Job], concurrency: int, tag: str,
             spells: Sequence[Spell] = ()) -> dict:  # fmt: skip
    """``bench.spec_decode.run_load`` on the simulated engine: ``jobs``, ``concurrency``
    at a time (closed loop); output tok/s on the fake clock and the steps by cause.
    ``spells``: the slow spells of the host (``SimEngine.slow``) in this run."""
    spells = dict(spells)
    spec = engine.spec
    before = _snapshot(spec)
    pending = list(enumerate(jobs))
    live: set[str] = set()
    tokens = steps = 0
    start, mixed = engine.now, engine.mixed
    asked = len(getattr(spec, "policy_s", ()))
    while pending or live:
        while pending and len(live) < concurrency:
            i, job = pending.pop(0)
            rid = f"{tag}-{i}"
            engine.add(rid, job.prompt_len, job.max_tokens)
            live.add(rid)
        if steps in spells:
            engine.slow(spells[steps])
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                live.discard(out.request_id)
        steps += 1
    while engine.has_work:
        engine.step()
    seconds = engine.now - start
    after = _snapshot(spec)
    diff = {key: after[key] - before[key] for key in after}
    policy_s = getattr(spec, "policy_s", [])[asked:]
    return {"tok_s": tokens / seconds, "seconds": seconds, "steps": steps,
            "mixed_steps": engine.mixed - mixed,
            "policy_ms": 1e3 * statistics.median(policy_s) if policy_s else None, **diff}


def _snapshot(spec: SpecDecoding) -> dict[str, int]:
    c = spec.counters
    out = {"verify_steps": c.steps, "verified": sum(c.verified), "budget": c.budget,
           "asked": c.asked, "guard_blocked": c.guard_blocked, "guard_probes": c.guard_probes,
           "explored": c.explored}  # fmt: skip
    reasons = getattr(spec, "reasons", Counter())
    out.update({f"steps_{r}": reasons[r] for r in REASONS})
    return out


def decode_jobs(c: int, scale: int = 1) -> list[Job]:
    """``decode``: 4 waves of the concurrency, at least 2048 tokens out in all (``scale``
    times as many), 64-token prompts, 128 tokens out."""
    return [Job(64, 128)] * (scale * max(4 * c, 2048 // 128))


def prefill_jobs(c: int, scale: int = 1) -> list[Job]:
    """``prefill-heavy``: 2 waves of twice the concurrency, at least 32 (``scale`` times
    as many), 256-token prompts, 16 tokens out."""
    return [Job(256, 16)] * (scale * max(4 * c, 32))


WORKLOADS = {"decode": decode_jobs, "prefill-heavy": prefill_jobs}


def arm_specs(names: Sequence[str] | None = None, lagged: bool = True) -> dict[str, SpecDecoding]:
    """Arm -> its ``SpecDecoding`` on a fake clock (none, fixed-1..5, dynamic)."""
    configs = {"none": SpeculativeConfig()}
    for k in range(1, MAX_K + 1):
        configs[f"fixed-{k}"] = SpeculativeConfig(method="rates", num_speculative_tokens=k,
                                                  schedule="fixed")  # fmt: skip
    configs["dynamic"] = SpeculativeConfig(method="rates", num_speculative_tokens=MAX_K,
                                           schedule="dynamic")  # fmt: skip
    return {name: Traced(config, 0, lagged=lagged, clock=Clock(), on_device=True)
            for name, config in configs.items() if names is None or name in names}  # fmt: skip


def run(
    concurrencies: Sequence[int] = (1, 16, 64, 128, 256),
    workloads: Sequence[str] = ("decode", "prefill-heavy"),
    arms: Sequence[str] | None = None,
    costs: H200Costs | None = None,
    overlap: bool = True,
    scale: Callable[[int], int] | int = 1,
    arms_at: Callable[[int], Sequence[str]] | None = None,
    seed: int = 0,
    spells: Sequence[Spell] = (),
) -> list[dict]:
    """Every arm at every point, in the GPU benchmark's order (warm-up first), each arm on
    its own engine and ``SpecDecoding``, kept across points. ``scale(c)``: the workloads
    at ``c`` hold that many times the benchmark's requests (more averages out the draws
    of short runs); ``arms_at(c)``: the arms that run at ``c`` (default: all);
    ``spells``: slow spells of the host at the same steps of every decode point's run."""
    costs = costs or H200Costs()
    specs = arm_specs(arms, lagged=overlap)
    engines = {name: SimEngine(spec, costs, overlap=overlap, seed=seed)
               for name, spec in specs.items()}  # fmt: skip
    for engine in engines.values():
        run_load(engine, [Job(64, 16)] * 4, 4, "warm-d")
        run_load(engine, [Job(256, 8)] * 2, 2, "warm-p")
    records = []
    for c in concurrencies:
        times = scale(c) if callable(scale) else scale
        names = set(engines if arms_at is None else arms_at(c))
        for workload in workloads:
            jobs = WORKLOADS[workload](c, times)
            for name, engine in engines.items():
                if name in names:
                    rec = run_load(engine, jobs, c, f"{workload}-{c}",
                                   spells if workload == "decode" else ())  # fmt: skip
                    records.append({"workload": workload, "concurrency": c, "arm": name, **rec})
    return records


def best_other(records: list[dict], rec: dict) -> tuple[str, float]:
    """The best arm other than dynamic at ``rec``'s point."""
    peers = [r for r in records if (r["workload"], r["concurrency"]) ==
             (rec["workload"], rec["concurrency"]) and r["arm"] != "dynamic"]  # fmt: skip
    best = max(peers, key=lambda r: r["tok_s"])
    return best["arm"], best["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,64,128,256")
    ap.add_argument("--workloads", default="decode,prefill-heavy")
    ap.add_argument("--no-overlap", action="store_true", help="plan each step after the last")
    ap.add_argument("--scale", type=int, default=1, help="this many times the requests")
    ap.add_argument("--seed", type=int, default=0, help="the acceptance draws and the jitter")
    ap.add_argument("--spells", default="", metavar="STEP:STEPS,..",
                    help="slow spells of the host in every decode point, e.g. 84:12,120:17 "
                         "(the H200's at 128 streams)")  # fmt: skip
    ap.add_argument("--machine", choices=sorted(MACHINES), default="h200",
                    help="whose step costs: the H200's sweep's (H200Costs) or the H100's")
    ap.add_argument("--host-factor", type=float, default=1.0,
                    help="the host this many times as slow (planning, launching, folding "
                         "back, looking up and pricing drafts)")  # fmt: skip
    ap.add_argument("--kv-block-cost", type=float, default=0.0, metavar="US",
                    help="a decode step's attention: this many us per row and 128-token "
                         "block of KV it reads, on top of the fitted times (H100, 8B: ~3.5, "
                         "the 256-row step 10.3 -> 11.4 ms as contexts cross a block)")
    ap.add_argument("--out", type=Path, help="the records as JSON, with the commit and machine")
    args = ap.parse_args()
    spells = [(int(a), int(b)) for a, b in (s.split(":") for s in args.spells.split(",") if s)]
    records = run([int(c) for c in args.concurrency.split(",")], args.workloads.split(","),
                  costs=replace(MACHINES[args.machine].host_times(args.host_factor),
                                kv_block_row_s=args.kv_block_cost * 1e-6),
                  overlap=not args.no_overlap,
                  scale=args.scale, seed=args.seed, spells=spells)  # fmt: skip
    for rec in records:
        line = (f"{rec['workload']:>14} c={rec['concurrency']:<4} {rec['arm']:>8} "
                f"{rec['tok_s']:8.0f} tok/s, steps {rec['steps']:4d} with prefill "
                f"{rec['mixed_steps']:3d} verifying {rec['verify_steps']:4d}")  # fmt: skip
        if rec["arm"] == "dynamic":
            name, best = best_other(records, rec)
            per = rec["verified"] / rec["verify_steps"] if rec["verify_steps"] else 0.0
            causes = " ".join(f"{r}={rec[f'steps_{r}']}" for r in REASONS[1:])
            line += (f" x{rec['tok_s'] / best:.3f} of {name}; {per:.1f} drafts a verifying "
                     f"step; not verifying: {causes}; probes {rec['guard_probes']}, "
                     f"explored {rec['explored']}; policy {rec['policy_ms']:.2f} ms a "
                     f"choice on this machine")  # fmt: skip
        print(line)
    if args.out:
        out = {**machine_info(), "benchmark": "spec_decode_sim",
               "args": {**vars(args), "out": str(args.out)}, "records": records}  # fmt: skip
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
