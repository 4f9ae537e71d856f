"""Online estimates of what a step costs, from the steps that ran.

- ``MedianEstimator``: the median of the last ``window`` samples once ``min_samples``
  are in (the sampler's time per step, the drafter's).
- ``ForwardTimeEstimator``: the target forward's time per step size. Samples (the step's
  tokens, prefill ones included, and its forward time) are kept per *kind* and *graph
  size*: the kind says whether every chunk of the step is one token plus drafts (a decode
  step: the runner runs it as rows of the decode path, a CUDA graph by bucket of rows up
  to the captured size, eagerly past it) or not (a step with prefill: eager, its cost
  growing with its tokens); the graph size is the CUDA graph bucket a decode step of that
  many rows replays (on the CPU the same power-of-two groups). Each group keeps its last
  ``group_window`` (48) samples and gives a point (median tokens, median time), so an
  outlier step moves nothing, a slow spell of the host shorter than half the window
  leaves the median where it was (on the H200 at 128 streams one of ~17 steps lifted a
  24-sample median by a third, and the size it priced was no longer chosen), and a
  group follows a lasting change within half the window's steps.

  ``time(tokens, decode)`` prices a step from its own kind's points, and never more
  cheaply than what was measured. Decode steps (graphs by bucket):

  * a measured group: its median time (a graph replays the whole bucket, so a step is
    flat inside it), climbing past the group's median tokens along the line to the next
    measured point of that kind (eager steps inside a group do grow) — except where the
    runner replays CUDA graphs (``graph_rows``: the most rows a graph holds, set through
    ``SpecDecoding.graphs``): a bucket it holds costs its median throughout, since
    climbing there along a segment that spans a bucket's jump would price a step of more
    rows in a measured bucket as a larger bucket, and keep it from ever running;
  * a group never measured below a measured one: the cost of that next larger measured
    group (a forward never costs less for more tokens; the line between the two would
    price a step past a graph's size as if it still replayed one);
  * past the largest measured point: that point's time per token times the tokens (as if
    the forward had no headroom left), or the line along the last two points where that
    climbs faster; steps there are unknown, not cheap.

  Steps with prefill run eagerly, their cost growing with every token, no bucket: up to
  the largest measured point they are priced along the line between the measured points
  on either side (below the smallest, its time), through the points' running maximum
  (never less for more tokens); past it, as a decode step past its largest point. Priced
  flat inside a group, a draft added to a step with prefill would look free wherever the
  step's tokens are below its group's median (a long prefill at high load, whose drafts
  then cost a whole step's host wait for a few tokens).

  ``forget_idle`` forgets the groups above a size that no step came to lately (the policy
  asked again after the drafter rested, ``SpecDecoding``), ``forget`` one group (the
  policy measures a size again, ``engine.spec.policy``); once two groups were measured
  the estimator stays ready on one. A group no step has come to for ``stale_after``
  steps is forgotten (two always stay),
  so its size counts as unmeasured again (and is explored again, ``engine.spec.policy``):
  the first steps of a size pay one-time costs (a kernel compiled, a GEMM's plan made:
  20-110 ms a step of the CPU's tiny model, ~1 ms after), and a group they made dear was
  never chosen again, so never measured again (a lone request verified 3 drafts where 5
  paid).

  The *level*: how fast the machine runs now against the samples kept. A decode step
  of a measured size gives its time over that size's price, and the median of the
  latest ``LEVEL_WINDOW`` (8) such ratios is the level; a sample is kept divided by the
  level when it came, and every price is its samples' times the level now. So a size
  measured in a slow spell of the host or the device is not priced dear once the spell
  is over, nor a size measured before it cheap during it: on an H100 whose 256-row
  verify step took 10.2 ms, then 13-15 for tens of steps, the 128-row size measured
  before the spell (8 ms) looked cheaper than the one running in it, the policy verified
  one draft a request at 64 streams where three paid, and ran at 0.81x fixed k = 3. A
  step with prefill gives no ratio (it costs more than its tokens say where it holds
  drafts: ``DraftCost``); its samples are kept at the level too. The level is *steady*
  while its ratios agree within ``LEVEL_STEADY``; while a spell begins or ends they do
  not, the level lags the machine, and a size first measured then is kept at the wrong
  level (``engine.spec.policy`` measures none then). On the H200 at 128 streams 384 rows,
  explored as a spell of the device ended (256-row steps 12.1 ms for 9.6), were kept at
  the spell's level, cheaper than they are; running them alone, the level stayed where
  their samples put it, 256 rows stayed priced at 12.2 ms, and dynamic verified two and
  three drafts a request for the rest of the point where one paid (0.92x fixed k = 1).

  ``line`` is one Theil-Sen line through the latest samples of a kind, each step its own
  point: its slope (the median of the slopes between every two) is what a token more
  costs, and a slow spell in a few of the steps does not move it, where the rise between
  two groups' medians is that of different steps (``engine.spec.policy`` prices the
  drafts in a step with prefill so).

  ``time(..., optimistic=True)`` is the old line through the points on either side
  (past the last, along the last two): what the policy uses to decide whether an
  unmeasured size is worth *exploring* (``measured`` says whether it is, ``frontier``
  where the first unmeasured size above a step ends). ``fit`` is
  one Theil-Sen line through every point (a summary; pricing is local). The estimator
  is ready once two groups have ``min_group`` samples each.
- ``DraftCost``: what a draft in a step with prefill costs beyond a token of that
  kind's line.
- ``StepCostModel``: the forward's, the sampler's and the drafter's together,
  ``time(tokens)`` of a whole step, and ``DraftCost``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

from engine.cuda_graphs import DEFAULT_BUCKETS


class MedianEstimator:
    """The median of the most recent samples."""

    def __init__(self, window: int = 9, min_samples: int = 5) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._median: float | None = None
        self.min_samples = min_samples

    def add(self, value: float) -> None:
        self._samples.append(value)
        self._median = None

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def value(self, default: float = 0.0) -> float:
        if not self.ready:
            return default
        if self._median is None:  # asked several times a step, added to once
            self._median = statistics.median(self._samples)
        return self._median


def graph_size(tokens: int) -> int:
    """The group a step of ``tokens`` tokens falls in: the smallest CUDA graph bucket that
    holds it, then powers of two past the largest."""
    i = bisect.bisect_left(DEFAULT_BUCKETS, tokens)
    if i < len(DEFAULT_BUCKETS):
        return DEFAULT_BUCKETS[i]
    size = DEFAULT_BUCKETS[-1]
    while size < tokens:
        size *= 2
    return size


Point = tuple[float, float]  # median tokens, median seconds of one group
# a kind's sizes and points, whether eager, and the points' tokens and times as arrays
_Priced = tuple[list[int], list[Point], bool, np.ndarray, np.ndarray]

STALE_AFTER = 512  # steps without a sample after which a group is forgotten (docstring)
PRUNE_EVERY = 32  # steps between two looks for such groups
LEVEL_WINDOW = 8  # the latest steps whose times over their prices make the level (docstring)
LEVEL_STEADY = 1.1  # the most those ratios may spread for the level to be steady (docstring)
LINE_WINDOW = 64  # the latest steps of a kind ``line`` runs through (every pair: 2,016; all
# kept, ~550 at 48 a group, took 7 ms a step with prefill)


class ForwardTimeEstimator:
    """Forward time per step size and kind (module docstring)."""

    def __init__(self, group_window: int = 48, min_group: int = 3,
                 stale_after: int = STALE_AFTER) -> None:  # fmt: skip
        self.group_window = group_window
        self.min_group = min_group
        self.stale_after = stale_after
        self._added = 0  # samples taken so far
        self._seeded = False  # two groups had samples once: a group forgotten since leaves
        # the estimator ready on the one it keeps (``forget_idle``)
        self._last: dict[tuple[bool, int], int] = {}  # per group: its latest sample's number
        self._groups: dict[tuple[bool, int], deque[tuple[int, float]]] = {}
        self._group_points: dict[tuple[bool, int], Point] = {}  # each group's medians
        self._points: dict[bool, list[tuple[int, Point]]] | None = None  # kind -> (group, point)
        self._cache: dict[bool, _Priced] | None = None
        # per kind: its latest ``LINE_WINDOW`` samples, and the ``line`` through them
        self._recent: dict[bool, deque[tuple[int, float]]] = {
            kind: deque(maxlen=LINE_WINDOW) for kind in (False, True)}  # fmt: skip
        self._lines: dict[bool, tuple[float, float] | None] = {}
        # decode steps of up to this many rows replay a CUDA graph (0: none do, eager)
        self.graph_rows = 0
        # how fast the machine runs now against the samples kept: those are kept as
        # measured over the level then, and priced times the level now (docstring)
        self.level = 1.0
        self._ratios: deque[float] = deque(maxlen=LEVEL_WINDOW)

    def add(self, tokens: int, seconds: float, decode: bool = False) -> None:
        key = (decode, graph_size(tokens))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = deque(maxlen=self.group_window)
        elif decode and seconds > 0 and len(group) >= self.min_group and self.ready:
            price = self.time(tokens, decode)  # what the samples kept say, at the level
            if price > 0:
                self._ratios.append(self.level * seconds / price)
                self.level = statistics.median(self._ratios)
        group.append((tokens, seconds / self.level))
        self._recent[decode].append((tokens, seconds / self.level))
        self._lines.pop(decode, None)
        self._added += 1
        self._last[key] = self._added
        self._group_points.pop(key, None)
        self._points = self._cache = None
        if self._added % PRUNE_EVERY == 0:
            # the stale ones, oldest first, while two groups stay (``ready`` needs two)
            stale = sorted((n, k) for k, n in self._last.items()
                           if self._added - n > self.stale_after)  # fmt: skip
            self._forget([old for _, old in stale[: max(len(self._groups) - 2, 0)]])

    @property
    def steady(self) -> bool:
        """Whether the ratios the level is the median of agree within ``LEVEL_STEADY``:
        not while a slow spell begins or ends (module docstring)."""
        return not self._ratios or max(self._ratios) <= LEVEL_STEADY * min(self._ratios)

    def forget_idle(self, tokens: int, decode: bool, steps: int) -> int:
        """Forget the groups of this kind above a step of ``tokens`` tokens that no step
        came to in the last ``steps`` steps (one group always stays); how many went. A
        verdict of no drafts asked again after the drafter rested that long
        (``SpecDecoding``): priced from the samples they had, the sizes with drafts
        would be priced as they were before the rest, so the verdict would only repeat
        itself, and sizes made dear by a slow spell of the host would never run again
        (``engine.spec.policy`` explores a forgotten size once more, the smallest first;
        one larger size kept dear, the line to it would keep the smaller from looking
        worth exploring). The step's own size stays, so the estimator stays ready."""
        idle = [(decode, size) for size in self.idle_sizes(tokens, decode, steps)]
        idle = idle[: max(len(self._groups) - 1, 0)]
        self._forget(idle)
        return len(idle)

    def idle_sizes(self, tokens: int, decode: bool, steps: int) -> list[int]:
        """The sizes of the groups of this kind above a step of ``tokens`` tokens that no
        step came to in the last ``steps`` steps, smallest first."""
        size = graph_size(tokens)
        return sorted(key[1] for key, last in self._last.items()
                      if key[0] == decode and key[1] > size and self._added - last >= steps)

    def forget(self, tokens: int, decode: bool) -> None:
        """Forget the group of a step of ``tokens`` tokens of this kind: its size counts
        as never measured."""
        key = (decode, graph_size(tokens))
        if key in self._groups:
            self._forget([key])

    def _forget(self, keys: list[tuple[bool, int]]) -> None:
        """Drop these groups and what was derived from them."""
        for key in keys:
            del self._groups[key], self._last[key]
            self._group_points.pop(key, None)
        if keys:
            self._points = self._cache = None

    def _kind_points(self) -> dict[bool, list[tuple[int, Point]]]:
        if self._points is None:
            points: dict[bool, list[tuple[int, Point]]] = {False: [], True: []}
            for key, g in sorted(self._groups.items()):
                if len(g) >= self.min_group:
                    point = self._group_points.get(key)
                    if point is None:  # only the group a sample came to is priced again
                        point = self._group_points[key] = (
                            statistics.median(t for t, _ in g),
                            statistics.median(s for _, s in g),
                        )  # fmt: skip
                    points[key[0]].append((key[1], point))
            self._points = points
        return self._points

    def _priced(self, decode: bool) -> _Priced:
        """The sizes and points a step of this kind is priced from, whether they are
        eager steps' (with prefill: their running maximum), and the points' tokens and
        times as arrays, cached until a sample arrives (the policy prices every step)."""
        if self._cache is None:
            self._cache = {}
        cached = self._cache.get(decode)
        if cached is None:
            kinds = self._kind_points()
            kind = decode if kinds[decode] else not decode
            points = [p for _, p in kinds[kind]]
            if not kind:
                points = _running_max(points)
            cached = self._cache[decode] = (
                [size for size, _ in kinds[kind]], points, not kind,
                np.array([t for t, _ in points]), np.array([s for _, s in points]))  # fmt: skip
        return cached

    def points(self, decode: bool) -> list[Point]:
        """The measured points of a kind, by size (the other kind's when it has none)."""
        kinds = self._kind_points()
        mine = kinds[decode] or kinds[not decode]
        return [p for _, p in mine]

    @property
    def ready(self) -> bool:
        kinds = self._kind_points()
        groups = len(kinds[False]) + len(kinds[True])
        self._seeded = self._seeded or groups >= 2
        return groups >= 2 or (self._seeded and groups >= 1)

    def measured(self, tokens: int, decode: bool = False) -> bool:
        """Whether the group of a step of ``tokens`` tokens of this kind has samples (of
        the other kind while this one has none, as ``time`` prices it)."""
        if not self._kind_points()[decode]:
            decode = not decode  # priced from the other kind's points: measured as those
        g = self._groups.get((decode, graph_size(tokens)))
        return g is not None and len(g) >= self.min_group

    def frontier(self, tokens: int, decode: bool = False) -> int:
        """The most tokens of a step that stays within the first unmeasured group above
        ``tokens`` (its graph size; its own if unmeasured)."""
        size = graph_size(tokens)
        while self.measured(size, decode):
            size = graph_size(size + 1)
        return size

    def fit(self) -> tuple[float, float] | None:
        """(baseline, slope) in seconds and seconds per token of one line through every
        point (Theil-Sen, baseline never below 0); None until the estimator is ready."""
        if not self.ready:
            return None
        kinds = self._kind_points()
        line = _theil_sen([p for _, p in kinds[False] + kinds[True]])
        if line is None:
            return None
        baseline, slope = line
        return self.level * max(baseline, 0.0), self.level * slope

    def line(self, decode: bool = False) -> tuple[float, float] | None:
        """(baseline, slope) of one Theil-Sen line through the latest ``LINE_WINDOW``
        samples of a kind, each step its own point (not the groups' medians): the slope is
        the median of the slopes between every two samples of different sizes (never below
        0), the baseline the median of what each sample took beyond it; None while there
        are fewer than ``min_group`` samples or all of one size. What a token more costs
        an eager step: along the groups' points it is the rise between two medians of
        different steps, which a slow spell of the host in one group multiplies (module
        docstring)."""
        if decode not in self._lines:
            recent = self._recent[decode]
            self._lines[decode] = _theil_sen(recent) if len(recent) >= self.min_group else None
        line = self._lines[decode]  # at the samples' level
        return None if line is None else (self.level * line[0], self.level * line[1])

    def time(self, tokens: int, decode: bool = False, optimistic: bool = False) -> float:
        """Seconds for a forward of ``tokens`` tokens of this kind (module docstring)."""
        return self.level * self._time(tokens, decode, optimistic)

    def _time(self, tokens: int, decode: bool, optimistic: bool) -> float:
        """``time`` at the samples' level."""
        if not self.ready:
            raise RuntimeError("the forward time estimator has too few samples")
        sizes, points, eager, _, _ = self._priced(decode)
        if optimistic:
            return _local_line(points, tokens)
        if eager and tokens <= points[-1][0]:
            return _eager(points, tokens)
        size = graph_size(tokens)
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:  # measured: flat, then up to the next point
            t, s = points[i]
            if tokens <= t or (not eager and size <= self.graph_rows):  # a graph's bucket
                return s
            if i + 1 < len(points):
                (ta, sa), (tb, sb) = points[i], points[i + 1]
            elif i > 0:
                (ta, sa), (tb, sb) = points[i - 1], points[i]
            else:
                return s
            slope = max((sb - sa) / (tb - ta), 0.0) if tb > ta else 0.0
            return s + slope * (tokens - t)
        if i < len(points):  # between measured sizes: the next larger one's cost
            return points[i][1]
        t, s = points[-1]  # past every measured size: no headroom assumed
        return max(s * tokens / t if t > 0 else s, _local_line(points, tokens))

    def times(
        self, start: int, count: int, decode: bool = False, optimistic: bool = False
    ) -> np.ndarray:
        """``time(start + n)`` for n = 0..count in one pass, as an array (the policy prices
        every total of a step: at 256 requests of 5 drafts, 1281 of them)."""
        out = self._times(start, count, decode, optimistic)
        return out if self.level == 1.0 else out * self.level

    def _times(self, start: int, count: int, decode: bool, optimistic: bool) -> np.ndarray:
        """``times`` at the samples' level."""
        if not self.ready:
            raise RuntimeError("the forward time estimator has too few samples")
        sizes, points, eager, ts, ss = self._priced(decode)
        ns = np.arange(start, start + count + 1, dtype=np.float64)
        if optimistic:
            if len(points) == 1:
                return np.full(count + 1, points[0][1])
            # the segment each total falls on: ``bisect_left(ts, n, 1, len - 1)``
            i = np.searchsorted(ts[1:-1], ns) + 1
            t1, s1, t2, s2 = ts[i - 1], ss[i - 1], ts[i], ss[i]
            rise = t2 > t1
            slope = np.where(rise, np.maximum((s2 - s1) / np.where(rise, t2 - t1, 1.0), 0.0), 0.0)
            return np.maximum(s1 + slope * (ns - t1), 0.0)
        out = np.empty(count + 1)
        tokens, end = start, start + count
        graphs = 0 if eager else self.graph_rows
        if eager:  # up to the largest point: along the line between the points around
            last = min(end, math.floor(points[-1][0]))
            if last >= tokens:
                n = ns[: last - tokens + 1]
                i = np.searchsorted(ts, n)  # the first point at or above n
                if len(ts) == 1:  # (every n at or below it)
                    out[: len(n)] = ss[0]
                else:
                    j = np.maximum(i, 1)
                    t1, s1, t2, s2 = ts[j - 1], ss[j - 1], ts[j], ss[j]
                    out[: len(n)] = np.where(i == 0, ss[0],
                                             s1 + (s2 - s1) * (n - t1) / (t2 - t1))  # fmt: skip
            tokens = max(tokens, last + 1)
        while tokens <= end:  # one graph size at a time: one piece each
            size = graph_size(tokens)
            t, s, slope, per_token = _piece(size, sizes, points, graphs)
            lo, hi = tokens - start, min(size, end) - start + 1
            if slope or per_token:
                n = ns[lo:hi]
                value = np.where(n > t, s + slope * (n - t), s) if slope else s
                out[lo:hi] = np.maximum(value, per_token * n)
            else:  # flat (a graph's bucket)
                out[lo:hi] = s
            tokens = size + 1
        return out


def _piece(
    size: int, sizes: list[int], points: list[Point], graph_rows: int = 0
) -> tuple[float, float, float, float]:
    """``ForwardTimeEstimator.time`` inside one graph size, as ``(t, s, slope, per_token)``:
    ``max(s + slope * max(tokens - t, 0), per_token * tokens)``."""
    i = bisect.bisect_left(sizes, size)
    if i < len(sizes) and sizes[i] == size:
        t, s = points[i]
        if size <= graph_rows:
            return t, s, 0.0, 0.0
        if i + 1 < len(points):
            (ta, sa), (tb, sb) = points[i], points[i + 1]
        elif i > 0:
            (ta, sa), (tb, sb) = points[i - 1], points[i]
        else:
            return t, s, 0.0, 0.0
        return t, s, max((sb - sa) / (tb - ta), 0.0) if tb > ta else 0.0, 0.0
    if i < len(points):
        return float("inf"), points[i][1], 0.0, 0.0
    t, s = points[-1]
    per_token = s / t if t > 0 else 0.0
    if len(points) == 1:
        return t, s, 0.0, per_token
    (t1, s1), (t2, s2) = points[-2], points[-1]
    return t1, s1, max((s2 - s1) / (t2 - t1), 0.0) if t2 > t1 else 0.0, per_token


def _theil_sen(points: Sequence[Point]) -> tuple[float, float] | None:
    """(baseline, slope) of the Theil-Sen line through ``(tokens, seconds)`` points: the
    median of the slopes between every two of different tokens (never below 0), and the
    median of what each point took beyond it; None where all have the same tokens."""
    tokens = np.array([t for t, _ in points], dtype=np.float64)
    seconds = np.array([s for _, s in points], dtype=np.float64)
    rise = tokens[None, :] - tokens[:, None]
    up = rise > 0  # each pair once, of different tokens
    if not up.any():
        return None
    slope = max(_median((seconds[None, :] - seconds[:, None])[up] / rise[up]), 0.0)
    return _median(seconds - slope * tokens), slope


def _median(values: np.ndarray) -> float:
    """The median of ``values``, by partition: ``np.median``'s first call imports
    ``numpy.ma`` (its NaN check), and on the H200's host that import (~40 ms) stalled the
    first step with prefill the dynamic policy priced."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    low, high = np.partition(values, (half - 1, half))[half - 1 : half + 1]
    return float((low + high) / 2)


def _running_max(points: list[Point]) -> list[Point]:
    """The points with each time raised to the largest before it."""
    out, top = [], 0.0
    for t, s in points:
        top = max(top, s)
        out.append((t, top))
    return out


def _eager(points: list[Point], tokens: int) -> float:
    """An eager step's price up to the largest point: the line between the points on
    either side of ``tokens``, the smallest point's time below it."""
    if tokens <= points[0][0]:
        return points[0][1]
    return _local_line(points, tokens)


def _local_line(points: list[Point], tokens: int) -> float:
    """The line through the two points on either side of ``tokens`` (past the last,
    the last two; slopes never below 0)."""
    if len(points) == 1:
        return points[0][1]
    i = bisect.bisect_left([t for t, _ in points], tokens, 1, len(points) - 1)
    (t1, s1), (t2, s2) = points[i - 1], points[i]
    slope = max((s2 - s1) / (t2 - t1), 0.0) if t2 > t1 else 0.0
    return max(s1 + slope * (tokens - t1), 0.0)


class DraftCost:
    """What a draft in a step with prefill costs beyond a token of that kind's line: the
    median, over the latest ``window`` such steps that verified drafts, of the time each
    took beyond the line through every step with prefill (``ForwardTimeEstimator.line``)
    over its drafts. Their rows of several tokens per sequence cost more than their count
    says: on the H200 at 64 streams of the 8B shape, steps of a few hundred prompt tokens
    and ~190 drafts took 1.4-1.8x what the line through all steps with prefill priced
    them at, ~45 us a draft, and such drafts yielded 7.7 tok/ms where a decode step
    yields 11.4. A median of each step's own excess, not a line through these steps
    apart: two lines' difference at a step's size is an extrapolation of both, and the
    policy priced 100 drafts in a step of 558 prompt tokens 6.7 ms over the line through
    all (an H100 at 64 decode streams, where they took ~2.5)."""

    def __init__(self, window: int = 48, min_samples: int = 3) -> None:
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.min_samples = min_samples

    def add(self, tokens: int, drafts: int, seconds: float) -> None:
        self._samples.append((tokens, drafts, seconds))

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def extra(self, line: tuple[float, float], level: float = 1.0) -> float:
        """Seconds a draft costs beyond ``line``'s slope, its samples (kept at the level
        they came at) times ``level`` (0 until ready; never below 0)."""
        if not self.ready:
            return 0.0
        baseline, slope = line
        excess = statistics.median((level * s - baseline - slope * t) / d
                                   for t, d, s in self._samples)  # fmt: skip
        return max(excess, 0.0)


class StepCostModel:
    """Seconds one step takes: the forward of its tokens, then sampling, then drafting.

    ``drafted``: what the drafts of steps with prefill cost beyond those steps' line
    (``DraftCost``), its samples kept at the forward's level as the forward's are."""

    def __init__(self) -> None:
        self.forward = ForwardTimeEstimator()
        self.drafted = DraftCost()
        self.sampler = MedianEstimator()
        self.drafter = MedianEstimator()

    def add(
        self, tokens: int, forward_s: float, sample_s: float, draft_s: float,
        decode: bool = False, drafts: int = 0,
    ) -> None:  # fmt: skip
        self.forward.add(tokens, forward_s, decode)
        if drafts and not decode:
            self.drafted.add(tokens, drafts, forward_s / self.forward.level)
        self.sampler.add(sample_s)
        self.drafter.add(draft_s)

    def draft_time(self) -> float | None:
        """Seconds a draft adds to a step with prefill: a token of the line through those
        steps and ``DraftCost``'s excess (None while there is no line)."""
        line = self.forward.line(False)
        if line is None:
            return None
        return line[1] + self.drafted.extra(line, self.forward.level)

    @property
    def ready(self) -> bool:
        return self.forward.ready and self.sampler.ready

    def time(self, tokens: int, decode: bool = False, optimistic: bool = False) -> float:
        return (self.forward.time(tokens, decode, optimistic) + self.sampler.value()
                + self.drafter.value())  # fmt: skip
