"""Online estimates of what a step costs, from the steps that ran.

- ``MedianEstimator``: the median of the last ``window`` samples once ``min_samples``
  are in (the sampler's time per step, the drafter's).
- ``ForwardTimeEstimator``: the target forward's time as ``baseline + slope x tokens``.
  Samples (the step's tokens, prefill ones included, and its forward time) are kept in a
  window and grouped by graph size (the CUDA graph bucket a decode step of that many
  rows replays; on the CPU the same power-of-two groups); each group gives a point
  (median tokens, median time), so an outlier step moves nothing. ``fit`` is one line
  through all points: the slope the median of the slopes between every two (Theil-Sen),
  the baseline the median of ``time - slope x tokens``. ``time`` is local: the line
  through the two points on either side of the step's size (past the last point, the
  last two; slopes never below 0), since a forward is flat while it reads weights and
  climbs once its matmuls are compute-bound, and one line through both regimes would
  price a large verify step at the slope of small ones. It is ready once two groups
  have enough samples.
- ``StepCostModel``: the three together, ``time(tokens)`` of a whole step.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

from engine.cuda_graphs import DEFAULT_BUCKETS


class MedianEstimator:
    """The median of the most recent samples."""

    def __init__(self, window: int = 9, min_samples: int = 5) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples

    def add(self, value: float) -> None:
        self._samples.append(value)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def value(self, default: float = 0.0) -> float:
        return statistics.median(self._samples) if self.ready else default


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


class ForwardTimeEstimator:
    """Forward time = baseline + slope x tokens (module docstring)."""

    def __init__(self, window: int = 5000, min_group: int = 3) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_group = min_group
        self._fit: tuple[float, float] | None = None
        self._points: list[tuple[float, float]] = []  # per group: median tokens, median time
        self._stale = True

    def add(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))
        self._stale = True

    @property
    def ready(self) -> bool:
        return self.fit() is not None

    def fit(self) -> tuple[float, float] | None:
        """(baseline, slope) in seconds and seconds per token; None until two groups
        have ``min_group`` samples each."""
        if not self._stale:
            return self._fit
        groups: dict[int, list[tuple[int, float]]] = {}
        for tokens, seconds in self._samples:
            groups.setdefault(graph_size(tokens), []).append((tokens, seconds))
        points = sorted(
            (statistics.median(t for t, _ in g), statistics.median(s for _, s in g))
            for g in groups.values()
            if len(g) >= self.min_group
        )
        self._points = points
        self._fit = None
        if len(points) >= 2:
            slopes = [
                (s2 - s1) / (t2 - t1)
                for i, (t1, s1) in enumerate(points)
                for t2, s2 in points[i + 1 :]
                if t2 > t1
            ]
            if slopes:
                slope = max(statistics.median(slopes), 0.0)
                baseline = max(statistics.median(s - slope * t for t, s in points), 0.0)
                self._fit = (baseline, slope)
        self._stale = False
        return self._fit

    def time(self, tokens: int) -> float:
        """Seconds for a forward of ``tokens`` tokens, from the two nearest points."""
        if self.fit() is None:
            raise RuntimeError("the forward time estimator has too few samples")
        points = self._points
        i = bisect.bisect_left([t for t, _ in points], tokens, 1, len(points) - 1)
        (t1, s1), (t2, s2) = points[i - 1], points[i]
        slope = max((s2 - s1) / (t2 - t1), 0.0) if t2 > t1 else 0.0
        return max(s1 + slope * (tokens - t1), 0.0)


class StepCostModel:
    """Seconds one step takes: the forward of its tokens, then sampling, then drafting."""

    def __init__(self) -> None:
        self.forward = ForwardTimeEstimator()
        self.sampler = MedianEstimator()
        self.drafter = MedianEstimator()

    def add(self, tokens: int, forward_s: float, sample_s: float, draft_s: float) -> None:
        self.forward.add(tokens, forward_s)
        self.sampler.add(sample_s)
        self.drafter.add(draft_s)

    @property
    def ready(self) -> bool:
        return self.forward.ready and self.sampler.ready

    def time(self, tokens: int) -> float:
        return self.forward.time(tokens) + self.sampler.value() + self.drafter.value()
