"""The scheduler's side of speculative decoding: which drafts each step verifies.

``SpecDecoding`` is the one object the scheduler asks. It keeps, per request, the latest
``Proposal`` from the runner's drafter and the survival curve the request had when the
previous step was planned; ``drafts_for`` says which drafts a request can verify now, and
``lengths`` asks the ``VerifyPolicy`` how many of them each request verifies. ``observe``
takes every step's result: the next proposals, the step's times (the policy's cost
model), and how many drafts were kept (the metrics and the estimator's error).

Freshness. A proposal guesses the tokens at indices ``start ..`` of prompt + output. When
the step that made it has been collected, ``start`` is the request's token count and the
drafts follow its last token. Under overlap scheduling the next step is planned while the
one before runs: the request then ends in one token still unresolved, and the latest
proposal is one step old, its first draft a guess for that token. The drafts after it are
still usable — the verifier is exact whatever it is given — with the survival curve moved
by one (the first draft must have been right for the others to be kept). So no plan waits
for the step in flight; with a host drafter what waits is the plan after a step that
verified drafts, since it must know how many were kept to place its tokens. A drafter
``on_device`` drafts behind the step in flight (``drafting``), two past what each request
verifies there (``base.draft_depth``): the plan verifies at most those drafts,
placeholders here (``unresolved_draft``) priced by the request's latest curve,
and the device places the step after the tokens really kept (``engine.runner``), so that
plan does not wait either.

Host time. Under overlap a step without drafts is planned while the one before runs, so
the host's work per step (planning, launching, folding tokens back) is hidden; after a
step that verifies drafts of a host drafter the device waits for it once (a drafter on
the device leaves nothing waiting: no wait is priced, none measured; what looked like one
was the host issuing an eager step before it took the outcome before, on the H200 at 16
streams 8-9 ms a step, and priced it stopped drafts there). ``host_time``
takes each step's host work from the engine: without overlap the policy counts its
median against every step (none is hidden); under overlap a decode step lasts at least
its host work, so the policy prices one with n drafts at no less than the host time of
such steps by size (``_host_times``: measured steps with drafts, linear between sizes;
on a host twice as slow as the simulated H200's, dynamic at 128 streams went from 0.96
to 0.98 of no speculation). ``graphs``
says up to how many rows the runner replays decode steps from CUDA graphs (the cost
model prices those flat inside a bucket).

Lagged statistics. With overlap the policy sizes the total from the curves the requests
had at the previous plan and ranks requests by the latest ones — the source report's rule
(budget from step N-2's statistics, per-request lengths from N-1's), so that a later
confidence never decides whether an earlier draft is verified. Without overlap both are
the latest.

Rest. A step that verifies no draft by a verdict — the dynamic policy's choice on a
measured step size (``DynamicPolicy.sure``; not while its cost model seeds, nor where the
step's own size never ran), or the guard's veto — lets the drafter rest for
``rest_steps`` steps of the same regime (batch graph size, prefill or not): none after
the first such verdict in a row, then 2, 4, .. up to ``QUIET_STEPS`` (128) as it repeats;
a step whose drafts the policy chose and the guard let run starts the count again (not
one that only explores a size never measured: it says nothing yet). When a decode regime's
rest of at least ``RECHECK_AFTER`` steps ends, the verdict is checked rather than repeated
(``VerifyPolicy.recheck``): the step sizes above the regime's that no step came to during
the rest are forgotten, so the policy explores them once more (after every rest, where
drafts do not pay, the explorations and their switches of mode cost 6 % at 256 streams on
an H100). Priced from what they were before the rest, the verdict
could only repeat itself, and on the H200 at 128 streams a slow spell of the host while
every step verified a draft a request left that size priced 35 % over its worth, and no
drafts verified for the rest of the run, where they paid 7 %. A rest the guard's veto
began ends in no such check: the policy's prices were not the verdict, and the guard's
probe of its drafts is to run the choice they make (on an H100 at 256 streams, after a
veto, the sizes forgotten made each probe explore the smallest size above the batch,
which paid less than no drafts, and the veto held for the 40 % of the run left). So
one noisy choice at small batch costs a step, not a rest, and at high load, where the
verdict never changes, the policy is asked about once every 128 steps. A step of another
regime ends the rest, unless that regime's own latest verdicts were no drafts too (the
steps with prefill between decode steps at high load): then it rests as well. The plans
say so (``proposes``, ``StepPlan.propose``), the runner asks the drafter for no proposals
after them, so those steps cost what a step without speculation costs — no drafts
proposed, none looked up, no policy pricing 256 requests' curves (under overlap the plan
right after the verdict still holds drafts proposed before it: it rests too, unpriced).
Then it proposes again and the policy is asked again (under overlap the plan after waits
one step more for those proposals, instead of proposing a second time); the guard ends a
rest early when its probe of the policy's drafts is due. After the guard's probe without
drafts (a rest too, ``_rest_probe``) the plan after proposes as well: drafts pay there,
and while it waited for the proposals of the probe's last step, the step after the
first with drafts had none (a probe of three steps ran five or six without drafts). On
an H100 at 256 decode streams, 7-10 probes a pass, dynamic ran at 0.974-0.982 of
fixed k = 1 in five passes of six, and at 0.989 and 1.000 in the two passes of this
change on the same machine (``bench.spec_decode_gpu --concurrency 128,256``).

The guard. With the dynamic policy a ``RealizedGainGuard`` (``engine.spec.guard``) may
veto its drafts for a step: it compares the measured tokens per second of steps that
verified drafts and of steps that did not, per batch size, and probes the mode it does
not favour at a small bounded rate. ``observe`` feeds it each step's wall time (the
interval between two outcomes, ``clock``; for a step without drafts less the drafter's
time after it, as the step would run with the drafter resting), its device time (a
ceiling on the rate without drafts) and the tokens the step yielded. The policy's
budget, asks and explorations count only for steps its choice stands in (not a probe of
no drafts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import SpeculativeConfig
from engine.plan import StepPlan, StepResult
from engine.request import Request, unresolved_draft
from engine.spec.base import Proposal, draft_depth
from engine.spec.cost import ForwardTimeEstimator, MedianEstimator
from engine.spec.guard import MAX_GAP_FACTOR, RealizedGainGuard
from engine.spec.policy import POLICIES, VerifyPolicy, VerifyStep

QUIET_STEPS = 128  # the longest rest: steps of a regime the drafter rests (``rest_steps``)
RECHECK_AFTER = 8  # a rest this long or longer ends in a check of its verdict (docstring)


def rest_steps(zeros: int) -> int:
    """Steps the drafter rests after the ``zeros``-th step in a row of a regime that
    verified no draft: none after the first (one choice, maybe a noisy one), then 2, 4,
    .. up to ``QUIET_STEPS`` as the verdict repeats."""
    return 0 if zeros <= 1 else min(QUIET_STEPS, 2 ** (zeros - 1))


@dataclass(frozen=True)
class Candidate:
    """Drafts one request can verify in the step being planned."""

    request: Request
    token_ids: list[int]
    curve: list[float]  # survival P_i of each draft, latest statistics


@dataclass
class SpecCounters:
    """Cumulative figures (``EngineStats``' ``spec_*`` fields)."""

    proposed: list[int]  # drafts proposed, by position
    verified: list[int]  # drafts verified, by position
    accepted: list[int]  # drafts kept, by position
    groups: int = 0  # (request, step) pairs that verified drafts
    steps: int = 0  # steps that verified drafts
    expected_milli: int = 0  # sum of the kept drafts expected (the P of the verified ones)
    error_milli: int = 0  # sum of |expected - kept| per group
    time_us: int = 0  # measured step time of the steps the cost model predicted
    time_error_us: int = 0  # sum of |predicted - measured|
    budget: int = 0  # drafts the policy chose, summed over the steps it was asked
    asked: int = 0  # steps the policy was asked and its choice stood (no no-draft probe)
    guard_blocked: int = 0  # steps the guard ran without drafts, not probing
    guard_probes: int = 0  # probe steps (either mode)
    explored: int = 0  # steps the policy verified a total of a size never measured


EXPOSED_WINDOW = 33  # samples of the exposed wait (``SpecDecoding.exposed``)


class SpecDecoding:
    """Drafts and verify lengths for the scheduler (module docstring)."""

    def __init__(
        self, config: SpeculativeConfig, kv_lookahead: int = 0, lagged: bool = False,
        guard: bool | None = None, clock: Callable[[], float] = time.perf_counter,
        on_device: bool = False,
    ) -> None:  # fmt: skip
        """``guard``: the realized-gain guard (default: with the dynamic policy);
        ``clock``: the wall clock it measures steps with; ``on_device``: the drafter drafts
        on the device behind each step (``Drafter.on_device``)."""
        self.config = config
        self.max_draft = config.max_draft
        self.kv_lookahead = kv_lookahead  # KV slots a model drafter writes past a step's
        self.lagged = lagged
        self.on_device = on_device
        # whether the step in flight is followed by drafts made on the device: the plan
        # being made verifies those (``drafts_for``), their tokens known there only
        self.drafting = False
        self._depth: dict[str, int] = {}  # the drafts made behind it, per request (``running``)
        self.policy: VerifyPolicy = POLICIES[config.schedule]()
        self._proposals: dict[str, Proposal] = {}
        self._last_curve: dict[str, list[float]] = {}  # the curve at the previous plan
        self._planned: dict[str, list[float]] = {}  # survival of the drafts being verified
        self.host = MedianEstimator()  # host seconds per step: plan, launch, fold back
        # under overlap, by decode step (a graph's): the host seconds of those without
        # drafts, and of those with drafts by size (``host_times``)
        self.host_plain = MedianEstimator()
        self.host_drafted = ForwardTimeEstimator()
        # lagged, a host drafter: the device's idle seconds before a step that verified
        # drafts, measured (its wall interval less its device time); the host time stands
        # in until then.
        # A long window: a wave of new requests stalls the host for ~10 steps, whose waits
        # are not the drafts' (at 16 streams on an H200 they lifted a 9-sample median from
        # 0.02 to 8.3 ms, and with no draft verified after it nothing brought it down)
        self.exposed = MedianEstimator(window=EXPOSED_WINDOW)
        self._graph_rows = 0  # decode steps of up to this many rows replay graphs
        # lagged: whether a step is running while the next is planned (``running``, until
        # ``observe`` takes its outcome). Only then is the total priced from the curves of
        # the plan before (budget from step N-2): after a step with drafts, which never
        # overlaps, the latest curves are known, and the lag cut a lone request to 3
        # drafts after its first stale proposal, where 5 paid. Before the first step it
        # says nothing: no plan before has curves to lag by
        self.in_flight = True
        if guard is None:
            guard = config.schedule == "dynamic"
        self.guard = RealizedGainGuard() if guard and self.enabled else None
        self.clock = clock
        self._last_outcome: float | None = None
        self._quiet = 0  # steps left that the drafter rests (``proposes``)
        # whether the latest step observed brought proposals: the next plan's drafts can
        # only be those (older ones guess tokens that are known by now)
        self.fresh = True
        self._quiet_key: tuple[int, bool] | None = None
        # per regime: the steps in a row that verified no draft, by the policy's or the
        # guard's verdict (since the policy's drafts last ran there)
        self._zeros: dict[tuple[int, bool], int] = {}
        self._vetoed: set[tuple[int, bool]] = set()  # regimes resting by the guard's veto
        self._resumed = False  # the rest ended at the latest plan (lagged: one more waits)
        self._holding = False  # the plan being made waits for the proposals of the last one
        self._probing = False  # the rest is a probe of the guard's, not a verdict
        k = self.max_draft
        self.counters = SpecCounters([0] * k, [0] * k, [0] * k)

    @property
    def enabled(self) -> bool:
        return self.max_draft > 0

    def drafts_for(self, req: Request, room: int) -> Candidate | None:
        """The drafts ``req`` can verify after its last token, at most ``room`` (None:
        speculation is off for it or it has none)."""
        proposal = self._proposals.get(req.request_id)
        if proposal is None or room <= 0 or not req.sampling.speculative:
            return None
        if self.drafting and req.num_unresolved:  # being drafted on the device, after its
            room = min(room, self._depth.get(req.request_id, self.max_draft))  # that deep,
            curve = proposal.survival()[:room]  # by its latest proposal's curve (lagged)
            return Candidate(req, [unresolved_draft(j) for j in range(len(curve))], curve)
        skip = req.num_tokens - proposal.start
        if skip == 0 or (skip == 1 and req.num_unresolved == 1):
            tokens, curve = proposal.token_ids[skip:], proposal.survival()[skip:]
            if tokens:
                return Candidate(req, tokens[:room], curve[:room])
        return None

    def lengths(
        self, candidates: Sequence[Candidate], base_tokens: int, base_yield: int,
        decode: bool | None = None, limit: int | None = None,
    ) -> list[int]:
        """Drafts each candidate verifies this step (the policy's choice, unless the guard
        vetoes it; none while the drafter rests). ``decode``: every chunk of the step is
        one token (default: as many tokens as sampling chunks); ``limit``: most drafts in
        all (the token budget left)."""
        decode = VerifyStep.is_decode(base_tokens, base_yield, decode)
        key = RealizedGainGuard.regime(base_yield, not decode)
        self._holding = False
        if not candidates or (self._quiet > 0 and self._rests_in(key)):
            # resting (lagged, the plan after the one that began the rest still holds
            # the drafts proposed before it: unpriced, they rest too)
            self._quiet_step(key)
            return [0] * len(candidates)
        self._resumed = False
        self._quiet = 0  # a rest of a regime whose drafts paid lately: asked again
        rested = rest_steps(self._zeros.get(key, 0))
        if decode and rested >= RECHECK_AFTER and key not in self._vetoed:
            # the policy's verdict is checked, not repeated
            self.policy.recheck(base_tokens, decode, rested)
        guard = self.guard
        if guard is None or guard.favours(key):
            # the policy first: a step it verifies no draft in is the guard's concern only
            # as a sample (no probe is needed to run a step without drafts)
            lengths, explored = self._ask(candidates, base_tokens, base_yield, decode, limit)
            if not any(lengths):
                self._go_quiet(key, getattr(self.policy, "sure", True))
            elif guard is not None and not self._allow(key):
                self._rest_probe(key)  # a probe without drafts: its steps after this one rest
                return [0] * len(candidates)
            elif not explored:  # drafts pay here: the next zero rests no step (an
                self._zeros.pop(key, None)  # exploration says nothing yet: the count stays)
            self._count(lengths, explored)
            return lengths
        if self._allow(key):  # a probe of the policy's drafts
            lengths, explored = self._ask(candidates, base_tokens, base_yield, decode, limit)
            self._count(lengths, explored)
            return lengths
        for c in candidates:
            self._last_curve[c.request.request_id] = c.curve
        self._go_quiet(key, vetoed=True)
        return [0] * len(candidates)

    def _allow(self, key: tuple[int, bool]) -> bool:
        guard = self.guard
        assert guard is not None
        probes, blocked = guard.probes, guard.blocked
        allowed = guard.allow(key)
        self.counters.guard_probes += guard.probes - probes
        self.counters.guard_blocked += guard.blocked - blocked
        return allowed

    def _go_quiet(self, key: tuple[int, bool], verdict: bool = True,
                  vetoed: bool = False) -> None:  # fmt: skip
        """This step verifies no draft, by the policy's choice or the guard's
        (``vetoed``): the drafter rests for ``rest_steps`` steps of the same regime
        (``proposes``). ``verdict`` False: the policy's guess (its cost model seeding, or
        the step's size unmeasured), which neither rests nor counts."""
        if not verdict:
            return
        self._probing = False
        if vetoed:
            self._vetoed.add(key)
        else:
            self._vetoed.discard(key)
        zeros = self._zeros[key] = self._zeros.get(key, 0) + 1
        rest = rest_steps(zeros)
        if rest:
            self._quiet, self._quiet_key = rest, key

    def _rest_probe(self, key: tuple[int, bool]) -> None:
        """The guard's probe without drafts began at this step: its other steps are a rest
        of the drafter (``proposes``: nothing drafted after this step, nothing looked up
        or priced), so that they cost what steps without speculation cost, the host's work
        included. A probe that still drafted and priced measured a mode no engine runs:
        on an H100 whose host planned and launched a step of 256 streams in 13 ms with
        the drafter busy, 4 without, the probes made no drafts look no faster than a draft
        a request, and dynamic ran at 0.75x no speculation."""
        assert self.guard is not None
        left = self.guard.rest_probe(key)
        if left:
            self._quiet, self._quiet_key, self._probing = left, key, True

    def _rests_in(self, key: tuple[int, bool]) -> bool:
        """Whether the drafter's rest holds for a step of this regime: the regime it
        began in, or one whose latest verdicts were no drafts too (it would rest itself:
        at high load the steps with prefill between decode steps end no rest)."""
        return key == self._quiet_key or rest_steps(self._zeros.get(key, 0)) > 0

    def _quiet_step(self, key: tuple[int, bool]) -> None:
        """A step planned without candidates: count down the drafter's rest."""
        if self._quiet <= 0:
            if self._resumed:  # lagged: the proposals after the step that ended the rest
                # come with the next plan (after a probe it proposes too: docstring)
                self._resumed, self._holding = False, not self._probing
                self._probing = False
            return
        if not self._rests_in(key):
            self._quiet = 0  # another batch, another answer: ask again
            return
        self._quiet -= 1  # (or one that verified none lately either: it rests too)
        if self.guard is not None and self.guard.tick(key):
            self._quiet = 0  # the guard's probe is due: it needs drafts
        self._resumed = self._quiet == 0 and self.lagged

    @property
    def proposes(self) -> bool:
        """Whether the drafter proposes after the step being planned: not while it rests
        (the policy or the guard verified no draft in this regime lately; module
        docstring)."""
        return self._quiet <= 0 and not self._holding

    def _ask(
        self, candidates: Sequence[Candidate], base_tokens: int, base_yield: int,
        decode: bool, limit: int | None,
    ) -> tuple[list[int], int]:  # fmt: skip
        """The policy's lengths for the candidates, and how many explorations it counted
        for them. Ties for a draft slot go to the requests with the fewest tokens out
        (the policy serves ties in the order it is given the candidates), so requests
        admitted together end together: served in the batch's order, the same requests
        took every tied slot, finished first, and their successors' prompts trickled in a
        few a step, each such step with prefill costing twice a decode step (on an H100
        at 128 decode streams dynamic ran 80 steps with prefill where fixed k = 1 ran 44,
        0.88x its tok/s)."""
        order = sorted(range(len(candidates)),
                       key=lambda i: len(candidates[i].request.output_token_ids))  # fmt: skip
        candidates = [candidates[i] for i in order]
        curves = [c.curve for c in candidates]
        budget_curves = curves
        if self.lagged and self.in_flight:  # the last step's outcome is not back yet
            budget_curves = [
                self._last_curve.get(c.request.request_id, c.curve)[: len(c.curve)]
                for c in candidates
            ]
        for c in candidates:
            self._last_curve[c.request.request_id] = c.curve
        if self.lagged:  # under overlap only a step with drafts waits for the host
            exposed, every = self.exposed_host_s(), 0.0
        else:
            exposed, every = 0.0, self.host.value()
        step = VerifyStep(curves, budget_curves, base_tokens, base_yield, exposed, decode, limit,
                          every, self._host_times(base_tokens))  # fmt: skip
        explored = getattr(self.policy, "explored", 0)
        lengths = [0] * len(order)
        for i, n in zip(order, self.policy.lengths(step), strict=True):
            lengths[i] = n
        return lengths, getattr(self.policy, "explored", 0) - explored

    def _count(self, lengths: list[int], explored: int) -> None:
        """The policy's choice stands for this step: its budget and explorations count."""
        self.counters.asked += 1
        self.counters.budget += sum(lengths)
        self.counters.explored += explored

    def verifying(self, request_id: str, curve: list[float]) -> None:
        """The step being planned verifies drafts of ``request_id`` with these survivals."""
        self._planned[request_id] = curve

    def running(self, plan: StepPlan) -> None:
        """``plan``'s step runs on while the next is planned (overlap); a drafter
        ``on_device`` drafts behind it when it proposes."""
        self.in_flight = True
        self.drafting = self.on_device and plan.propose
        if self.drafting:  # how deep the drafter drafts behind it, per request
            self._depth = {c.request_id: draft_depth(c.num_draft, self.max_draft)
                           for c in plan.chunks if c.sample}  # fmt: skip

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Take in a step's outcome: next proposals, times, kept drafts."""
        self.in_flight = self.drafting = False
        counters = self.counters
        self.fresh = bool(result.proposals)
        for rid, proposal in result.proposals.items():
            self._proposals[rid] = proposal
            for j in range(min(len(proposal.token_ids), self.max_draft)):
                counters.proposed[j] += 1
        for chunk in plan.chunks:  # sampled, nothing proposed: its older proposal is stale
            if chunk.request_id in result.sampled and chunk.request_id not in result.proposals:
                self._proposals.pop(chunk.request_id, None)
        verified = 0
        for chunk in plan.chunks:
            if not chunk.num_draft or chunk.request_id not in result.sampled:
                continue
            kept = len(result.accepted.get(chunk.request_id, ()))
            verified += chunk.num_draft
            counters.groups += 1
            for j in range(chunk.num_draft):
                counters.verified[j] += 1
                counters.accepted[j] += j < kept
            curve = self._planned.pop(chunk.request_id, [])
            expected = sum(curve[: chunk.num_draft])
            counters.expected_milli += round(1000 * expected)
            counters.error_milli += round(1000 * abs(expected - kept))
        counters.steps += verified > 0
        now = self.clock()
        interval = None if self._last_outcome is None else now - self._last_outcome
        self._last_outcome = now
        timing = result.timing
        if timing is not None and not plan.is_empty:
            decode = plan.is_decode
            predicted = self.policy.predicted_time(plan.num_tokens, decode)
            measured = timing.forward_s + timing.sample_s + timing.draft_s
            if predicted is not None:
                counters.time_us += round(1e6 * measured)
                counters.time_error_us += round(1e6 * abs(predicted - measured))
            self.policy.observe(plan.num_tokens, timing.forward_s, timing.sample_s,
                                timing.draft_s, decode, verified)  # fmt: skip
            sampling = sum(c.sample for c in plan.chunks)
            timed = interval is not None and interval <= MAX_GAP_FACTOR * max(measured, 1e-4)
            if (timed and verified and self.lagged and not self.on_device
                    and self._graph_replayed(plan)):  # fmt: skip
                self.exposed.add(max(interval - measured, 0.0))
            if self.guard is not None and sampling:
                yielded = len(result.sampled) + sum(len(t) for t in result.accepted.values())
                key = self.guard.regime(sampling, not decode)
                device = timing.forward_s + timing.sample_s
                if timed:
                    if not verified:  # as it would run with the drafter resting
                        interval = max(device, interval - timing.draft_s)
                    self.guard.record(key, verified > 0, yielded, interval, measured)
                if not verified:
                    self.guard.record_device(key, yielded, device)

    def idle(self) -> None:
        """Nothing is left to run: the wall time until the next outcome measures no step."""
        self._last_outcome = None

    def graphs(self, rows: int) -> None:
        """The runner replays decode steps of up to ``rows`` rows from CUDA graphs: the
        cost model prices a bucket those hold flat (``engine.spec.cost``)."""
        self.policy.graphs(rows)
        self._graph_rows = rows

    def host_time(self, seconds: float, plan: StepPlan) -> None:
        """One engine step's host work (planning and launching ``plan``, folding the step
        before back; never the forward itself): under overlap, what a step that verifies
        drafts leaves the device waiting for (without overlap, what every step waits
        for). Under overlap only decode steps count, those a graph replays where there
        are graphs: an eager step issues its kernels one by one while the device runs
        them, so its long launch hides behind its own forward and says nothing of the
        wait after a step with drafts (counted, a wave of new prompts lifted the median
        to ~10 ms on an H200 and the policy stopped verifying drafts at 16 streams)."""
        replayed = self._graph_replayed(plan)
        if not self.lagged or replayed:
            self.host.add(seconds)
        if self.lagged and replayed:
            if plan.num_draft_tokens:
                self.host_drafted.add(plan.num_tokens, seconds, decode=True)
            else:
                self.host_plain.add(seconds)

    def _host_times(self, base_tokens: int) -> Callable[[int], np.ndarray] | None:
        """Under overlap, the host's seconds on a decode step of ``base_tokens`` rows and
        n = 0..count drafts, once steps with drafts of two sizes were measured (None
        before). The device waits for them where they exceed its step: on an H100 whose
        host planned and launched a verify step of 256 requests in ~20 ms, against 18 of
        device time, fixed-1 ran at 0.74x no speculation."""
        if not self.lagged or not self.host_drafted.ready:
            return None
        plain = self.host_plain.value(self.host.value())
        drafted = self.host_drafted

        def times(count: int) -> np.ndarray:
            if count <= 0:
                return np.array([plain])
            return np.concatenate(
                ([plain], drafted.times(base_tokens + 1, count - 1, True, optimistic=True)))

        return times

    def _graph_replayed(self, plan: StepPlan) -> bool:
        """A decode step, of no more rows than the graphs hold where there are graphs."""
        return plan.is_decode and plan.num_tokens <= (self._graph_rows or plan.num_tokens)

    def exposed_host_s(self) -> float:
        """Under overlap, the seconds the device waits before a step that verifies drafts:
        none for a drafter ``on_device`` (the step after is planned and launched before
        the outcome, as after any step); for a host drafter measured on such decode steps
        (wall interval less device time), the median host time of a step until five are
        (a proxy: it counts host work that overlaps the device's and misses what else the
        wait holds)."""
        return 0.0 if self.on_device else self.exposed.value(self.host.value())

    def forget(self, request_id: str) -> None:
        """The request ended."""
        self._proposals.pop(request_id, None)
        self._last_curve.pop(request_id, None)
        self._planned.pop(request_id, None)

    def stats(self) -> dict[str, object]:
        """The counters as ``EngineStats`` fields."""
        c = self.counters
        return {
            "spec_draft_proposed": list(c.proposed),
            "spec_draft_verified": list(c.verified),
            "spec_draft_accepted": list(c.accepted),
            "spec_verify_groups": c.groups,
            "spec_verify_steps": c.steps,
            "spec_expected_milli": c.expected_milli,
            "spec_error_milli": c.error_milli,
            "spec_time_us": c.time_us,
            "spec_time_error_us": c.time_error_us,
            "spec_budget_drafts": c.budget,
            "spec_budget_steps": c.asked,
            "spec_guard_blocked_steps": c.guard_blocked,
            "spec_guard_probe_steps": c.guard_probes,
            "spec_explored_steps": c.explored,
        }
