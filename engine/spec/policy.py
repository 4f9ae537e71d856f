"""How many drafts each request gets verified in a step: one policy object, two policies.

``VerifyStep`` is the question: the step as scheduled so far (its tokens, prefill ones
included, and how many tokens its sampling chunks yield for sure: one each), and for each
request that could verify drafts its prefix-survival curve (``P_i``, the probability that
draft ``i`` is kept) as the latest statistics give it (``curve``, which ranks requests) and
as the statistics one step older give it (``budget_curve``, which sizes the total).

- ``FixedPolicy``: every request verifies up to K (as many as it has).
- ``DynamicPolicy`` (the source report's DSpark scheduler): with a step-cost model ready,
  ``best_total`` chooses how many drafts to verify in all — start from no draft (one
  token per request), add drafts by descending ``P`` and keep the total with the most
  expected tokens per second, ``(yield + sum of the P added) / time(tokens + drafts)`` —
  and ``allocate`` gives that many draft slots to the requests with the highest marginal
  gain (``P`` of their next draft). For a cost that depends only on the step's token
  count this is the best allocation there is: for each total, the largest ``P`` values
  are the most expected tokens, and a request's curve never rises, so they form a prefix
  of each request's drafts; every total is tried, up to the token budget the step's
  prefill chunks leave (``VerifyStep.limit``), all at once, in arrays (a choice at 256
  requests took 4.6 ms of host time in a loop over the totals, 1.3 so:
  ``bench.spec_decode_sim`` on this repository's CPU). A step with prefill is no cycle of its
  own: its prefill runs whatever is verified, so its rate says nothing of what drafts in
  it are worth (added to a long prefill, drafts raise its rate while adding tokens more
  slowly than a decode step yields them). There ``best_gain`` chooses the total: the
  most expected kept drafts beyond what the time they add yields at the rate of a decode
  step of the batch without drafts. A step's time is its forward's and its sampling's;
  one that verifies any draft also pays the drafter's proposals for the next step (a
  step without drafts lets the drafter rest: counted there, drafting would make no
  speculation look dearer than it is, and at high load drafts pay where they do not)
  and, under overlap scheduling, ``exposed_host_s``: the next step cannot be planned
  until its tokens are known, so the device waits for the host once (``SpecDecoding``
  measures it; without overlap every step waits for it, ``host_s``). Until the cost
  model has samples of two step sizes it verifies every draft in one step and none in
  the next, so that it sees both sizes (prefill steps, whose tokens count, help too). A
  choice of no drafts explores at once (below), and is a verdict (``sure``) only where
  the step's own size was measured: the drafter rests after verdicts only
  (``SpecDecoding``).

  Drafts must *beat* no drafts: by ``MARGIN`` (3 %) of the rate, about the step-cost
  model's error (2-5 % a step on the H200 sweep); an unmeasured size is explored where its
  optimistic price beats the choice by ``EXPLORE_MARGIN`` (half that: an exploration risks
  a few steps, and a choice never explored is never corrected). On the H200 at 256 streams
  of the 8B shape a verify step of 512 rows yielded 22.4 tok/ms where steps without drafts
  yielded 23.8, and the model, right to within its error on both, put them a percent apart
  the other way: a choice on that knife-edge lost 3-4 % over the run. In a step with
  prefill, drafts are priced at least at what they add to a decode step of the step's
  sequences (``base_yield`` rows plus the drafts, the decode kind's points): the prefill
  kind's line, fitted on steps of long prompts, priced steps of a few hundred prompt
  tokens and 400-500 drafts 10-20 % under what they took (the drafts' sequences' contexts
  are read by the prefill path's attention), and drafts packed into them paid 21.4 tok/ms
  against 24.3 without. And at least at a token of the line through the steps with
  prefill each, plus what such steps that verified drafts took beyond that line a draft
  (``engine.spec.cost.DraftCost``). Steps with prefill are few and noisy, and their sizes
  fall in coarse groups (powers of two past the graphs): the rise between two groups'
  medians is the rise between different steps, and the line through the groups of steps
  with drafts, taken at a step's size, extrapolates. So that line is a Theil-Sen line
  through the steps themselves (``ForwardTimeEstimator.line``). On an H100 at 64 decode
  streams, with a slow spell of the host in a few steps of 520-600 tokens, the medians'
  line rose 89 us a token where the steps' own rose ~25, and 100 drafts in a step of 558
  prompt tokens were priced 6.7 ms over it by the line of the steps with drafts (they
  took ~2.5): 8-25 steps of ~500 prompt tokens a pass verified no draft, ~60 tokens
  each, where drafted ones yielded ~145 (0.95-0.97x fixed k = 3).

  Steps are priced by their kind (``VerifyStep.decode``: every chunk one token plus
  drafts, the decode path and its CUDA graphs; or a step with prefill) and never more
  cheaply than measured (``engine.spec.cost``): a size never run costs what the next
  larger measured one costs, or past every measured size as much per token as the largest.
  So an unmeasured size is *explored*: when the optimistic price (the line through the
  neighbouring sizes) says a total in the first unmeasured size above the measured
  choice's size pays more than that choice (by ``EXPLORE_MARGIN``), that total is verified
  (looked for once every ``EXPLORE_EVERY`` steps, at once where the choice is no drafts:
  exploring then risks least), and the size is filled on the decode steps right after
  until it has its samples, whatever the choices meanwhile price it at
  (``_measure_on``); then its measured cost decides, and the next size up may be
  explored. On an H100 at 256 streams, with the full margin, 384 rows priced along the
  line through 256 and 320 came to 24.3 tok/ms against none's 23.8 raised by 3 % (the
  H100's fit prices them at 24.8, and 512 rows at 25.8), nothing was explored past 320,
  and dynamic ran at 0.94x fixed-1 (``bench.spec_decode_sim --machine h100``).
  Sizes are explored one at a time, upwards from the choice (an unmeasured size between
  measured ones too: priced as the larger one, it would otherwise never be tried), so an
  exploration costs at most one graph size more than what is known. None is explored,
  nor measured again, while the cost model's level is not steady (a slow spell beginning
  or ending, ``engine.spec.cost``): a size measured then is kept at a level that is not
  the machine's.

  A measured decode size above the choice that no step came to in ``REMEASURE_AFTER``
  steps is measured again (forgotten, then explored) where the choice would take it at
  ``REMEASURE_DISCOUNT`` under its measure. A size measured dear is never chosen, so never
  measured again: at one stream on an H100 the 8-row bucket, first measured on the
  warm-up's steps of two sequences, was priced at 7.7 ms a step where a lone request's
  steps of that bucket took 6.6, and a lone request verified 3 drafts where 5 paid (3.5 %
  more tokens a second) for 530 steps, until the group went stale (``engine.spec.cost``).
  The discount keeps a size that is dear by far, such as eager steps past the graphs, from
  being measured again and again.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.spec.cost import StepCostModel, graph_size


@dataclass(frozen=True)
class VerifyStep:
    """One step's question to a policy (module docstring)."""

    curves: list[list[float]]  # per candidate: survival P_i of its drafts (latest statistics)
    budget_curves: list[list[float]]  # the same from the statistics one step older
    base_tokens: int  # tokens the step runs without drafts (prefill chunks included)
    base_yield: int  # tokens it yields without drafts (one per sampling chunk)
    exposed_host_s: float = 0.0  # device idle time a step with drafts adds (overlap lost)
    decode: bool | None = None  # every chunk one token (+ drafts); None: base_tokens == base_yield
    limit: int | None = None  # most drafts in all: the token budget left after the chunks
    host_s: float = 0.0  # host work every step waits for (without overlap: none is hidden)
    # under overlap, the host's work on a decode step with n drafts (n = 0..): a step
    # lasts at least that, whatever the device's part (None: not known)
    host_times: Callable[[int], np.ndarray] | None = None

    @staticmethod
    def is_decode(base_tokens: int, base_yield: int, decode: bool | None = None) -> bool:
        """Whether a step is every chunk one token plus drafts: ``decode`` where given,
        else whether it runs as many tokens as it samples."""
        return base_tokens == base_yield if decode is None else decode

    @property
    def decode_only(self) -> bool:
        return self.is_decode(self.base_tokens, self.base_yield, self.decode)


class VerifyPolicy(ABC):
    """Decides the drafts verified per request; learns from the steps that ran."""

    name = "policy"

    @abstractmethod
    def lengths(self, step: VerifyStep) -> list[int]:
        """Drafts to verify per candidate: ``0 <= lengths[i] <= len(step.curves[i])``."""

    def observe(  # noqa: B027
        self, tokens: int, forward_s: float, sample_s: float, draft_s: float,
        decode: bool = False, drafts: int = 0,
    ) -> None:  # fmt: skip
        """A step of ``tokens`` tokens (``decode``: every chunk one token plus drafts;
        ``drafts``: how many it verified) ran in these times."""

    def predicted_time(self, tokens: int, decode: bool = False) -> float | None:
        """The step time the policy expects for ``tokens`` tokens (None: no model)."""
        return None

    def graphs(self, rows: int) -> None:  # noqa: B027
        """Decode steps of up to ``rows`` rows replay CUDA graphs (flat inside a bucket)."""

    def recheck(self, tokens: int, decode: bool, rested: int) -> None:  # noqa: B027
        """A verdict of no drafts on steps of ``tokens`` tokens of this kind is asked again
        after ``rested`` steps without drafts: what it knows of the larger steps, none of
        which ran since, is to be measured again."""


class FixedPolicy(VerifyPolicy):
    name = "fixed"

    def lengths(self, step: VerifyStep) -> list[int]:
        return [len(c) for c in step.curves]


MARGIN = 0.03  # what drafts must pay beyond no drafts (module docstring)
EXPLORE_MARGIN = 0.015  # ... for an unmeasured size to be explored (module docstring)
EXPLORE_EVERY = 4  # steps between two explorations of a step size never measured (a size
# needs 3 samples: 12 steps)
REMEASURE_AFTER = 64  # steps without a sample after which a decode size above the choice
REMEASURE_DISCOUNT = 0.2  # is measured again where it would pay at this much less


class DynamicPolicy(VerifyPolicy):
    name = "dynamic"

    def __init__(self, cost: StepCostModel | None = None) -> None:
        self.cost = cost or StepCostModel()
        self._explore = False
        self._since_explore = EXPLORE_EVERY
        self.explored = 0  # steps that verified a total in a size never measured
        # the decode graph size an exploration began to measure, until its samples are
        # in (``_measure_on``; 0: none)
        self._measuring = 0
        # whether the latest choice, where it was no drafts, is a verdict: the cost model
        # ready and the step's own size measured (else a guess, SpecDecoding rests not)
        self.sure = True

    def observe(
        self, tokens: int, forward_s: float, sample_s: float, draft_s: float,
        decode: bool = False, drafts: int = 0,
    ) -> None:  # fmt: skip
        self.cost.add(tokens, forward_s, sample_s, draft_s, decode, drafts)

    def predicted_time(self, tokens: int, decode: bool = False) -> float | None:
        return self.cost.time(tokens, decode) if self.cost.ready else None

    def graphs(self, rows: int) -> None:
        self.cost.forward.graph_rows = rows

    def recheck(self, tokens: int, decode: bool, rested: int) -> None:
        self.cost.forward.forget_idle(tokens, decode, rested)

    def lengths(self, step: VerifyStep) -> list[int]:
        if not self.cost.ready:
            self.sure = False
            self._explore = not self._explore
            return [0 if self._explore else len(c) for c in step.curves]
        decode = step.decode_only
        forward = self.cost.forward
        # once, medians: sampling every step pays; drafting (the proposals for the next
        # step) only one that speculates: without drafts the drafter rests
        fixed = self.cost.sampler.value() + step.host_s
        drafting = self.cost.drafter.value() + step.exposed_host_s
        drafts = sum(len(c) for c in step.budget_curves)
        if step.limit is not None:
            drafts = min(drafts, max(step.limit, 0))

        def pricer(optimistic: bool, cheaper: int = 0) -> np.ndarray:
            """Seconds of the step with n = 0..drafts drafts."""
            table = forward.times(step.base_tokens, drafts, decode, optimistic)
            if cheaper:  # that graph size priced REMEASURE_DISCOUNT under its measure
                table = np.array([t * (1.0 - REMEASURE_DISCOUNT)
                                  if graph_size(step.base_tokens + n) == cheaper else t
                                  for n, t in enumerate(table)])  # fmt: skip
            if not decode:  # drafts cost at least what they cost in a decode step, and
                # a token of the line through the steps with prefill each, plus what
                # those that verified drafts took beyond it a draft (docstring)
                base = table[0]
                rows = forward.times(step.base_yield, drafts, True, optimistic)
                added = rows - rows[0]
                each = self.cost.draft_time()
                if each is None:
                    added = np.maximum(added, table - base)
                else:
                    added = np.maximum(added, each * np.arange(drafts + 1))
                table = base + added
            out = table + fixed
            out[1:] += drafting
            if step.host_times is not None and decode:  # it waits for the longer of the two
                out = np.maximum(out, step.host_times(drafts))
            return out

        values = survivals(step.budget_curves)
        if decode:
            def choose(time: np.ndarray, limit: int | None, margin: float = MARGIN) -> int:
                return best_total(values, step.base_yield, time, limit, margin)
        else:  # the step's prefill runs anyway: drafts must pay as decode steps would
            rate = step.base_yield / (forward.time(step.base_yield, True) + fixed)

            def choose(time: np.ndarray, limit: int | None, margin: float = MARGIN) -> int:
                return best_gain(values, rate, time, limit, margin)

        total = choose(pricer(False), step.limit)
        self._since_explore += 1
        due = self._since_explore >= EXPLORE_EVERY
        if decode and (more := self._measure_on(step, total)):
            total = more  # an exploration under way goes on at once
        elif (due or not total) and forward.steady:  # (none at once: it risks least; and
            # none while the level moves: a size measured then is kept at the wrong level)
            if due:
                self._since_explore = 0
            # one size past the measured ones at a time: the top of the first unmeasured
            # size above the measured choice (a size below it is no help: fewer drafts)
            frontier = forward.frontier(step.base_tokens + total, decode) - step.base_tokens
            cap = frontier if step.limit is None else min(step.limit, frontier)
            hope = choose(pricer(True), cap, EXPLORE_MARGIN)
            if hope > total and not forward.measured(step.base_tokens + hope, decode):
                total = hope
                self.explored += 1
                self._since_explore = 0
                if decode:
                    self._measuring = graph_size(step.base_tokens + hope)
            elif due and decode:
                total = self._remeasure(step, total, pricer, choose)
        # no drafts is a verdict only where the step's own size was measured
        self.sure = bool(total) or forward.measured(step.base_tokens, decode)
        return allocate(step.curves, total)

    def _remeasure(
        self, step: VerifyStep, total: int, pricer: Callable[..., np.ndarray],
        choose: Callable[..., int],
    ) -> int:  # fmt: skip
        """The total to verify where the smallest decode size above the choice that no
        step came to in ``REMEASURE_AFTER`` steps would pay at ``REMEASURE_DISCOUNT``
        under its measure: one in that size, its samples forgotten (explored again);
        else ``total`` (module docstring)."""
        forward = self.cost.forward
        base = step.base_tokens
        idle = [size for size in forward.idle_sizes(base + total, True, REMEASURE_AFTER)
                if forward.measured(size, True)]  # fmt: skip
        if not idle:
            return total
        cap = idle[0] - base if step.limit is None else min(step.limit, idle[0] - base)
        hope = choose(pricer(False, idle[0]), cap)
        if hope <= total or graph_size(base + hope) != idle[0]:
            return total
        forward.forget(base + hope, True)
        self._measuring = idle[0]
        self.explored += 1
        self._since_explore = 0
        return hope

    def _measure_on(self, step: VerifyStep, total: int) -> int:
        """The total that goes on measuring the decode size an exploration began to
        measure: the drafts that fill it, while its samples are not all in and the
        batch's steps still come to it (0: none, or no longer). It runs on the decode
        steps right after, whether or not the size still looks worth it: the choice
        after an exploration is planned from curves a step old, which priced it under
        the margin, and its verdict of none rested the drafter, after which the size's
        lone sample was forgotten. On the simulated H100 at 256 streams, 320 rows ran
        once every rest so, 384 and 512 rows were never explored above them, and dynamic
        verified no draft for the whole point (0.95x fixed k = 1). At once, not one step
        in ``EXPLORE_EVERY``: a size costs its three samples' steps either way, and spread
        out they took a dozen decode steps, most of what a prefill-heavy point at 16
        streams has between its prompts (on an H100 the 64-row size, three drafts a
        request, was measured only in the second of its two passes, and dynamic verified
        one a request until then: 0.92x fixed k = 4)."""
        size, base = self._measuring, step.base_tokens
        if not size:
            return 0
        drafts = sum(len(c) for c in step.curves)
        if step.limit is not None:
            drafts = min(drafts, max(step.limit, 0))
        fill = min(size - base, drafts)
        if (self.cost.forward.measured(size, True) or fill <= total
                or graph_size(base + fill) != size):  # fmt: skip
            self._measuring = 0  # its samples are in, or the steps no longer come to it
            return 0
        self.explored += 1
        self._since_explore = 0
        return fill


def survivals(curves: Sequence[Sequence[float]]) -> np.ndarray:
    """Every ``P`` of every curve, largest first: the order drafts are added in."""
    values = np.fromiter(itertools.chain.from_iterable(curves), dtype=np.float64)
    return values[np.argsort(-values, kind="stable")]


def _times(time: Callable[[int], float] | Sequence[float], count: int) -> np.ndarray:
    """A step's seconds with n = 0..count drafts, from a table or a function of n."""
    if callable(time):
        return np.array([time(n) for n in range(count + 1)], dtype=np.float64)
    return np.asarray(time, dtype=np.float64)[: count + 1]


def best_total(
    values: np.ndarray | Sequence[Sequence[float]], base_yield: float,
    time: Callable[[int], float] | Sequence[float], limit: int | None = None,
    margin: float = 0.0,
) -> int:  # fmt: skip
    """How many drafts to verify in all: the count ``n`` whose step yields the most
    expected tokens per second, ``(base_yield + the n largest P) / time(n)``, trying every
    ``n`` from 0 to all of them, or to ``limit`` (the first best wins ties); a count
    above 0 only where its rate beats no drafts' by more than ``margin`` (a fraction).
    ``values``: the curves, or their ``survivals``; ``time``: seconds by n, a table or a
    function."""
    if not isinstance(values, np.ndarray):
        values = survivals(values)
    if limit is not None:
        values = values[: max(limit, 0)]
    expected = np.cumsum(np.concatenate(([float(base_yield)], values)))
    rates = expected / _times(time, len(values))
    rates[0] *= 1.0 + margin
    return int(np.argmax(rates))


def best_gain(
    values: np.ndarray | Sequence[Sequence[float]], rate: float,
    time: Callable[[int], float] | Sequence[float], limit: int | None = None,
    margin: float = 0.0,
) -> int:  # fmt: skip
    """How many drafts to verify in all in a step whose own tokens run anyway (prefill):
    the count ``n`` whose expected kept drafts (the ``n`` largest P) exceed most what
    the time they add, ``time(n) - time(0)``, yields at ``rate`` tokens per second (what
    the engine gets without them) raised by ``margin``, trying every ``n`` from 0 to all,
    or to ``limit`` (the first best wins ties). ``values`` and ``time`` as
    ``best_total``'s."""
    if not isinstance(values, np.ndarray):
        values = survivals(values)
    if limit is not None:
        values = values[: max(limit, 0)]
    if not len(values):
        return 0
    times = _times(time, len(values))
    value = np.cumsum(values) - rate * (1.0 + margin) * (times[1:] - times[0])
    best = int(np.argmax(value))
    return best + 1 if value[best] > 0.0 else 0


def allocate(curves: Sequence[Sequence[float]], total: int) -> list[int]:
    """Give ``total`` draft slots to the drafts with the highest ``P``: the ``total``
    largest values over every curve (ties: the earlier request, the earlier draft), which
    take a prefix of each request's drafts since a curve never rises."""
    if total <= 0:
        return [0] * len(curves)
    sizes = [len(curve) for curve in curves]
    if total >= sum(sizes):
        return sizes
    values = np.fromiter(itertools.chain.from_iterable(curves), dtype=np.float64)
    owner = np.repeat(np.arange(len(curves)), sizes)
    cut = -np.partition(-values, total - 1)[total - 1]  # the smallest P given a slot
    lengths = np.bincount(owner[values > cut], minlength=len(curves))
    left = total - int(lengths.sum())
    if left > 0:  # the ties at the cut, in request order
        lengths += np.bincount(owner[np.flatnonzero(values == cut)[:left]],
                               minlength=len(curves))  # fmt: skip
    return lengths.tolist()


POLICIES: dict[str, type[VerifyPolicy]] = {"fixed": FixedPolicy, "dynamic": DynamicPolicy}
