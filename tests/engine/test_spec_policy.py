"""The verify-length policy and its estimators, without a model.

The dynamic policy's choice is checked against a brute-force search over every
allocation on random acceptance curves and step-cost models; the estimators against
known cost lines; the manager's lag against its rule (budget from the curves of the
previous plan, lengths from the latest).
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.plan import ScheduledChunk, StepPlan, StepResult, StepTiming
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec import guard
from engine.spec.base import Proposal
from engine.spec.cost import ForwardTimeEstimator, MedianEstimator, StepCostModel, graph_size
from engine.spec.manager import Candidate, SpecDecoding
from engine.spec.policy import (
    REMEASURE_AFTER,
    DynamicPolicy,
    FixedPolicy,
    VerifyPolicy,
    VerifyStep,
    allocate,
    best_gain,
    best_total,
)


def survival(confidences: list[float]) -> list[float]:
    out, p = [], 1.0
    for c in confidences:
        p *= c
        out.append(p)
    return out


def objective(curves, lengths, base_yield, time) -> float:
    expected = base_yield + sum(sum(c[:k]) for c, k in zip(curves, lengths))
    return expected / time(sum(lengths))


def brute_force(curves, base_yield, time) -> tuple[float, list[tuple[int, ...]]]:
    """The best expected tokens per second over every allocation, and every allocation
    that reaches it."""
    best, argbest = -1.0, []
    for lengths in itertools.product(*(range(len(c) + 1) for c in curves)):
        value = objective(curves, lengths, base_yield, time)
        if value > best + 1e-12:
            best, argbest = value, [lengths]
        elif abs(value - best) <= 1e-12:
            argbest.append(lengths)
    return best, argbest


def random_case(rng: random.Random):
    """Curves of 1-4 requests with 0-4 drafts each, and a step-cost model: a forward of
    baseline + slope x tokens (sometimes with a jump at a graph size), plus a sampler
    and a drafter time."""
    curves = [
        survival([rng.uniform(0.05, 1.0) for _ in range(rng.randint(0, 4))])
        for _ in range(rng.randint(1, 4))
    ]
    base_tokens = len(curves) + rng.choice([0, 0, 7, 60])  # some steps hold prefill tokens
    baseline, slope = rng.uniform(1, 20), rng.uniform(0.01, 2.0)
    jump = rng.choice([0.0, 0.0, rng.uniform(0, 5)])
    fixed = rng.uniform(0, 3)

    def time(drafts: int) -> float:
        tokens = base_tokens + drafts
        return baseline + slope * tokens + (jump if tokens > 8 else 0.0) + fixed

    return curves, len(curves), time


@pytest.mark.parametrize("seed", range(300))
def test_dynamic_choice_equals_brute_force_over_all_allocations(seed):
    rng = random.Random(seed)
    curves, base_yield, time = random_case(rng)
    lengths = allocate(curves, best_total(curves, base_yield, time))
    best, argbest = brute_force(curves, base_yield, time)
    assert objective(curves, lengths, base_yield, time) == pytest.approx(best, rel=1e-12)
    if len(argbest) == 1:  # a unique optimum: the very same allocation
        assert tuple(lengths) == argbest[0]
    assert all(0 <= k <= len(c) for k, c in zip(lengths, curves))


def test_dynamic_verifies_nothing_when_drafts_cost_more_than_they_yield():
    curves = [survival([0.1, 0.1]), survival([0.05])]
    assert best_total(curves, 2, lambda n: 10.0 + 5.0 * n) == 0
    assert best_total(curves, 2, lambda n: 10.0) == 3  # free drafts: all of them


def test_allocation_goes_to_the_highest_marginal_gain():
    curves = [survival([0.9, 0.9, 0.9]), survival([0.5, 0.5]), survival([0.95])]
    # P: r0 0.9 0.81 0.729; r1 0.5 0.25; r2 0.95
    assert allocate(curves, 3) == [2, 0, 1]
    assert allocate(curves, 5) == [3, 1, 1]
    assert allocate(curves, 99) == [3, 2, 1]


def test_fixed_policy_verifies_every_draft():
    step = VerifyStep([[0.9, 0.1], [0.01]], [[0.9, 0.1], [0.01]], 2, 2)
    assert FixedPolicy().lengths(step) == [2, 1]


def test_dynamic_policy_alternates_lengths_until_its_cost_model_is_ready():
    policy = DynamicPolicy()
    step = VerifyStep([survival([0.9] * 4)], [survival([0.9] * 4)], 1, 1)
    assert [policy.lengths(step)[0] for _ in range(4)] == [0, 4, 0, 4]
    for tokens in (1, 1, 1, 5, 5, 5):  # two graph sizes seen: the model decides now
        policy.observe(tokens, 0.010 + 0.001 * tokens, 0.001, 0.0)
    assert policy.cost.ready
    assert policy.lengths(step) == [4]  # 1 ms a token against a 11 ms step: all pay


def test_dynamic_counts_the_host_wait_a_step_with_drafts_exposes():
    """Drafts that pay on the forward alone do not when verifying any costs one host gap
    (overlap lost), and do again when the gap is small."""
    policy = DynamicPolicy()
    for tokens in (64, 64, 64, 128, 128, 128):
        policy.observe(tokens, 0.008 + 0.00004 * tokens, 0.0005, 0.0)
    curves = [survival([0.3])] * 64  # 64 requests, one draft each, kept 30% of the time
    free = VerifyStep(curves, curves, 64, 64)
    assert sum(policy.lengths(free)) == 64  # +2.56 ms for +19 tokens on a 11 ms step: +5.6 %
    assert sum(policy.lengths(VerifyStep(curves, curves, 64, 64, 0.004))) == 0
    # a gap of 0.5 ms leaves +1.8 %, within the margin; 0.1 ms +4.8 %, beyond it
    assert sum(policy.lengths(VerifyStep(curves, curves, 64, 64, 0.0005))) == 0
    assert sum(policy.lengths(VerifyStep(curves, curves, 64, 64, 0.0001))) == 64


def _plan(*prompt_lengths: int) -> StepPlan:
    """A step of one chunk per length: a decode step where every length is 1."""
    return StepPlan([ScheduledChunk(f"r{i}", [1] * n, 0, [0], True)
                     for i, n in enumerate(prompt_lengths)])  # fmt: skip


def test_host_time_is_measured_and_counted_only_under_overlap():
    for overlap in (False, True):
        spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=2),
                            lagged=overlap)  # fmt: skip
        spec.host_time(0.003, _plan(1))
        for _ in range(5):
            spec.host_time(0.002, _plan(1))
        assert spec.host.value() == 0.002
        for tokens in (1, 1, 1, 3, 3, 3):
            spec.policy.observe(tokens, 0.010 + 0.0001 * tokens, 0.0005, 0.0)
        req = request("r")
        spec._proposals["r"] = Proposal(req.num_tokens, [1], [0.2])
        candidate = spec.drafts_for(req, 1)
        assert spec.lengths([candidate], 1, 1) == ([0] if overlap else [1])


def test_under_overlap_only_decode_steps_a_graph_replays_count_as_host_time():
    """An eager step issues its kernels while the device runs them: its long launch is no
    wait a step with drafts exposes. A wave of prompts (eager prefill steps, ~10 ms of
    launch each on an H200) lifted the median and drafts stopped paying at 16 streams."""
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=2),
                        lagged=True)  # fmt: skip
    spec.graphs(4)
    for _ in range(5):
        spec.host_time(0.001, _plan(1, 1))  # decode, replayed
        spec.host_time(0.010, _plan(64, 1))  # a prompt's chunk: eager
        spec.host_time(0.010, _plan(*[1] * 8))  # decode past the graphs: eager
    assert spec.host.value() == 0.001
    plain = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    for _ in range(5):  # without overlap every step waits for its host work
        plain.host_time(0.010, _plan(64, 1))
    assert plain.host.value() == 0.010


def test_under_overlap_a_step_with_drafts_is_priced_at_the_wait_measured_before_such_steps():
    """The device's wait before a step that verifies drafts is its wall interval less its
    device time, measured on replayed decode steps that verified drafts; the host-time
    median stands in until five are. On an H200 the median was 3.7 ms where the wait was
    1.3 ms at 16 streams: long steps looked cheap."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, schedule="dynamic")
    spec = SpecDecoding(config, lagged=True, clock=_Clock())
    spec.graphs(8)
    for _ in range(5):
        spec.host_time(0.004, _plan(1, 1))
    assert spec.exposed_host_s() == 0.004  # nothing measured yet: the proxy
    verify = StepPlan([ScheduledChunk(f"r{i}", [1, 1, 1], 0, [0], True, 2) for i in range(2)])
    plain = _plan(1, 1)
    sampled = {"r0": 0, "r1": 0}
    steps = [(plain, 0.006, 0.006)] + [(verify, 0.0075, 0.006)] * 5  # 1.5 ms idle each
    steps += [(plain, 0.020, 0.006), (_plan(64, 1), 0.030, 0.020)]  # no drafts / eager
    for plan, interval, device in steps:
        spec.clock.now += interval
        spec.observe(plan, StepResult(sampled, timing=StepTiming(device, 0.0, 0.0)))
    assert spec.exposed_host_s() == pytest.approx(0.0015)
    assert spec.host.value() == 0.004
    asked = []
    spec.policy.lengths = lambda step: asked.append(step) or [0] * len(step.curves)
    req = request("r0")
    spec._proposals["r0"] = Proposal(req.num_tokens, [1, 1], [0.9, 0.9])
    spec.lengths([spec.drafts_for(req, 2)], 1, 1)
    (step,) = asked
    assert step.exposed_host_s == pytest.approx(0.0015) and step.host_s == 0.0


def test_a_burst_of_long_waits_shorter_than_half_the_window_leaves_the_exposed_wait():
    """A wave of new requests stalls the host for a few steps, drafts or not: those waits
    are not what drafts expose. Twelve of them after twenty ordinary ones leave the
    estimate where it was; a lasting change moves it once it holds half the window."""
    from engine.spec.manager import EXPOSED_WINDOW

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, schedule="dynamic")
    spec = SpecDecoding(config, lagged=True, clock=_Clock())
    spec.graphs(8)
    verify = StepPlan([ScheduledChunk(f"r{i}", [1, 1, 1], 0, [0], True, 2) for i in range(2)])
    sampled = {"r0": 0, "r1": 0}

    def steps(count: int, wait: float) -> None:
        for _ in range(count):
            spec.clock.now += 0.006 + wait
            spec.observe(verify, StepResult(sampled, timing=StepTiming(0.006, 0.0, 0.0)))

    steps(21, 0.0001)
    steps(12, 0.008)
    assert spec.exposed_host_s() == pytest.approx(0.0001)
    steps(EXPOSED_WINDOW // 2 - 11, 0.008)
    assert spec.exposed_host_s() == pytest.approx(0.008)


def test_a_drafter_on_the_device_prices_no_wait_after_a_step_with_drafts():
    """The step after one with drafts made on the device is planned and launched before
    that one's outcome, as after any step: a wall interval longer than the device time
    there is the host issuing the next (eager) step before it took this outcome, not a
    wait the drafts caused. Priced, it stopped every draft at 16 streams on an H200."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, schedule="dynamic")
    spec = SpecDecoding(config, lagged=True, clock=_Clock(), on_device=True)
    spec.graphs(8)
    verify = StepPlan([ScheduledChunk(f"r{i}", [1, 1, 1], 0, [0], True, 2) for i in range(2)])
    for _ in range(40):
        spec.clock.now += 0.015
        spec.host_time(0.005, verify)
        spec.observe(verify, StepResult({"r0": 0, "r1": 0}, timing=StepTiming(0.006, 0.0, 0.0)))
    assert spec.exposed_host_s() == 0.0
    host = SpecDecoding(config, lagged=True, clock=_Clock())
    host.graphs(8)
    for _ in range(40):
        host.clock.now += 0.015
        host.observe(verify, StepResult({"r0": 0, "r1": 0}, timing=StepTiming(0.006, 0.0, 0.0)))
    assert host.exposed_host_s() == pytest.approx(0.009)


def test_under_overlap_only_a_plan_made_while_a_step_runs_prices_the_total_from_the_last_curves():
    """Budget from step N-2 while step N-1 is in flight; once its outcome is back (a step
    with drafts never overlaps) the latest curves price it: lagged there, a lone request
    verified 3 drafts after its first stale proposal where 5 paid."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, schedule="dynamic")
    spec = SpecDecoding(config, lagged=True, guard=False)
    asked = []
    spec.policy.lengths = lambda step: asked.append(step) or [len(c) for c in step.curves]
    req = request("r0")
    for n, in_flight in ((3, True), (5, True), (3, True), (5, False)):
        spec._proposals["r0"] = Proposal(req.num_tokens, [1] * n, [0.9] * n)
        if in_flight:
            spec.running(StepPlan([]))  # else the outcome of the last step is in: observed
        else:
            spec.observe(StepPlan([]), StepResult({}))
        spec.lengths([spec.drafts_for(req, 5)], 1, 1)
    assert [len(step.curves[0]) for step in asked] == [3, 5, 3, 5]
    assert [len(step.budget_curves[0]) for step in asked] == [3, 3, 3, 5]


def test_dynamic_charges_drafting_only_to_steps_with_drafts():
    """The drafter's proposals are for the next step: a step without drafts lets it rest.
    Counted in every step, 4 ms of drafting made a 20% draft on a 10 ms step look worth
    verifying."""
    policy = DynamicPolicy()
    for tokens in (1, 1, 1, 2, 2, 2):
        policy.observe(tokens, 0.010 + 0.0001 * tokens, 0.0, 0.004)
    step = VerifyStep([[0.2]], [[0.2]], 1, 1)
    assert policy.lengths(step) == [0]  # 1.2 tokens in 14.1 ms against 1 in 10.1 ms
    assert policy.lengths(VerifyStep([[0.5]], [[0.5]], 1, 1)) == [1]  # 1.5 in 14.1 ms


def _measured_with_prefill() -> DynamicPolicy:
    """A dynamic policy that measured decode steps of 64 and 128 rows and eager steps with
    prefill of 256 and 1,024 tokens (~26 us a token)."""
    policy = DynamicPolicy()
    for _ in range(3):
        policy.observe(64, 0.0057, 0.0, 0.0, decode=True)
        policy.observe(128, 0.0070, 0.0, 0.0, decode=True)
        policy.observe(256, 0.010, 0.0, 0.0)
        policy.observe(1024, 0.030, 0.0, 0.0)
    return policy


def test_dynamic_verifies_drafts_in_a_prefill_step_only_where_they_beat_decode_steps():
    """A step with a long prefill yields few tokens for its time whatever it verifies: its
    drafts must add tokens faster than a decode step of the batch yields them, not merely
    raise the step's own rate."""
    policy = _measured_with_prefill()
    curves = [survival([0.8, 0.7])] * 64
    step = VerifyStep(curves, curves, 664, 64, exposed_host_s=0.006, decode=False)
    # 128 drafts: +3.3 ms forward, +6 ms host, ~87 tokens: 9.4 a ms against 11 a ms of a
    # decode step, though they would lift this step's own rate from 3.1 to 5 a ms
    assert best_total(curves, 64, lambda n: 0.0206 + (0.0093 * n / 128 if n else 0)) > 0
    assert sum(policy.lengths(step)) == 0
    cheap = VerifyStep(curves, curves, 664, 64, exposed_host_s=0.001, decode=False)
    # the first drafts (0.8 each) at ~26 us a token pay (~30 a ms); past 128 rows a decode
    # step is priced at its largest point's time per row (55 us), and the drafts in a step
    # with prefill no cheaper: the second drafts (0.56 each) mostly do not pay there
    assert 64 <= sum(policy.lengths(cheap)) < 128
    assert best_gain(curves, 11.0, lambda n: 0.0043 * n / 128) == 128


def test_the_first_price_of_a_step_with_prefill_imports_nothing():
    """Pricing the drafts of a step with prefill the first time runs the Theil-Sen line
    through the steps with prefill (``StepCostModel.draft_time``). It must not import
    anything: ``np.median``'s first call imported ``numpy.ma``, and on the H200 that stalled
    dynamic's first such step by ~40 ms (3 % of a 16-stream point). In a fresh
    interpreter, where nothing else imported it first."""
    code = """
import sys
from engine.spec.policy import DynamicPolicy, VerifyStep
policy = DynamicPolicy()
for _ in range(3):
    policy.observe(64, 0.0057, 0.0, 0.0, decode=True)
    policy.observe(256, 0.010, 0.0, 0.0)
    policy.observe(1024, 0.030, 0.0, 0.0)
    policy.observe(320, 0.012, 0.0, 0.0, drafts=64)
before = set(sys.modules)
curves = [[0.8, 0.56]] * 64
policy.lengths(VerifyStep(curves, curves, 664, 64, decode=False))
print(sorted(set(sys.modules) - before))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_forward_estimator_recovers_baseline_and_slope_through_outliers():
    est = ForwardTimeEstimator()
    rng = random.Random(0)
    for _ in range(400):
        tokens = rng.choice([1, 3, 6, 12, 30, 70])
        noise = rng.gauss(0, 0.0002)
        spike = 0.5 if rng.random() < 0.05 else 0.0  # a step the machine stalled in
        est.add(tokens, 0.008 + 0.0004 * tokens + noise + spike)
    baseline, slope = est.fit()
    assert baseline == pytest.approx(0.008, abs=5e-4)
    assert slope == pytest.approx(0.0004, rel=0.05)


def test_forward_estimator_needs_two_graph_sizes():
    est = ForwardTimeEstimator(min_group=3)
    for _ in range(10):
        est.add(4, 0.01)
    assert not est.ready
    for _ in range(3):
        est.add(100, 0.05)
    assert est.ready and graph_size(4) != graph_size(100)


def test_forward_estimator_never_prices_a_step_below_what_was_measured():
    """Flat while the forward reads its weights, then 0.04 ms a token once compute-bound.
    A measured size costs its bucket's median (a graph replays the whole bucket); a size
    between two measured ones costs the larger one; past the largest, its time per token
    (no headroom assumed) or the last segment's line, whichever is dearer; the optimistic
    price is that line."""
    est = ForwardTimeEstimator(min_group=3)

    def forward(tokens: int) -> float:
        return 0.005 + 0.00004 * max(0, tokens - 128)

    for tokens in (1, 2, 4, 8, 16, 64, 128, 256, 512) * 3:
        est.add(tokens, forward(tokens))
    for tokens in (3, 48, 128, 256, 512):  # measured buckets: their median
        assert est.time(tokens) == pytest.approx(forward(graph_size(tokens)), rel=1e-9)
    assert est.time(20) == pytest.approx(forward(64))  # bucket 32 never ran: bucket 64's
    assert est.time(1536) == pytest.approx(forward(1536))  # the last segment climbs faster
    assert est.time(1536, optimistic=True) == pytest.approx(forward(1536), rel=1e-9)
    for tokens in range(1, 2048, 7):  # never below the true cost of a monotone forward
        assert est.time(tokens) >= forward(tokens) - 1e-12
    assert est.measured(40) and not est.measured(20) and not est.measured(1536)
    baseline, slope = est.fit()
    assert baseline + slope * 1536 < 0.5 * forward(1536)


def test_forward_estimator_keeps_decode_steps_apart_from_prefill_steps():
    """A step of rows on the decode path past the captured graphs (eager) costs what such
    steps cost, not what a prefill step of as many tokens does."""
    est = ForwardTimeEstimator(min_group=2)
    for _ in range(3):
        est.add(128, 0.010, decode=True)  # a graph of 128 rows
        est.add(512, 0.030)  # a prefill step of 512 tokens
    assert est.time(400, decode=True) == pytest.approx(0.010 * 400 / 128)  # never measured
    assert est.time(400) == pytest.approx(0.030)
    for _ in range(3):
        est.add(400, 0.080, decode=True)  # measured: an eager verify step
    assert est.time(400, decode=True) == pytest.approx(0.080)
    assert est.time(400) == pytest.approx(0.030)


def test_forward_estimator_follows_a_regime_change_within_its_window():
    est = ForwardTimeEstimator(group_window=8, min_group=2)
    for _ in range(8):
        est.add(1, 0.005)
        est.add(64, 0.006)
    for _ in range(5):
        est.add(64, 0.020)  # the machine got slower at 64 (another tenant, a bigger KV)
    assert est.time(64) == pytest.approx(0.020)


def test_a_size_measured_in_a_slow_spell_is_priced_at_the_machines_speed_now():
    """Sizes measured at different speeds of the machine are priced at its speed now: on
    an H100 whose verify steps took 1.3-1.4x as long for tens of steps, a size measured
    before the spell looked cheaper than the one running in it, and the policy verified
    one draft a request at 64 streams where three paid (0.81x fixed k = 3)."""
    est = ForwardTimeEstimator()
    for _ in range(8):  # both sizes measured at the usual speed
        est.add(64, 0.007, decode=True)
        est.add(128, 0.008, decode=True)
    for _ in range(8):  # a slow spell: 1.4x
        est.add(64, 0.0098, decode=True)
    assert est.time(64, decode=True) == pytest.approx(0.0098)
    assert est.time(128, decode=True) == pytest.approx(0.0112)  # not run in it: 1.4x too
    for _ in range(6):
        est.add(256, 0.014, decode=True)  # a size first run in the spell
    for _ in range(8):  # the spell is over
        est.add(64, 0.007, decode=True)
    assert est.time(64, decode=True) == pytest.approx(0.007)
    assert est.time(128, decode=True) == pytest.approx(0.008)
    assert est.time(256, decode=True) == pytest.approx(0.010)  # measured at 1.4x
    for _ in range(8):  # steps with prefill say nothing of the level
        est.add(1000, 0.05)
    assert est.time(128, decode=True) == pytest.approx(0.008)


def test_forward_estimator_prices_steps_with_prefill_along_their_measured_line():
    """An eager step's cost grows with every token: inside a group, below its median, it
    is priced along the line between the points on either side, not flat at the median
    (which made drafts added to a long prefill look free)."""
    est = ForwardTimeEstimator(min_group=3)
    for tokens, seconds in ((64, 0.010), (1100, 0.018), (1400, 0.020), (1700, 0.022)) * 3:
        est.add(tokens, seconds)  # groups 64 and 2048 (median 1400 tokens, 20 ms)
    assert est.time(64) == pytest.approx(0.010)
    assert est.time(1100) == pytest.approx(0.010 + 0.010 * (1100 - 64) / (1400 - 64))
    assert est.time(1100) < est.time(1200) < est.time(1400) == pytest.approx(0.020)
    assert est.time(32) == pytest.approx(0.010)  # below every point: the smallest's time


def test_forward_estimator_prices_a_graph_bucket_flat_where_graphs_replay():
    """Decode steps of a bucket the runner replays as a CUDA graph cost the bucket's
    median throughout; climbing past the median along the segment to the bucket below
    (which holds a bucket's jump) priced 128 rows as dear as eager ones. Eager groups past
    the graphs still climb."""
    est = ForwardTimeEstimator(min_group=3)
    for rows, seconds in ((64, 0.0056), (80, 0.0069)) * 3:
        est.add(rows, seconds, decode=True)  # buckets 64 and 128, where only 80 rows ran
    assert est.time(128, decode=True) == pytest.approx(0.0069 + 48 * 0.0013 / 16)  # no graphs
    est.graph_rows = 256
    assert est.time(128, decode=True) == pytest.approx(0.0069)
    assert est.times(64, 64, decode=True)[-1] == pytest.approx(0.0069)
    for rows, seconds in ((300, 0.014), (400, 0.016)) * 3:
        est.add(rows, seconds, decode=True)  # eager, group 512 (median 350 rows)
    assert est.time(450, decode=True) > est.time(350, decode=True)  # it grows there


def test_median_estimator_waits_for_samples_and_ignores_a_spike():
    est = MedianEstimator(window=9, min_samples=5)
    for v in (1.0, 1.1, 0.9, 1.0):
        est.add(v)
    assert not est.ready and est.value(7.0) == 7.0
    est.add(50.0)
    assert est.ready and est.value() == 1.0


def test_step_cost_counts_prefill_tokens():
    cost = StepCostModel()
    for tokens in (2, 2, 2, 40, 40, 40):
        cost.add(tokens, 0.01 + 0.001 * tokens, 0.002, 0.001)
    assert cost.time(40) - cost.time(2) == pytest.approx(0.038, rel=1e-6)


# -- the manager: freshness and the lag ------------------------------------------------------


def scheduler_with(spec: SpecDecoding) -> Scheduler:
    kv = KVCacheManager(BlockPool(64), 4)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 512, spec)


def request(rid: str, prompt_len: int = 5, **kw) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=50, **kw))


def test_drafts_are_used_only_where_they_follow_the_last_token():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    req = request("a")
    spec._proposals["a"] = Proposal(req.num_tokens, [1, 2, 3], [0.9, 0.8, 0.7])
    cand = spec.drafts_for(req, room=2)
    assert cand.token_ids == [1, 2] and cand.curve == pytest.approx([0.9, 0.72])
    req.output_token_ids.append(99)  # a token arrived the proposal did not expect
    assert spec.drafts_for(req, room=3) is None
    req.output_token_ids[-1] = -1  # ... unless it is still unresolved (overlap):
    req.num_unresolved = 1
    cand = spec.drafts_for(req, room=3)  # the first draft is a guess for it
    assert cand.token_ids == [2, 3] and cand.curve == pytest.approx([0.72, 0.504])


def test_opted_out_request_gets_no_drafts():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    req = request("a", speculative=False)
    spec._proposals["a"] = Proposal(req.num_tokens, [1, 2, 3], [0.9, 0.8, 0.7])
    assert spec.drafts_for(req, room=3) is None


class _Recording(FixedPolicy):
    def lengths(self, step: VerifyStep) -> list[int]:
        self.seen = step
        return super().lengths(step)


def test_lagged_budget_uses_the_curves_of_the_previous_plan():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=2), lagged=True)
    spec.policy = _Recording()
    req = request("a")
    assert spec.drafts_for(req, 2) is None  # no proposal yet
    spec._proposals["a"] = Proposal(req.num_tokens, [1, 2], [0.5, 0.5])
    spec.lengths([spec.drafts_for(req, 2)], 1, 1)
    assert spec.policy.seen.budget_curves == spec.policy.seen.curves  # nothing older yet
    spec._proposals["a"] = Proposal(req.num_tokens, [1, 2], [0.9, 0.9])
    spec.lengths([spec.drafts_for(req, 2)], 1, 1)
    assert spec.policy.seen.curves == [pytest.approx([0.9, 0.81])]  # ranks by the latest
    assert spec.policy.seen.budget_curves == [pytest.approx([0.5, 0.25])]  # sized by N-2's
    unlagged = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    unlagged.policy = _Recording()
    unlagged._proposals["a"] = Proposal(req.num_tokens, [1, 2], [0.5, 0.5])
    unlagged.lengths([unlagged.drafts_for(req, 2)], 1, 1)
    unlagged._proposals["a"] = Proposal(req.num_tokens, [1, 2], [0.9, 0.9])
    unlagged.lengths([unlagged.drafts_for(req, 2)], 1, 1)
    assert unlagged.policy.seen.budget_curves == unlagged.policy.seen.curves


def test_scheduler_verifies_drafts_and_gives_back_the_rejected_ones_blocks():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                          schedule="fixed"))  # fmt: skip
    s = scheduler_with(spec)
    s.add(request("a", prompt_len=5))
    plan = s.schedule()  # the prompt
    s.update(plan, StepResult({"a": 7}, proposals={"a": Proposal(6, [8, 9, 10], [0.9] * 3)}))
    plan = s.schedule()
    (chunk,) = plan.chunks
    assert (chunk.token_ids, chunk.start_pos, chunk.num_draft) == ([7, 8, 9, 10], 5, 3)
    req = s.requests["a"]
    assert len(req.blocks) == 3  # positions 0..8: three blocks of four
    out = s.update(plan, StepResult({"a": 42}, accepted={"a": [8]}))
    assert out[0].new_token_ids == [8, 42]
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    assert len(req.blocks) == 2  # the block that held only rejected drafts is back
    s.check_integrity()
    assert spec.counters.verified == [1, 1, 1] and spec.counters.accepted == [1, 0, 0]


def test_a_stop_token_among_the_kept_drafts_ends_the_request_there():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                          schedule="fixed"))  # fmt: skip
    s = scheduler_with(spec)
    s.add(Request("a", [10, 11, 12], SamplingParams(max_tokens=50), eos_token_ids=(2,)))
    plan = s.schedule()
    s.update(plan, StepResult({"a": 7}, proposals={"a": Proposal(4, [8, 2, 9], [0.9] * 3)}))
    plan = s.schedule()
    out = s.update(plan, StepResult({"a": 5}, accepted={"a": [8, 2, 9]}))
    assert out[0].new_token_ids == [8, 2] and out[0].finish_reason == "stop"
    s.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_drafts_respect_max_tokens():
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                          schedule="fixed"))  # fmt: skip
    s = scheduler_with(spec)
    s.add(Request("a", [10, 11, 12], SamplingParams(max_tokens=3)))
    plan = s.schedule()
    s.update(plan, StepResult({"a": 7}, proposals={"a": Proposal(4, [8, 9, 1, 2], [1.0] * 4)}))
    plan = s.schedule()
    assert plan.chunks[0].num_draft == 1  # one more token and this step's sampled one


# -- closed loop: the policy and the guard against synthetic engines -------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(spec: SpecDecoding, forward, batch: int, confidences: list[float],
             rates: list[float], steps: int, hidden_s: float = 0.0, seed: int = 0,
             plain_every: int = 0):  # fmt: skip
    """Run ``steps`` decode steps of ``batch`` requests that always hold drafts of
    ``confidences`` (their true per-position acceptance: ``rates``) against a step of
    ``forward(rows)`` seconds (plus ``hidden_s`` of wall time the timings miss on a step
    with drafts); every ``plain_every``-th step (0: none) holds no drafts, as a new
    request's first step does. Returns per step (drafts verified, tokens yielded,
    seconds)."""
    clock = spec.clock
    rng = random.Random(seed)
    reqs = [request(f"r{i}") for i in range(batch)]
    out = []
    for i in range(steps):
        cands = [Candidate(r, [0] * len(confidences), survival(confidences)) for r in reqs]
        if plain_every and i % plain_every == plain_every - 1:
            lengths = [0] * batch
        else:
            lengths = spec.lengths(cands, batch, batch, decode=True, limit=10_000)
        chunks, sampled, accepted = [], {}, {}
        for r, k in zip(reqs, lengths):
            chunks.append(ScheduledChunk(r.request_id, [0] * (1 + k), 0, [], True, k))
            sampled[r.request_id] = 0
            kept = 0
            while kept < k and rng.random() < rates[kept]:
                kept += 1
            if k:
                accepted[r.request_id] = [0] * kept
        rows = batch + sum(lengths)
        seconds = forward(rows)
        clock.now += seconds + (hidden_s if sum(lengths) else 0.0)
        spec.observe(StepPlan(chunks), StepResult(sampled, accepted=accepted,
                                                  timing=StepTiming(seconds, 0.0, 0.0)))
        out.append((sum(lengths), batch + sum(len(a) for a in accepted.values()),
                    seconds + (hidden_s if sum(lengths) else 0.0)))  # fmt: skip
    return out


def dynamic_spec(guard: bool = True) -> SpecDecoding:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, schedule="dynamic")
    return SpecDecoding(config, guard=guard, clock=_Clock())


RATES = [0.8, 0.7, 0.6, 0.5, 0.4]


def jump_past(rows_graphed: int):
    """A forward flat up to ``rows_graphed`` rows (CUDA graphs), eager and dear past it."""
    return lambda rows: 0.010 if rows <= rows_graphed else 0.010 + 0.0002 * rows


def rate_of(steps) -> float:
    return sum(t for _, t, _ in steps) / sum(s for _, _, s in steps)


def test_a_cost_jump_past_the_graphs_is_not_extrapolated_away():
    """Seeded where every step fit a graph (small batches), the policy meets a batch whose
    every draft takes it past the graphs: it must not price those steps by the flat line
    of the sizes it saw. It converges to no drafts within 64 steps, and later steps with
    drafts are only the guard's probes."""
    spec = dynamic_spec()
    for rows in (1, 2, 4, 8, 16, 32, 64) * 3:  # seen: graphs up to 64 rows, all 10 ms
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)
    steps = simulate(spec, jump_past(64), 64, RATES, RATES, 400)
    late = steps[64:]
    assert sum(1 for n, _, _ in late if n) <= len(late) * 2 / 32
    plain = rate_of([s for s in late if not s[0]])
    assert rate_of(late) >= 0.95 * plain


def test_drafts_within_the_graphs_are_kept_where_they_pay():
    """Same engine, half the batch: drafts up to the graph's rows pay, past it they do not;
    the policy keeps speculating, within the graph."""
    spec = dynamic_spec()
    for rows in (1, 2, 4, 8, 16, 32, 64) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)
    steps = simulate(spec, jump_past(64), 32, RATES, RATES, 400)
    late = steps[64:]
    assert sum(1 for n, _, _ in late if n) >= 0.9 * len(late)
    assert all(32 + n <= 64 for n, _, _ in late if n)  # never past the graph once measured
    assert rate_of(late) > 1.5 * 32 / 0.010


def test_tied_draft_slots_go_to_the_requests_with_the_fewest_tokens_out():
    """Every request's drafts as likely kept: the slots a policy gives tie, and the
    requests furthest behind take them, so that requests admitted together end together
    (served in the batch's order, the same requests took every tied slot, and their
    successors' prompts came a few a step, each step with prefill costing twice a
    decode step)."""

    class Two(VerifyPolicy):
        def lengths(self, step: VerifyStep) -> list[int]:
            return allocate(step.curves, 2)

    spec = dynamic_spec(guard=False)
    spec.policy = Two()
    reqs = [request(f"r{i}") for i in range(4)]
    for i, r in enumerate(reqs):
        r.output_token_ids.extend([7] * (3 - i))  # r3 has the fewest tokens out
    cands = [Candidate(r, [0, 0], survival([0.8, 0.7])) for r in reqs]
    assert spec.lengths(cands, 4, 4, decode=True, limit=100) == [0, 0, 1, 1]


@pytest.mark.parametrize("seed", range(3))
def test_guard_turns_speculation_off_where_it_loses_unseen(seed):
    """A drafter far more confident than right (0.95 claimed, 0.05 true): the cost model
    cannot see it, the realized rate can. After 64 steps the engine runs as fast as
    without speculation (a draft a request about breaks even there, and the guard lets
    that run), and steps of more drafts (which lose 12 %) are rare."""
    spec = dynamic_spec()
    steps = simulate(spec, lambda rows: 0.010 + 0.00005 * rows, 8, [0.95] * 5, [0.05] * 5,
                     600, seed=seed)  # fmt: skip
    late = steps[64:]
    assert rate_of(late) >= 0.98 * 8 / (0.010 + 0.00005 * 8)
    assert sum(1 for n, _, _ in late if n > 8) <= len(late) / 16
    assert spec.counters.guard_blocked > 0
    unguarded = simulate(dynamic_spec(guard=False), lambda rows: 0.010 + 0.00005 * rows, 8,
                         [0.95] * 5, [0.05] * 5, 600, seed=seed)  # fmt: skip
    assert rate_of(late) > 1.1 * rate_of(unguarded[64:])


def test_guard_turns_speculation_off_when_a_cost_hides_from_the_timings():
    """Each step with drafts also costs 40 ms of wall time the device timings miss (host
    work, overlap lost): speculation that pays on paper loses; the guard sees it."""
    spec = dynamic_spec()
    steps = simulate(spec, lambda rows: 0.010 + 0.00002 * rows, 16, RATES, RATES, 600,
                     hidden_s=0.040)  # fmt: skip
    late = steps[64:]
    assert sum(1 for n, _, _ in late if n) <= len(late) * 2 / 32
    assert rate_of(late) >= 0.95 * 16 / (0.010 + 0.00002 * 16)


def test_guard_keeps_speculation_that_pays_and_bounds_its_probes():
    """Calibrated drafts on a flat forward (batch 1): speculation pays ~3x. The guard
    leaves it on; its no-draft probes stay within their stated rates."""
    from engine.spec.guard import PROBE_EVERY, PROBE_STEPS, WARM_PROBE_EVERY

    spec = dynamic_spec()
    n = 2000
    steps = simulate(spec, lambda rows: 0.007 + 0.00001 * rows, 1, RATES, RATES, n)
    plain = sum(1 for k, _, _ in steps if not k)
    warm = 8 * WARM_PROBE_EVERY  # until both modes have their samples
    assert plain <= warm * PROBE_STEPS / WARM_PROBE_EVERY + n * PROBE_STEPS / PROBE_EVERY + 4
    assert spec.counters.guard_probes <= plain + 2
    assert spec.counters.guard_blocked == 0
    assert rate_of(steps) > 2.5 / 0.007


def test_exploration_climbs_one_size_at_a_time_to_drafts_that_pay():
    """Seeded with small steps only, a batch of 16 whose drafts are free up to 128 rows:
    priced pessimistically at first, sizes above are explored one graph size at a time
    (never a jump to one far past what is known) until every draft is verified."""
    spec = dynamic_spec()
    for rows in (1, 2, 4, 8, 16) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)
    steps = simulate(spec, jump_past(128), 16, RATES, RATES, 300)
    measured = [16]
    for n, _, _ in steps:
        if n:
            assert graph_size(16 + n) <= 2 * max(measured)  # one size past the known
            measured.append(graph_size(16 + n))
    assert spec.counters.explored <= 3 * 3  # sizes 32, 64, 128: a few samples each
    assert [n for n, _, _ in steps[-50:]].count(80) >= 45


def test_exploration_tries_an_unmeasured_size_between_measured_ones():
    """Graph sizes 1, 4 and 16 measured, 8 never: priced as 16, the fifth and sixth rows
    of a lone request look dear. The size above the choice is explored (not only the one
    above the step's own), and once measured all five drafts are verified."""
    spec = dynamic_spec()
    costs = {1: 0.0044, 2: 0.0044, 4: 0.00445, 8: 0.00455, 16: 0.0050}
    for rows in (1, 4, 16) * 3:
        spec.policy.observe(rows, costs[rows], 0.0, 0.0, decode=True)
    steps = simulate(spec, lambda rows: costs[graph_size(rows)], 1, RATES, RATES, 80)
    assert spec.policy.cost.forward.measured(6, decode=True)
    assert [n for n, _, _ in steps[-40:]].count(5) >= 36


def test_guard_needs_no_warm_up_probes_where_drafts_beat_the_ceiling():
    """Speculation measured at twice what the steps without drafts could reach at best
    (their tokens over their device time) is ahead without a sample of that mode: no
    probes while the regime warms up, the rarest after. Only the choices that ran count as
    the policy's budget."""
    spec = dynamic_spec()
    steps = simulate(spec, lambda rows: 0.007 + 0.00001 * rows, 1, RATES, RATES, 250)
    key = spec.guard.regime(1, False)
    assert spec.guard.ceiling(key) == pytest.approx(1 / 0.00701, rel=0.01)
    assert spec.guard.rate(key, False) is None  # never needed
    assert spec.counters.guard_probes <= guard.PROBE_STEPS
    assert spec.counters.budget == sum(n for n, _, _ in steps)


def test_guard_skips_its_probes_while_steps_without_drafts_of_their_own_measure_the_ceiling():
    """A lone request speculating at ~2.7x the ceiling, every 48th step without drafts of
    its own (a new request's first): those keep the ceiling measured, so after the warm-up
    no probe without drafts runs (each costs its steps' drafts). Where no such step comes,
    the probes still run at the rarest rate, and keep it measured."""
    fed = dynamic_spec()
    simulate(fed, lambda rows: 0.007 + 0.00001 * rows, 1, RATES, RATES, 64, plain_every=48)
    warm = fed.counters.guard_probes
    simulate(fed, lambda rows: 0.007 + 0.00001 * rows, 1, RATES, RATES, 1200, plain_every=48)
    assert fed.counters.guard_probes == warm
    alone = dynamic_spec()
    simulate(alone, lambda rows: 0.007 + 0.00001 * rows, 1, RATES, RATES, 1200)
    assert alone.counters.guard_probes >= 1200 // (guard.PROBE_EVERY * guard.DECISIVE_SPACING)


def test_guard_times_a_step_without_drafts_as_with_the_drafter_resting():
    """A step without drafts is a sample of no speculation: the drafter's proposals after it
    (for the steps after the probe) are no part of it, though never below its device time."""
    spec = dynamic_spec()
    req = request("a")
    plan = StepPlan([ScheduledChunk("a", [1], 5, [], True)])
    key = spec.guard.regime(1, False)
    for interval, draft in ((0.0, 0.0), (0.020, 0.005), (0.020, 0.015), (0.020, 0.0)):
        spec.clock.now += interval
        spec.observe(plan, StepResult({req.request_id: 0},
                                      timing=StepTiming(0.007, 0.001, draft)))  # fmt: skip
    # (each a sample once the step after it ran in the same mode)
    assert list(spec.guard._regimes[key].samples[False]) == [(1, 0.015), (1, 0.008)]


def test_a_size_made_dear_by_its_first_steps_is_measured_again_once_stale():
    """The first steps of a size pay one-time costs (a kernel compiled, a GEMM planned):
    priced from them, the size was never chosen again and so never measured again. A
    group no step came to for ``stale_after`` steps is forgotten: its size is explored
    again, and the policy goes back to verifying every draft of a lone request."""
    policy = DynamicPolicy()
    forward = policy.cost.forward
    forward.stale_after = 64
    def cost(tokens: int) -> float:
        return 0.001 * (1 + 0.02 * (tokens - 1))

    for _ in range(3):  # 6 tokens (bucket 8): its three first steps took 30 ms each
        policy.observe(6, 0.030, 0.0001, 0.0, True)
        for tokens in (1, 4):
            policy.observe(tokens, cost(tokens), 0.0001, 0.0, True)
    curves = [survival([0.8, 0.7, 0.6, 0.5, 0.4])]
    step = VerifyStep(curves, curves, 1, 1, decode=True)
    chosen = []
    for _ in range(200):
        (n,) = policy.lengths(step)
        chosen.append(n)
        policy.observe(1 + n, cost(1 + n), 0.0001, 0.0, True)
    assert chosen[:20] == [3] * 20  # six tokens priced at 30 ms: four is the most that pays
    assert chosen[-100:] == [5] * 100  # forgotten, explored, measured: every draft pays
    assert forward.measured(6, True)


def test_a_decode_size_measured_dear_long_ago_is_measured_again_where_it_would_pay():
    """A lone request on an H100: its 8-row bucket was first measured on steps of two
    sequences, at 7.7 ms where its own steps take 6.5, and it verified 3 drafts where 5
    paid for 530 steps, until the group went stale. A decode size above the choice that
    no step came to in ``REMEASURE_AFTER`` steps is measured again where it would pay at
    ``REMEASURE_DISCOUNT`` under its measure; one measured dear by far never is."""
    forward_s = {1: 5.83e-3, 2: 5.94e-3, 4: 6.12e-3, 8: 6.53e-3}

    def run(dear_s: float) -> list[int]:
        policy = DynamicPolicy()
        for _ in range(3):  # two-sequence steps in the 8-row bucket, 4-row steps
            policy.observe(7, dear_s, 0.0001, 0.0, True)
            policy.observe(4, forward_s[4], 0.0001, 0.0, True)
        curves = [survival(RATES)]
        step = VerifyStep(curves, curves, 1, 1, decode=True)
        chosen = []
        for _ in range(200):
            (n,) = policy.lengths(step)
            chosen.append(n)
            policy.observe(1 + n, forward_s[graph_size(1 + n)], 0.0001, 0.0, True)
        return chosen

    chosen = run(7.7e-3)
    assert chosen[:40] == [3] * 40  # the 8-row bucket priced at 7.7 ms
    assert chosen[-100:] == [5] * 100  # measured again: every draft pays
    assert 5 not in run(13e-3)  # twice the 4-row step: not worth measuring again


@pytest.mark.parametrize("remeasured", [False, True])
def test_an_explored_size_is_measured_to_the_end_though_the_next_choice_prices_it_under(
    remeasured,
):
    """256 decode streams, 320 rows unmeasured (or measured dear long ago: measured
    again) and worth exploring on fresh curves; the choice after each step is planned
    from curves that price it under the margin (as the plan after a step in flight is).
    A choice of none there was a verdict: the drafter rested, the size's lone sample was
    forgotten after the rest, and on the simulated H100 dynamic verified no draft for the
    whole point. The size goes on being measured, no verdict of none before its samples
    are in; then 384 and 512 rows are explored, and a draft a request (512 rows, the one
    total that pays) is verified."""
    forward_s = {128: 9.0e-3, 256: 12.6e-3, 320: 14.8e-3, 384: 16.9e-3, 512: 21.2e-3}
    policy = DynamicPolicy()
    if remeasured:
        for _ in range(3):
            policy.observe(320, 16.0e-3, 0.0001, 0.0, True)
    for rows in (128, 256) * 3 + (256,) * REMEASURE_AFTER:
        policy.observe(rows, forward_s[rows], 0.0001, 0.0, True)
    fresh, stale = [survival(RATES)] * 256, [survival([0.3] * 5)] * 256
    chosen = []
    for i in range(300):
        curves = stale if i % 2 else fresh
        n = sum(policy.lengths(VerifyStep(curves, curves, 256, 256, decode=True)))
        chosen.append(n)
        if not n and policy.sure:
            assert policy.cost.forward.measured(320, True)  # a verdict, on what is known
        policy.observe(256 + n, forward_s[graph_size(256 + n)], 0.0001, 0.0, True)
    assert policy.cost.forward.measured(320, True)
    assert policy.cost.forward.measured(512, True)
    assert chosen[-100::2] == [256] * 50


def test_an_exploration_fills_its_size_on_the_decode_steps_right_after():
    """16 streams, 16- and 32-row steps measured, 64 rows (three drafts a request) pay
    by far. Once the first step of 64 rows runs, the next decode steps fill that size
    until its samples are in: spread one every ``EXPLORE_EVERY`` steps, they took a
    dozen steps, most of the decode steps a prefill-heavy point has between prompts."""
    forward_s = {16: 7.0e-3, 32: 7.2e-3, 64: 7.6e-3, 128: 9.0e-3}
    policy = DynamicPolicy()
    for rows in (16, 32) * 3:
        policy.observe(rows, forward_s[rows], 0.0001, 0.0, True)
    curves = [survival(RATES)] * 16
    step = VerifyStep(curves, curves, 16, 16, decode=True)
    chosen = []
    while not policy.cost.forward.measured(64, True):
        n = sum(policy.lengths(step))
        chosen.append(n)
        policy.observe(16 + n, forward_s[graph_size(16 + n)], 0.0001, 0.0, True)
        assert len(chosen) < 50
    first = next(i for i, n in enumerate(chosen) if graph_size(16 + n) == 64)
    assert chosen[first:] == [48] * 3


@pytest.mark.parametrize("seed", range(20))
def test_forward_times_in_one_pass_equal_time_of_each(seed):
    rng = random.Random(seed)
    est = ForwardTimeEstimator(min_group=2)
    for _ in range(rng.randint(4, 60)):
        rows = rng.choice([1, 3, 8, 20, 64, 100, 256, 300, 700, 2000])
        est.add(rows, rng.uniform(0.005, 0.05), decode=rng.random() < 0.5)
    if not est.ready:
        return
    for decode in (False, True):
        for optimistic in (False, True):
            start = rng.randint(1, 300)
            table = est.times(start, 1500, decode, optimistic)
            for n in range(0, 1501, 7):
                expected = est.time(start + n, decode, optimistic)
                assert table[n] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def _idle_spec(guard: bool = True) -> SpecDecoding:
    """A dynamic policy whose cost model says no draft pays: a step costs ~its tokens."""
    spec = dynamic_spec(guard)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256) * 3:
        spec.policy.observe(rows, 0.001 * rows, 0.0, 0.0, decode=True)
    return spec


def test_the_drafter_rests_longer_each_time_the_policy_verifies_nothing():
    """One step the policy verifies no draft in rests nothing (one choice, maybe a noisy
    one); each further one in a row lets the drafter rest twice as many steps of its
    regime (no candidates then), up to QUIET_STEPS; after a rest it proposes again and the
    policy is asked; a step of another regime ends the rest at once."""
    from engine.spec.manager import QUIET_STEPS, rest_steps

    assert [rest_steps(z) for z in range(1, 10)] == [0, 2, 4, 8, 16, 32, 64, 128, 128]
    assert QUIET_STEPS == 128
    spec = _idle_spec()
    reqs = [request(f"r{i}") for i in range(64)]
    cands = [Candidate(r, [0] * 5, survival([0.3] * 5)) for r in reqs]
    assert spec.proposes
    assert spec.lengths(cands, 64, 64, decode=True, limit=10_000) == [0] * 64
    assert spec.proposes  # the first verdict: no rest
    for zeros in range(2, 6):
        assert spec.lengths(cands, 64, 64, decode=True, limit=10_000) == [0] * 64
        for _ in range(rest_steps(zeros)):
            assert not spec.proposes
            assert spec.lengths([], 64, 64, decode=True, limit=10_000) == []
        assert spec.proposes
    spec.lengths(cands, 64, 64, decode=True, limit=10_000)
    assert not spec.proposes
    spec.lengths([], 8, 8, decode=True, limit=10_000)  # a batch of another graph size
    assert spec.proposes
    assert spec.counters.guard_probes == 0  # nothing to probe: no step verified drafts


def test_a_rest_ends_on_drafts_that_pay_and_not_on_a_step_that_also_verified_none():
    """Drafts that pay again start the count anew (the next zero rests nothing); a step of
    another regime whose own latest verdicts were no drafts (prefill steps between decode
    steps at high load) leaves the rest as it is."""
    spec = _idle_spec()
    reqs = [request(f"r{i}") for i in range(64)]
    cands = [Candidate(r, [0] * 5, survival([0.3] * 5)) for r in reqs]
    sure = [Candidate(r, [0] * 5, [1.0] * 5) for r in reqs]  # drafts always kept: they pay
    for _ in range(3):
        spec.lengths(cands, 64, 64, decode=True, limit=10_000)
        spec.lengths(cands, 64 + 64, 64, decode=False, limit=10_000)  # with prefill
        while not spec.proposes:
            spec.lengths([], 64, 64, decode=True, limit=10_000)
    assert spec.lengths(cands, 64, 64, decode=True, limit=10_000) == [0] * 64
    assert not spec.proposes
    spec.lengths([], 128, 64, decode=False, limit=10_000)  # prefill, whose verdicts were none
    assert not spec.proposes
    while not spec.proposes:  # the rest over
        spec.lengths([], 64, 64, decode=True, limit=10_000)
    for _ in range(5):  # larger steps now cost what 64 rows do: drafts always kept pay
        for rows in (128, 256, 512):
            spec.policy.observe(rows, 0.064, 0.0, 0.0, decode=True)
    assert sum(spec.lengths(sure, 64, 64, decode=True, limit=10_000)) > 0
    for _ in range(8):  # and again what their rows do
        for rows in (128, 256, 512):
            spec.policy.observe(rows, 0.001 * rows, 0.0, 0.0, decode=True)
    assert spec.lengths(cands, 64, 64, decode=True, limit=10_000) == [0] * 64
    assert spec.proposes  # counted anew: one verdict rests nothing


def test_no_drafts_on_a_size_never_measured_is_no_verdict():
    """The policy verifies nothing in a step of a size its cost model never ran (priced
    past every measured size, as dear per token as the largest): a guess, after which the
    drafter does not rest, however often it repeats."""
    spec = dynamic_spec()
    for rows in (1, 2, 4, 8) * 3:
        spec.policy.observe(rows, 0.001 * rows, 0.0, 0.0, decode=True)
    reqs = [request(f"r{i}") for i in range(64)]
    cands = [Candidate(r, [0] * 5, survival([0.3] * 5)) for r in reqs]
    for _ in range(5):
        assert spec.lengths(cands, 64, 64, decode=True, limit=10_000) == [0] * 64
        assert spec.proposes and not spec.policy.sure


def test_no_draft_probes_only_on_steps_the_policy_verifies_drafts_in():
    """The guard favours speculation and the policy verifies nothing: no probes (they were
    a quarter of the steps while the drafts' mode had no samples)."""
    spec = _idle_spec()
    reqs = [request(f"r{i}") for i in range(64)]
    cands = [Candidate(r, [0] * 5, survival([0.3] * 5)) for r in reqs]
    for _ in range(200):
        spec.lengths(cands, 64, 64, decode=True, limit=10_000)
    assert spec.counters.guard_probes == 0 and spec.counters.guard_blocked == 0


def test_a_blocked_regime_still_probes_at_its_rate_while_the_drafter_rests():
    """Speculation measured slower: the guard blocks and the drafter rests; the steps it
    rests in count towards the guard's probe, which ends the rest when due, so the probes
    keep their stated rate per step of the regime."""
    from engine.spec.guard import PROBE_EVERY

    spec = dynamic_spec()
    key = spec.guard.regime(16, False)
    for speculated, seconds in ((True, 0.02), (False, 0.01)) * 2:  # drafts at half the rate
        for _ in range(6):  # the first after a switch and the last before one: no samples
            spec.guard.record(key, speculated, 16, seconds)
    assert not spec.guard.favours(key)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)  # drafts look free
    reqs = [request(f"r{i}") for i in range(16)]
    cands = [Candidate(r, [0] * 5, survival([0.9] * 5)) for r in reqs]
    verified = proposing = 0
    n = 8 * PROBE_EVERY
    for _ in range(n):
        proposing += spec.proposes
        lengths = spec.lengths(cands if spec.proposes else [], 16, 16, decode=True,
                               limit=10_000)  # fmt: skip
        verified += bool(sum(lengths))
    assert 0 < verified <= 2 * n // PROBE_EVERY + 2
    assert proposing <= n // 8


def test_a_probe_after_the_guards_veto_runs_the_policys_measured_choice():
    """The guard vetoes drafts the policy prices as paying (here: always), and the drafter
    rests. The rests end in the guard's probes of the policy's drafts, and those run the
    choice the policy's measured prices make: no size is forgotten and explored again (a
    veto is not the policy's verdict; on an H100 at 256 streams each probe explored the
    smallest size above the batch, which paid less than no drafts, and the veto held)."""
    spec = dynamic_spec()
    spec.guard.favours = lambda key: False  # type: ignore[method-assign]
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)  # drafts are free
    steps = simulate(spec, jump_past(128), 16, [0.9] * 5, [0.9] * 5, 600)
    probes = [n for n, _, _ in steps if n]
    assert len(probes) >= 3 and all(n == 16 * 5 for n in probes)
    assert spec.counters.explored == 0


def test_a_stall_of_the_host_is_no_sample_nor_the_step_after_it():
    """Under overlap a stall of the host (42 ms among 17 ms steps of drafts) makes one
    step's outcome late and the next one's early (it ran during the stall): neither is a
    sample, so one stall cannot tip a pair (on an H100 at 256 streams it took the median
    gain of drafts that paid 7-15 % under 0)."""
    g = guard.RealizedGainGuard()
    key = g.regime(256, False)
    steps = [0.017] * 6 + [0.042, 0.009] + [0.017] * 4
    for seconds in steps:
        g.record(key, True, 460, seconds, 0.017)
    assert [s for _, s in g._regimes[key].samples[True]] == [0.017] * 9
    assert g.stalls == 1


def test_a_late_outcome_before_a_step_with_prefill_stays_a_sample():
    """The outcome of a decode step before a step with prefill comes late by the host's
    launch of that step, a cost of its own: that is no stall, and stays a sample."""
    g = guard.RealizedGainGuard()
    decode, prefill = g.regime(256, False), g.regime(256, True)
    for seconds in [0.017] * 6 + [0.042]:
        g.record(decode, True, 460, seconds, 0.017)
    g.record(prefill, True, 500, 0.030, 0.030)
    assert [s for _, s in g._regimes[decode].samples[True]][-1] == 0.042
    assert g.stalls == 0


def test_a_mode_whose_every_step_waits_on_the_host_is_sampled_as_it_runs():
    """Steps of drafts whose wall time is always three times their device time (the
    host's work outlasts the device's) are what that mode costs, not stalls: they are
    samples, and the guard sees the drafts lose."""
    g = guard.RealizedGainGuard()
    key = g.regime(16, False)
    for _ in range(4):
        for _ in range(10):
            g.record(key, True, 30, 0.030, 0.010)
        for _ in range(10):
            g.record(key, False, 16, 0.008, 0.008)
    assert g.stalls == 0
    assert len(g._regimes[key].samples[True]) == 32  # the window: 8 a run of 10
    assert not g.favours(key)


def _h200_128(spell: range):
    """A forward of the 8B shape on the H200 by graph bucket (128 rows 6.7 ms, 256 rows
    9.95, eager past them), every step 1.35x as long during ``spell`` (a slow spell of the
    host: its launches hold the device back)."""
    calls = itertools.count()

    def forward(rows: int) -> float:
        seconds = 0.0067 if rows <= 128 else 0.00995 if rows <= 256 else 0.0035 + 3.2e-5 * rows
        return seconds * (1.35 if next(calls) in spell else 1.0)

    return forward


@pytest.mark.parametrize("spell", [range(60, 75), range(100, 130)], ids=["15", "30"])
def test_a_slow_spell_while_drafts_run_does_not_turn_them_off_for_good(spell):
    """128 requests, one draft each pays ~20 % (256 rows in 9.95 ms yield ~230 tokens, 128
    rows in 6.7 ms yield 128). A slow spell of the host while every step verifies drafts
    makes the drafts' size look dear and their realized rate low, against the steps
    without drafts measured before it: neither the cost model nor the guard may then keep
    the drafts off once the spell is over (on the H200 both did, for the rest of a run)."""
    spec = dynamic_spec()
    steps = simulate(spec, _h200_128(spell), 128, RATES, RATES, 400)
    late = steps[spell.stop + 100 :]
    assert sum(1 for n, _, _ in late if n) >= 0.9 * len(late)
    assert rate_of(late) > 1.1 * 128 / 0.0067


def test_the_guard_compares_the_modes_side_by_side():
    """Drafts measured 20 % ahead of steps without them at each switch between the two;
    then a long run of drafts in a slow spell (half the rate), then steps without drafts
    at their usual rate: compared window against window the drafts would look behind,
    side by side they still lead (the one switch out of the spell is one pair of many)."""
    g = guard.RealizedGainGuard()
    key = g.regime(128, False)
    for _ in range(4):  # switches: drafts 240 tokens in 10 ms, none 128 in 6.4
        for _ in range(5):
            g.record(key, True, 240, 0.010)
        for _ in range(5):
            g.record(key, False, 128, 0.0064)
    assert g.gain(key) == pytest.approx(math.log((240 / 0.010) / (128 / 0.0064)))
    for _ in range(30):  # the spell, all drafts
        g.record(key, True, 240, 0.020)
    for _ in range(40):
        g.record(key, False, 128, 0.0064)
    assert g.favours(key)
    assert g.rate(key, True) < g.rate(key, False)  # what the windows alone would say


def test_drafts_in_a_prefill_step_cost_what_prefill_steps_with_drafts_were_measured_at():
    """Steps with prefill that verified drafts took more than the line through all steps
    with prefill says (rows of several tokens per sequence): once some of them are
    measured, a prefill step's drafts are priced at what those took beyond the line a
    draft, and fewer pay."""
    policy = _measured_with_prefill()
    curves = [survival([0.8, 0.7])] * 64
    step = VerifyStep(curves, curves, 300, 64, decode=False)
    before = sum(policy.lengths(step))
    assert before >= 64
    assert not policy.cost.drafted.ready
    for _ in range(3):  # 1.6x the line's price, 128 drafts each
        policy.observe(400, 1.6 * 0.01375, 0.0, 0.0, drafts=128)
        policy.observe(700, 1.6 * 0.02156, 0.0, 0.0, drafts=128)
    assert policy.cost.drafted.ready
    assert sum(policy.lengths(step)) < before // 2
    line = policy.cost.forward.line(False)
    extra = policy.cost.drafted.extra(line)
    policy.observe(600, 0.02, 0.0, 0.0, decode=True, drafts=128)  # a decode step: not those
    assert policy.cost.drafted.extra(line) == extra


def test_drafts_in_a_long_prefill_step_cost_what_they_cost_in_the_short_ones_measured():
    """Steps with prefill that verified 32 drafts measured at 300 and 400 tokens only: a
    step of 900 prompt tokens and 16 sequences prices its drafts at what a draft took
    there beyond the line through all steps with prefill, as it would had such a step of
    1,000 tokens been measured. Priced along the line through the steps with drafts
    alone, past the largest of them as much per token as the largest (a few hundred
    tokens, their fixed costs spread over few), they looked 7 ms dear and none was
    verified."""

    def line(tokens: int) -> float:  # 10 % over the line through all steps with prefill
        return 1.1 * (0.010 + 0.026e-3 * (tokens - 256))

    chosen = []
    for sizes in ((300, 400), (300, 400, 1000)):
        policy = _measured_with_prefill()
        for _ in range(3):
            for tokens in sizes:
                policy.observe(tokens, line(tokens), 0.0, 0.0, drafts=32)
        curves = [survival([0.8, 0.7])] * 16
        chosen.append(sum(policy.lengths(VerifyStep(curves, curves, 900, 16, decode=False))))
    assert chosen == [32, 32]


def test_a_step_next_to_a_switch_of_mode_is_no_sample():
    """Under overlap a step's wall time holds the host's work on the step after it: the
    last step without drafts before a switch carries the planning of the first with
    drafts, and that one the other mode's overlap state. Neither is a sample, nor are the
    last with drafts and the first without at the switch back."""
    g = guard.RealizedGainGuard()
    key = g.regime(16, False)
    steps = ([(False, 0.010)] * 4 + [(False, 0.030), (True, 0.012)] + [(True, 0.020)] * 4
             + [(True, 0.005), (False, 0.050), (False, 0.010)])  # fmt: skip
    for speculated, seconds in steps:
        g.record(key, speculated, 16, seconds)
    samples = g._regimes[key].samples
    assert [s for _, s in samples[False]] == [0.010] * 4
    assert [s for _, s in samples[True]] == [0.020] * 4


def test_a_probe_without_drafts_rests_the_drafter():
    """While drafts are favoured, the guard's probe without drafts runs its steps after
    the first as a rest: nothing is drafted after them and no candidate is looked up or
    priced, so they cost what steps without speculation cost, host work included."""
    spec = dynamic_spec()
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)  # drafts look free
    cands = [Candidate(request(f"r{i}"), [0] * 5, survival([0.9] * 5)) for i in range(16)]
    key = spec.guard.regime(16, False)
    assert any(spec.lengths(cands, 16, 16, decode=True, limit=10_000))  # drafts favoured
    spec.guard._get(key).due = True  # a probe falls due
    assert not any(spec.lengths(cands, 16, 16, decode=True, limit=10_000))
    resting = []
    for _ in range(guard.PROBE_STEPS - 1):
        resting.append(spec.proposes)
        assert not any(spec.lengths([], 16, 16, decode=True, limit=10_000))
    assert resting == [False] * (guard.PROBE_STEPS - 1)
    assert spec.proposes  # the probe is over: drafts are proposed again
    assert any(spec.lengths(cands, 16, 16, decode=True, limit=10_000))


def test_under_overlap_the_drafter_proposes_right_after_a_probe_without_drafts():
    """Under overlap the plan right after a rest has no proposals yet (those of the rest's
    last step are not back). After a rest by the policy's verdict it proposes no second
    time; after the guard's probe it does, for drafts pay there: waiting, the step after
    the first with drafts had none, and a probe of three steps ran five or six without
    drafts (an H100 at 256 decode streams, 0.98x fixed k = 1)."""
    spec = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                          schedule="dynamic"), lagged=True, clock=_Clock())
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:
        spec.policy.observe(rows, 0.010, 0.0, 0.0, decode=True)  # drafts look free
    cands = [Candidate(request(f"r{i}"), [0] * 5, survival([0.9] * 5)) for i in range(16)]
    assert any(spec.lengths(cands, 16, 16, decode=True))  # drafts favoured
    spec.guard._get(spec.guard.regime(16, False)).due = True  # a probe falls due
    assert not any(spec.lengths(cands, 16, 16, decode=True))
    proposing = []
    for _ in range(guard.PROBE_STEPS):  # the probe's rest, then the plan right after
        assert not any(spec.lengths([], 16, 16, decode=True))
        proposing.append(spec.proposes)
    assert proposing == [False] * (guard.PROBE_STEPS - 2) + [True, True]

    verdict = SpecDecoding(SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                             schedule="dynamic"), lagged=True, clock=_Clock())
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:  # drafts far too dear
        verdict.policy.observe(rows, 0.010 * rows, 0.0, 0.0, decode=True)
    for _ in range(2):  # the second verdict of none in a row rests the drafter 2 steps
        assert not any(verdict.lengths(cands, 16, 16, decode=True))
    proposing = []
    for _ in range(3):  # the rest, then the plan right after
        assert not any(verdict.lengths([], 16, 16, decode=True))
        proposing.append(verdict.proposes)
    assert proposing == [False, True, False]


def test_under_overlap_a_step_is_priced_at_least_its_host_time():
    """Under overlap the device waits for the host's work on a step where it is the
    longer: drafts whose host work outlasts the forward they save are not verified, and
    the same drafts with the host's work hidden are."""
    policy = DynamicPolicy()
    for rows in (16, 32, 48, 64, 96, 128) * 3:
        policy.observe(rows, 0.005 + 1e-5 * rows, 0.0001, 0.0, decode=True)
    curves = [survival([0.8, 0.7, 0.6])] * 16
    hidden = VerifyStep(curves, curves, 16, 16, decode=True)
    assert sum(policy.lengths(hidden)) > 16  # cheap rows: most drafts pay

    def host_times(count: int) -> list[float]:  # 2 ms a draft of host work
        return [0.004 + 0.002 * n for n in range(count + 1)]

    exposed = VerifyStep(curves, curves, 16, 16, decode=True, host_times=host_times)
    assert sum(policy.lengths(exposed)) == 0


def _h100_64_streams() -> DynamicPolicy:
    """A dynamic policy that measured the decode steps of 64 streams on an H100: 64 rows
    without drafts (7.1 ms) and 256 with three a request (10.7), graphs up to 512 rows."""
    policy = DynamicPolicy()
    policy.graphs(512)
    for _ in range(3):
        policy.observe(64, 0.0071, 0.0, 0.0, decode=True)
        policy.observe(256, 0.0107, 0.0, 0.0, decode=True)
    return policy


def _took(tokens: int) -> float:
    """A step with prefill of ``tokens`` tokens: 6 ms + 20 us a token."""
    return 0.006 + 20e-6 * tokens


def test_drafts_in_a_prefill_step_are_priced_along_the_samples_slope_not_a_slow_spells():
    """Steps with prefill of 300-500 tokens took 6 ms + 20 us a token, and three of six
    of 540-600 tokens came in a slow spell of the host, twice that: the line between the
    two groups' medians rises ~60 us a token, a step of 561 tokens priced its drafts at
    that, and verified none (on an H100 at 64 decode streams 8-11 such steps a pass,
    ~60 tokens each where drafted ones yielded ~145). Along the samples' own slope (a
    Theil-Sen line, which the spell's few samples do not move) they cost ~20 us each."""
    policy = _h100_64_streams()
    for tokens in (300, 330, 360, 390, 420, 450, 480, 500):
        policy.observe(tokens, _took(tokens), 0.0, 0.0)
    for tokens, spell in ((540, 2), (550, 1), (570, 2), (580, 1), (590, 1), (600, 2)):
        policy.observe(tokens, spell * _took(tokens), 0.0, 0.0)
    assert policy.cost.forward.line(False)[1] == pytest.approx(20e-6, rel=0.05)
    curves = [survival([0.8, 0.7, 0.6])] * 60
    assert sum(policy.lengths(VerifyStep(curves, curves, 561, 60, decode=False))) == 180


def test_what_drafts_cost_in_a_prefill_step_is_each_steps_excess_not_two_lines_apart():
    """Steps with prefill of 200-600 tokens took 6 ms + 20 us a token; those of 200-350
    tokens that verified 100 drafts took 2 ms more, and those of 400-500, in a slow
    spell of the host, 8 ms more. The line through the groups of steps with drafts alone,
    taken at a step of 561 tokens, came 11 ms over the line through all, its drafts 41
    us a token along it: they looked dear and none was verified (on an H100 at 64 decode
    streams, 100 drafts in such a step were priced 6.7 ms over it where they took ~2.5).
    Each step's own excess a draft (their median: 20 us) prices them at what they took."""
    policy = _h100_64_streams()
    for tokens in range(200, 620, 20):
        policy.observe(tokens, _took(tokens), 0.0, 0.0)
    for tokens in (200, 230, 250, 300, 350, 400, 450, 500):
        more = 0.002 if tokens < 400 else 0.008
        policy.observe(tokens, _took(tokens) + more, 0.0, 0.0, drafts=100)
    line = policy.cost.forward.line(False)
    assert policy.cost.drafted.extra(line) == pytest.approx(20e-6, rel=0.1)
    curves = [survival([0.8, 0.7, 0.6])] * 60
    # the first two drafts pay (0.56 a draft of ~40 us, where a decode step yields 8.4 a
    # ms), the third not quite
    assert sum(policy.lengths(VerifyStep(curves, curves, 561, 60, decode=False))) == 120


def test_the_draft_excess_of_a_slow_spell_is_priced_at_the_level_now():
    """Steps with prefill take 6 ms + 20 us a token, 2 ms more with 100 drafts: a draft
    costs 40 us. A slow spell lifts the decode steps 1.5x (the level), and the steps with
    prefill and drafts measured in it took 1.5x as long: a draft then costs 60 us, and
    their excess, kept at the level they came at as the forward's samples are, does not
    count the spell twice (compared as measured against the line at the samples' level,
    a draft would cost 165 us)."""
    cost = StepCostModel()

    def decode(factor: float) -> None:
        cost.add(64, factor * 0.0071, 0.0, 0.0, decode=True)
        cost.add(256, factor * 0.0107, 0.0, 0.0, decode=True)

    for _ in range(3):
        decode(1.0)
    for tokens in range(200, 620, 20):
        cost.add(tokens, _took(tokens), 0.0, 0.0)
    for tokens in (200, 300, 400):
        cost.add(tokens, _took(tokens) + 0.002, 0.0, 0.0, drafts=100)
    assert cost.draft_time() == pytest.approx(40e-6, rel=0.05)
    for _ in range(8):
        decode(1.5)
    assert cost.forward.level == pytest.approx(1.5)
    for tokens in (250, 350, 450, 550, 600):
        cost.add(tokens, 1.5 * (_took(tokens) + 0.002), 0.0, 0.0, drafts=100)
    assert cost.draft_time() == pytest.approx(60e-6, rel=0.05)


@pytest.mark.parametrize(("start", "steps"), [(50, 10), (56, 6), (59, 4)])
def test_no_size_is_first_measured_while_a_slow_spell_moves_the_level(start, steps):
    """128 decode streams on the H200: 384 rows, explored as a slow spell of the device
    ended (256-row steps 12.1 ms where they take 9.6), were kept at the spell's level,
    cheaper than they are; running them alone, the level stayed where their samples put
    it, 256 rows stayed priced at the spell's time, and dynamic verified two and three
    drafts a request for the rest of the point where one paid (0.92x fixed k = 1). Here a
    spell of 1.26x over ``steps`` steps from ``start`` (each trapped it so before): no
    size is explored while the level's ratios disagree, and the policy ends verifying
    one draft a request."""
    forward_s = {128: 7.0e-3, 256: 10.0e-3, 320: 11.7e-3, 384: 13.9e-3, 512: 17.0e-3}

    def time(rows: int) -> float:
        return forward_s[min(s for s in forward_s if s >= graph_size(rows))]

    policy = DynamicPolicy()
    for rows in (128, 256, 320) * 3:
        policy.observe(rows, time(rows), 0.0001, 0.0, True)
    curves = [survival([0.8, 0.7, 0.6])] * 128
    chosen = []
    for i in range(300):
        n = sum(policy.lengths(VerifyStep(curves, curves, 128, 128, decode=True)))
        chosen.append(n)
        slow = 1.26 if start <= i < start + steps else 1.0
        policy.observe(128 + n, slow * time(128 + n), 0.0001, 0.0, True)
    # one draft a request, but for the sizes above measured again now and then
    assert chosen[-100:].count(128) >= 85, chosen
