"""The realized-gain guard: speculation stays on only while it measurably pays.

The dynamic policy decides from a model (acceptance estimates, step costs); a model can be
wrong in ways it cannot see: a drafter more confident than it is right, a cost the step
timings miss (host work, overlap lost, a kernel path never measured). The guard measures
what the model predicts, the tokens per second the engine gets, for steps that verified
drafts and steps that did not, and turns speculation off where it gets fewer.

- A step's *realized rate* is the tokens it yielded (one per sampling chunk plus the drafts
  kept) over the wall time from the previous step's outcome to its own
  (``SpecDecoding.observe``): under overlap scheduling that is what the step occupied,
  host waits included. A step without drafts is timed as it would run without
  speculation, the drafter resting: less the drafter's time after it (never below its
  device time; a probe's proposals are for the steps after it, and at high load they
  cost more than the step saves, so that counted they would make the mode look slower
  than it is). The interval after the engine ran out of work is not a sample
  (``SpecDecoding.idle``), nor one far longer than the step's device time
  (``MAX_GAP_FACTOR``: the process stalled), and neither is the
  first step after a switch between verifying and not (it carries the other mode's
  overlap state: the plan a step with drafts leaves unhidden, the overlap one without
  builds up).
- Samples are kept per *regime*: the step's graph size of sampling chunks (its batch)
  and whether it holds prefill; per regime and mode, the last ``GUARD_WINDOW`` samples,
  whose rate is their tokens over their seconds.
- The decision, per regime: once both modes have ``GUARD_MIN_SAMPLES``, speculation is
  allowed iff its rate is at least the other's; before that the policy decides alone.
- A *ceiling* on the rate without drafts: every step without drafts (a switch too, or one
  after the engine idled) gives its tokens and its device time (``record_device``); a
  step's wall time is never below its device time, so those tokens over those seconds
  are the most that mode can reach in the regime. Speculation measured ``DECISIVE_RATIO``
  above the ceiling is ahead without a sample of the other mode.
- Probes keep both measured: every ``PROBE_EVERY`` steps of a regime (every
  ``WARM_PROBE_EVERY`` while a mode lacks samples; ``DECISIVE_SPACING`` times rarer while
  one mode is ahead by ``DECISIVE_RATIO``, where a probe costs the most and tells the
  least — speculation ahead of the ceiling counts, samples or not) the mode not favoured
  runs for ``PROBE_STEPS`` steps (the first of which, a switch, is not a sample): no
  drafts while speculation is favoured, the policy's choice while it is not. So at most
  ``PROBE_STEPS / WARM_PROBE_EVERY`` of the steps are probes while a regime warms up and
  ``PROBE_STEPS / PROBE_EVERY`` after; where drafts win by far (small batches), a regime
  warms up with no probe.
- While speculation is favoured, the guard is asked (``allow``) only about steps the
  policy verifies drafts in: a step it verifies none in runs without drafts anyway (a
  sample of that mode, no probe needed), so it neither counts towards a probe nor is one;
  a regime where the policy never verifies drafts has no probes at all. While it is not
  favoured, every step of the regime counts: those the drafter rests in
  (``SpecDecoding.proposes``) through ``tick``, which says when a probe falls due.

It is a two-armed bandit with forced exploration at a fixed small rate; it does not
choose *how many* drafts (the policy does), only whether the policy's choice may run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.spec.cost import graph_size

PROBE_EVERY = 64  # steps of a regime between two probes once both modes are measured
DECISIVE_RATIO = 1.25  # a mode ahead by this ratio is probed against DECISIVE_SPACING x rarer
DECISIVE_SPACING = 4
WARM_PROBE_EVERY = 8  # ... while a mode has fewer than GUARD_MIN_SAMPLES samples
PROBE_STEPS = 2  # steps a probe runs (its first one is a switch: not a sample)
GUARD_WINDOW = 32  # samples kept per regime and mode
GUARD_MIN_SAMPLES = 4  # samples of each mode before the guard decides
MAX_GAP_FACTOR = 20.0  # an interval past this many times the step's device time: a stall


class _Window:
    """The last ``GUARD_WINDOW`` (tokens, seconds) samples and their sums, kept as they
    come (the guard reads a regime's rates several times a step)."""

    __slots__ = ("samples", "tokens", "seconds")

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque()
        self.tokens, self.seconds = 0, 0.0

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(self.samples)

    def append(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        if len(self.samples) > GUARD_WINDOW:
            old_tokens, old_seconds = self.samples.popleft()
            self.tokens -= old_tokens
            self.seconds -= old_seconds

    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class _Regime:
    samples: dict[bool, _Window] = field(default_factory=lambda: {False: _Window(),
                                                                  True: _Window()})  # fmt: skip
    steps: int = 0
    probe_left: int = 0
    probe_mode: bool = False
    due: bool = False  # a probe fell due on a step the guard was not asked about (``tick``)
    device: _Window = field(default_factory=_Window)


class RealizedGainGuard:
    """Whether the policy's drafts may run this step (module docstring)."""

    def __init__(self) -> None:
        self._regimes: dict[tuple[int, bool], _Regime] = {}
        self._last_mode: bool | None = None
        self.blocked = 0  # steps the guard ran without drafts against the policy
        self.probes = 0  # probe steps run, either mode

    @staticmethod
    def regime(batch: int, prefill: bool) -> tuple[int, bool]:
        return graph_size(max(batch, 1)), prefill

    def _get(self, key: tuple[int, bool]) -> _Regime:
        r = self._regimes.get(key)
        if r is None:
            r = self._regimes[key] = _Regime()
        return r

    def rate(self, key: tuple[int, bool], speculated: bool) -> float | None:
        """Realized tokens per second of a mode in a regime (None: too few samples)."""
        r = self._regimes.get(key)
        if r is None or len(r.samples[speculated]) < GUARD_MIN_SAMPLES:
            return None
        return r.samples[speculated].rate()

    def ceiling(self, key: tuple[int, bool]) -> float | None:
        """The most tokens per second steps without drafts can reach in a regime: their
        tokens over their device time (None: no such step yet)."""
        r = self._regimes.get(key)
        return None if r is None else r.device.rate()

    def favours(self, key: tuple[int, bool]) -> bool:
        """Whether speculation is allowed outside probes (True until both modes are
        measured)."""
        spec, plain = self.rate(key, True), self.rate(key, False)
        return spec is None or plain is None or spec >= plain

    def allow(self, key: tuple[int, bool]) -> bool:
        """Whether the step being planned may verify the policy's drafts."""
        r = self._get(key)
        r.steps += 1
        if r.probe_left > 0:
            r.probe_left -= 1
            self.probes += 1
            return r.probe_mode
        favoured = self.favours(key)
        every = self._every(key)
        if r.steps % every == 0 or r.due:
            r.due = False
            r.probe_mode, r.probe_left = not favoured, PROBE_STEPS - 1
            self.probes += 1
            return r.probe_mode
        if not favoured:
            self.blocked += 1
        return favoured

    def _every(self, key: tuple[int, bool]) -> int:
        spec, plain = self.rate(key, True), self.rate(key, False)
        if spec is not None and plain is None:
            ceiling = self.ceiling(key)
            if ceiling is not None and spec >= DECISIVE_RATIO * ceiling:
                return PROBE_EVERY * DECISIVE_SPACING  # ahead of the best no drafts can do
        if spec is None or plain is None:
            return WARM_PROBE_EVERY
        if max(spec, plain) >= DECISIVE_RATIO * min(spec, plain):
            return PROBE_EVERY * DECISIVE_SPACING
        return PROBE_EVERY

    def tick(self, key: tuple[int, bool]) -> bool:
        """A step of this regime planned without asking (no drafts proposed for it, the
        guard having blocked them): it counts towards the next probe while speculation is
        not favoured. True when that probe is due, so drafts must be proposed again."""
        if self.favours(key):
            return False
        r = self._get(key)
        r.steps += 1
        if r.steps % self._every(key) == 0:
            r.due = True
        return r.due

    def record(self, key: tuple[int, bool], speculated: bool, tokens: int,
               seconds: float) -> None:  # fmt: skip
        """A step of this regime yielded ``tokens`` in ``seconds`` of wall time."""
        switched = self._last_mode is not None and speculated != self._last_mode
        self._last_mode = speculated
        if switched or seconds <= 0:
            return
        self._get(key).samples[speculated].append(tokens, seconds)

    def record_device(self, key: tuple[int, bool], tokens: int, seconds: float) -> None:
        """A step of this regime without drafts yielded ``tokens`` in ``seconds`` of
        device time (``ceiling``)."""
        if seconds > 0:
            self._get(key).device.append(tokens, seconds)
