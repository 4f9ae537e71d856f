"""A serving process's heaps: the C heap trimmed when idle, the objects of its startup
frozen out of the garbage collector's way, the collector's pauses counted.

Freezing. Everything a process creates while it starts — the imported modules, the
model's modules and tensors, the tokenizer, the KV block pool, the compiled kernels —
lives as long as the process, yet every collection of the oldest generation walks all of
it, stopping the process meanwhile: ~300k objects and 105 ms a collection on this
engine's CPU worker with the default model, longer than a decode step. Such a collection
comes whenever the objects that outlived the young generations have grown by a quarter of
the old generation, and stalls one step for every request in it (one decode step of 64
streams ran 198 ms instead of 6 on an H200, most likely that). ``freeze_startup``
collects once and moves what survives to the permanent generation (``gc.freeze``): later
collections walk only what came after.

Pauses. ``GcPauses`` times every collection (``gc.callbacks``) by generation: the counts,
the seconds, the longest pause (``GcStats``, the workers' stats and the frontend's
metrics carry them), and a line when a pause passes ``NOTED_PAUSE_S`` — a warning from
``SLOW_PAUSE_S`` — at most one a minute with how many since (said by ``report``, outside
the collector).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable

from engine.messages import GcStats

log = logging.getLogger("ferry.heap")

# A pause is said from NOTED_PAUSE_S, longer than a decode step (~5-20 ms), at debug level:
# the first requests a process serves make one to three of those, full collections that
# walk what those requests created after the startup was frozen (modules imported on first
# use, the chat template compiled, the OpenAPI schema): 13-59 ms in the frontend on two
# CPU cores. They are expected, come once, and are nothing an operator can act on; the
# metrics keep every pause (ferry_gc_longest_pause_seconds). From SLOW_PAUSE_S a pause is
# a warning: every stream stalls for a gap a client sees (ten decode steps on a GPU,
# several of the default model on the CPU), which no warm-up explains.
NOTED_PAUSE_S = 0.05
SLOW_PAUSE_S = 0.2
SLOW_EVERY_S = 60.0  # at most one such line a minute


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries lack it
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def trim() -> None:
    """Give the C heap's free pages back to the system, once a worker goes idle: a burst
    of prefill leaves hundreds of MB of freed activations in glibc's heap, resident until
    the next burst (on the default CPU model the prefill worker grew from 0.5 to 1.1 GB
    over a benchmark; trimmed, it stays near its size after load). A few ms, idle."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_FROZEN = 0  # objects frozen by freeze_startup (gc.get_freeze_count walks them all)


def freeze_startup() -> int:
    """Collect once, then move every object left to the permanent generation, out of
    later collections' walk (module docstring); returns how many are frozen. Call it
    once the process has started (its engine built and warmed up), before it serves."""
    global _FROZEN
    gc.collect()
    gc.freeze()
    _FROZEN = gc.get_freeze_count()
    return _FROZEN


def frozen() -> int:
    """How many objects ``freeze_startup`` froze, as it counted them then: asking the
    collector again (``gc.get_freeze_count``) walks every one of them, ~15 ms for 370k,
    too dear for the per-step stats that carry it."""
    return _FROZEN


class GcPauses:
    """The collector's pauses in this process, by generation (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started = 0.0
        self._slow: list[tuple[float, int]] = []  # (seconds, generation) not yet said
        self._said = -SLOW_EVERY_S

    def install(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # runs inside the collector: counts only, no allocation worth a collection
        if phase == "start":
            self._started = self.clock()
            return
        seconds = self.clock() - self._started
        generation = min(int(info.get("generation", 2)), 2)
        self.record(generation, seconds)

    def record(self, generation: int, seconds: float) -> None:
        self.collections[generation] += 1
        self.pause_s[generation] += seconds
        self.longest_s = max(self.longest_s, seconds)
        if seconds > NOTED_PAUSE_S:
            self._slow.append((seconds, generation))

    def report(self) -> None:
        """Say the long pauses since the last line, if a minute has passed since it: a
        warning when one reached ``SLOW_PAUSE_S``, else at debug level."""
        if not self._slow or self.clock() - self._said < SLOW_EVERY_S:
            return
        slow, self._slow = self._slow, []
        seconds, generation = max(slow)
        self._said = self.clock()
        level = logging.WARNING if seconds >= SLOW_PAUSE_S else logging.DEBUG
        if not log.isEnabledFor(level):
            return  # counting the tracked objects walks them all
        more = ""
        if len(slow) > 1:
            more = f"; {len(slow) - 1} more over {NOTED_PAUSE_S * 1e3:.0f} ms since the last line"
        log.log(level, "garbage collection paused this process %.0f ms (generation %d, %d "
                "objects tracked, %d frozen)%s", seconds * 1e3, generation,
                len(gc.get_objects()), frozen(), more)  # fmt: skip

    def snapshot(self) -> GcStats:
        """The figures so far (and the slow pauses said, ``report``)."""
        self.report()
        return GcStats(tuple(self.collections), tuple(self.pause_s), self.longest_s,
                       frozen())  # fmt: skip


_PAUSES: GcPauses | None = None


def pauses() -> GcPauses:
    """This process's ``GcPauses``, installed on first use."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses().install()
    return _PAUSES
