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
  (``MAX_GAP_FACTOR``: the process stalled), nor a stall of the host: a step whose wall
  time is ``STALL_FACTOR`` times what its device time took in the mode's latest steps of
  the regime, where the step after it is of the same regime (before a step with prefill
  a late outcome is the host launching that step, a cost of its own), and the step after
  it, which ran during the stall (on an H100 at 256 streams, one 42 ms interval among
  17 ms steps took the pairs' median gain of drafts that paid 7-15 % under 0, and the
  guard blocked them for the 40 % of the run left); and neither is a step next to a switch
  between verifying and not: the first after it carries the other mode's overlap state
  (the plan a step with drafts leaves unhidden, the overlap one without builds up), and
  the last before it the host's work on the step after it, of the other mode (under
  overlap the host plans and launches the next step before this one's outcome is read).
  Counted, on a host slow enough that a verify step's planning and launch outlast the
  device's step, the last step without drafts before drafts took 20 ms where the others
  took 7, the first with drafts after them looked fast, and the guard let drafts run
  that cost a third of the rate (``bench.spec_decode_sim`` with 3x its host times, 128
  streams). So a step becomes a sample once the next one runs in the same mode.
- Samples are kept per *regime*: the step's graph size of sampling chunks (its batch)
  and whether it holds prefill.
- The decision, per regime, compares the modes *side by side*: where a run of steps of
  one mode gives way to the other (a probe, the policy's own choice), the last
  ``PAIR_SAMPLES`` samples before the switch and the first ``PAIR_SAMPLES`` after make
  one *pair*, whose gain is the log of the drafts' rate over the other's. Once a regime
  has ``GUARD_MIN_PAIRS`` pairs, speculation is allowed iff the median gain of its last
  ``PAIRS_KEPT`` is at least 0; before that the policy decides alone. Side by side, a
  slow spell of the host or longer contexts late in a wave weigh on both modes alike:
  compared as each mode's own window (its latest samples, whenever they were taken), a
  spell of ~15 slow steps on the H200 at 128 streams of the 8B shape, all of them
  verifying drafts, put the drafts' window under the rate steps without drafts had
  reached before it, and the guard blocked drafts that paid 7 % for the rest of the run
  (their mode, no longer run, was never measured again but for a probe in 256 steps).
- A *ceiling* on the rate without drafts: every step without drafts (a switch too, or one
  after the engine idled) gives its tokens and its device time (``record_device``); a
  step's wall time is never below its device time, so those tokens over those seconds
  are the most that mode can reach in the regime. Speculation measured ``DECISIVE_RATIO``
  above the ceiling (its last ``GUARD_WINDOW`` samples) is ahead without a pair.
- A probe without drafts is a rest of the drafter after its first step
  (``SpecDecoding``: nothing drafted or priced), so that its steps cost what steps
  without speculation cost, the host's work included.
- Probes make the pairs: every ``PROBE_EVERY`` steps of a regime (every
  ``WARM_PROBE_EVERY`` while it has too few pairs; ``DECISIVE_SPACING`` times rarer while
  one mode is ahead by ``DECISIVE_RATIO``, where a probe costs the most and tells the
  least — speculation ahead of the ceiling counts, pairs or not) the mode not favoured
  runs for ``PROBE_STEPS`` steps (the first of which, a switch, is not a sample): no
  drafts while speculation is favoured, the policy's choice while it is not. A probe
  makes two pairs (into it and out of it). So at most ``PROBE_STEPS / WARM_PROBE_EVERY``
  of the steps are probes while a regime warms up and ``PROBE_STEPS / PROBE_EVERY`` after;
  where drafts win by far (small batches), a regime warms up with no probe. A probe also
  falls due early (not within ``WARM_PROBE_EVERY`` steps of the last) when the latest
  ``PAIR_SAMPLES`` samples of the mode that runs fall ``EARLY_MARGIN`` under the other
  mode's rate in the latest pair, where neither mode is ahead by ``DECISIVE_RATIO``
  (without the margin, the noise of steps of two modes about as fast as each other
  called a probe every few steps): what runs may have
  changed (the policy verifying more drafts than when the pair was made) or the host
  slowed down; a pair made now says which.
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

import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.spec.cost import graph_size

PROBE_EVERY = 64  # steps of a regime between two probes once both modes are measured
DECISIVE_RATIO = 1.25  # a mode ahead by this ratio is probed against DECISIVE_SPACING x rarer
DECISIVE_SPACING = 4
WARM_PROBE_EVERY = 8  # ... while a mode has fewer than GUARD_MIN_SAMPLES samples
PROBE_STEPS = 3  # steps a probe runs (its first one is a switch: not a sample)
GUARD_WINDOW = 32  # samples kept per regime and mode (the drafts' rate against the ceiling)
GUARD_MIN_SAMPLES = 4  # ... before that rate counts
PAIR_SAMPLES = 4  # samples on either side of a switch that one pair compares
PAIRS_KEPT = 8  # pairs per regime the decision takes the median of
GUARD_MIN_PAIRS = 3  # pairs before the guard decides
EARLY_MARGIN = 0.05  # how far under the other mode's rate a run falls before an early probe
MAX_GAP_FACTOR = 20.0  # an interval past this many times the step's device time: a stall
STALL_FACTOR = 2.0  # ... past this many times the mode's usual interval for its device time
STALL_RATIOS = 16  # per regime and mode, the latest intervals over device times kept for that


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
    mode: bool | None = None  # the mode of the latest samples (the current run)
    tail: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PAIR_SAMPLES))
    # the run before the latest switch: its mode and its last samples' rate, until the
    # samples after the switch complete the pair
    before: tuple[bool, float] | None = None
    after: int = 0  # samples of the current run in that pair so far
    gains: deque[float] = field(default_factory=lambda: deque(maxlen=PAIRS_KEPT))
    steps: int = 0
    probe_left: int = 0
    probe_mode: bool = False
    due: bool = False  # a probe fell due on a step the guard was not asked about (``tick``)
    # or early: the current run fell under the other mode's rate in the latest pair
    paired: dict[bool, float] = field(default_factory=dict)  # each mode's rate there
    probed: int = 0  # ``steps`` when the latest probe began
    device: _Window = field(default_factory=_Window)
    # a step without drafts outside the probes gave the ceiling a sample since the latest
    # probe fell due (``_ceiling_decides``)
    fresh: bool = False
    # per mode, the latest samples' intervals over their device times (``_stalled``)
    ratios: dict[bool, deque[float]] = field(default_factory=lambda: {
        False: deque(maxlen=STALL_RATIOS), True: deque(maxlen=STALL_RATIOS)})  # fmt: skip


class RealizedGainGuard:
    """Whether the policy's drafts may run this step (module docstring)."""

    def __init__(self) -> None:
        self._regimes: dict[tuple[int, bool], _Regime] = {}
        self._last_mode: bool | None = None
        # the latest step's (regime, mode, tokens, seconds, device seconds), a sample once
        # the step after it runs in the same mode (``record``)
        self._pending: tuple[tuple[int, bool], bool, int, float, float] | None = None
        self.stalls = 0  # steps that were no sample: the host stalled (``record``)
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
        """Realized tokens per second of a mode in a regime, its last ``GUARD_WINDOW``
        samples (None: too few samples)."""
        r = self._regimes.get(key)
        if r is None or len(r.samples[speculated]) < GUARD_MIN_SAMPLES:
            return None
        return r.samples[speculated].rate()

    def ceiling(self, key: tuple[int, bool]) -> float | None:
        """The most tokens per second steps without drafts can reach in a regime: their
        tokens over their device time (None: no such step yet)."""
        r = self._regimes.get(key)
        return None if r is None else r.device.rate()

    def gain(self, key: tuple[int, bool]) -> float | None:
        """The median log of the drafts' rate over the other mode's, side by side (None:
        fewer than ``GUARD_MIN_PAIRS`` pairs)."""
        r = self._regimes.get(key)
        if r is None or len(r.gains) < GUARD_MIN_PAIRS:
            return None
        return statistics.median(r.gains)

    def favours(self, key: tuple[int, bool]) -> bool:
        """Whether speculation is allowed outside probes (True until the regime has its
        pairs)."""
        gain = self.gain(key)
        return gain is None or gain >= 0.0

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
        if (r.steps % every == 0 or r.due) and not (favoured and self._ceiling_decides(key)):
            r.due = False
            r.probe_mode, r.probe_left = not favoured, PROBE_STEPS - 1
            r.probed = r.steps
            self.probes += 1
            return r.probe_mode
        if not favoured:
            self.blocked += 1
        return favoured

    def _ceiling_decides(self, key: tuple[int, bool]) -> bool:
        """Whether a probe without drafts falling due now would tell nothing: speculation
        is ``DECISIVE_RATIO`` above the ceiling, and steps without drafts of their own
        (a request's first, the policy's) measured it since the probe before fell due.
        Each time it decides, the next one needs such a step again; where none comes,
        the probes refresh the ceiling at their rate. (At one stream on an H100 the probes
        and the rests after them were 15 steps a point without drafts, where a step with
        drafts yields 2.7 tokens: 1 % of the point.)"""
        r = self._get(key)
        spec, ceiling = self.rate(key, True), self.ceiling(key)
        decides = (r.fresh and spec is not None and ceiling is not None
                   and spec >= DECISIVE_RATIO * ceiling)  # fmt: skip
        r.fresh = False
        r.due &= not decides  # an early probe it answers is answered too, not put off a step
        return decides

    def rest_probe(self, key: tuple[int, bool]) -> int:
        """The probe without drafts that ``allow`` just began: the steps it has left,
        which the caller runs as a rest of the drafter (no drafts proposed, none priced),
        and which the guard no longer counts down itself (0: no such probe)."""
        r = self._get(key)
        left = 0 if r.probe_mode else r.probe_left
        r.probe_left -= left
        r.steps += left
        self.probes += left
        return left

    def _every(self, key: tuple[int, bool]) -> int:
        gain = self.gain(key)
        if gain is None:
            spec, ceiling = self.rate(key, True), self.ceiling(key)
            if spec is not None and ceiling is not None and spec >= DECISIVE_RATIO * ceiling:
                return PROBE_EVERY * DECISIVE_SPACING  # ahead of the best no drafts can do
            return WARM_PROBE_EVERY
        if abs(gain) >= math.log(DECISIVE_RATIO):
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
               seconds: float, device: float = 0.0) -> None:  # fmt: skip
        """A step of this regime yielded ``tokens`` in ``seconds`` of wall time
        (``device``: of device time, 0 unknown). It is a sample once the next step is
        recorded in the same mode: a step next to a switch is none, nor a stall and the
        step after it (module docstring)."""
        pending, self._pending = self._pending, None
        stalled = False
        if pending is not None and pending[1] == speculated:
            regime, _, _, wall, on_device = pending
            stalled = regime == key and self._stalled(key, speculated, wall, on_device)
            if stalled:
                self.stalls += 1
            else:
                self._sample(*pending[:4])
        switched = self._last_mode is not None and speculated != self._last_mode
        self._last_mode = speculated
        if not (switched or stalled) and seconds > 0:
            self._pending = (key, speculated, tokens, seconds, device)

    def _stalled(self, key: tuple[int, bool], speculated: bool, seconds: float,
                 device: float) -> bool:  # fmt: skip
        """Whether a step's wall time is a stall of the host: ``STALL_FACTOR`` times what
        its device time takes in the mode's latest steps of the regime (at least its
        device time; none before ``GUARD_MIN_SAMPLES`` of them)."""
        if device <= 0:
            return False
        ratios = self._get(key).ratios[speculated]
        usual = max(statistics.median(ratios), 1.0) if len(ratios) >= GUARD_MIN_SAMPLES else None
        ratios.append(seconds / device)
        return usual is not None and seconds > STALL_FACTOR * usual * device

    def _sample(self, key: tuple[int, bool], speculated: bool, tokens: int,
                seconds: float) -> None:  # fmt: skip
        r = self._get(key)
        r.samples[speculated].append(tokens, seconds)
        if r.mode is not None and speculated != r.mode:  # the other mode, side by side
            if r.before is not None and r.after:  # a short run: its pair as it stands
                self._pair(r)
            r.before = (r.mode, _rate(r.tail))
            r.tail.clear()
            r.after = 0
        r.mode = speculated
        r.tail.append((tokens, seconds))
        if r.before is not None:
            r.after += 1
            if r.after >= PAIR_SAMPLES:
                self._pair(r)
        elif (len(r.tail) == PAIR_SAMPLES and not r.probe_left
              and r.steps - r.probed >= WARM_PROBE_EVERY):  # fmt: skip
            gain, other = self.gain(key), r.paired.get(not speculated)
            if (gain is not None and abs(gain) < math.log(DECISIVE_RATIO) and other is not None
                    and _rate(r.tail) * (1.0 + EARLY_MARGIN) < other):  # fmt: skip
                r.due = True  # under the other mode's latest rate: a pair now tells

    @staticmethod
    def _pair(r: _Regime) -> None:
        """The samples before the latest switch against those after it: one gain."""
        assert r.before is not None
        mode, rate = r.before
        rates = {mode: rate, not mode: _rate(list(r.tail)[-r.after :])}
        if rates[False] > 0 and rates[True] > 0:
            r.gains.append(math.log(rates[True] / rates[False]))
            r.paired = rates
        r.before, r.after = None, 0

    def record_device(self, key: tuple[int, bool], tokens: int, seconds: float) -> None:
        """A step of this regime without drafts yielded ``tokens`` in ``seconds`` of
        device time (``ceiling``)."""
        if seconds > 0:
            r = self._get(key)
            r.device.append(tokens, seconds)
            r.fresh |= r.steps - r.probed >= PROBE_STEPS  # not one of a probe's steps


def _rate(samples: Iterable[tuple[int, float]]) -> float:
    """Tokens over seconds of (tokens, seconds) samples, every second positive."""
    tokens = seconds = 0.0
    for t, sec in samples:
        tokens += t
        seconds += sec
    return tokens / seconds
