"""The process heap helpers (``engine.heap``): freezing the startup's objects out of the
collector's walk, and counting (and saying) the collector's pauses."""

from __future__ import annotations

import gc
import logging

import pytest

from engine import heap


@pytest.fixture
def unfrozen():
    """A test that freezes gives the objects back to the collector afterwards (the rest of
    the session collects as it did)."""
    yield
    gc.unfreeze()


def test_freezing_the_startup_moves_its_objects_out_of_the_oldest_generation(unfrozen):
    startup = [[i] for i in range(50_000)]  # long-lived, tracked objects
    gc.collect()
    assert len(gc.get_objects(generation=2)) > 50_000
    frozen = heap.freeze_startup()
    assert frozen >= 50_000 and gc.get_freeze_count() == frozen
    assert len(gc.get_objects(generation=2)) < 1_000  # what a full collection still walks
    later = [[i] for i in range(1_000)]
    gc.collect()
    assert len(gc.get_objects(generation=2)) >= 1_000  # what came after is collected as before
    assert startup[-1] == [49_999] and later[-1] == [999]


def test_the_stats_carry_the_frozen_count_without_walking_the_frozen_objects(
    unfrozen, monkeypatch
):
    # gc.get_freeze_count walks the permanent generation: asked at every step's stats it
    # cost ~15 ms a step once 370k objects were frozen (decode ran 5x slower served)
    frozen = heap.freeze_startup()
    monkeypatch.setattr(gc, "get_freeze_count", lambda: pytest.fail("walked the frozen"))
    assert heap.GcPauses().snapshot().frozen == frozen == heap.frozen()


def test_every_collection_is_counted_by_generation_with_its_pause():
    pauses = heap.GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    stats = pauses.snapshot()
    assert stats.collections[0] >= 1 and stats.collections[2] >= 1
    assert stats.pause_s[2] > 0 and stats.longest_s >= stats.pause_s[2] / stats.collections[2]
    before = stats.collections[2]
    gc.collect(2)  # uninstalled: no longer counted
    assert pauses.snapshot().collections[2] == before


def test_a_slow_pause_is_said_once_a_minute_with_how_many_more(caplog):
    now = [1000.0]
    pauses = heap.GcPauses(clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="ferry.heap")
    pauses.record(2, 0.01)  # fast: nothing to say
    pauses.report()
    assert not caplog.records
    pauses.record(2, 0.2)
    pauses.record(1, 0.08)
    pauses.report()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "paused this process 200 ms (generation 2" in line and "1 more over 50 ms" in line
    pauses.record(2, 0.3)
    now[0] += 30
    pauses.report()  # within the minute: kept for the next line
    assert len(caplog.records) == 1
    now[0] += 31
    pauses.report()
    assert len(caplog.records) == 2 and "300 ms" in caplog.records[-1].getMessage()
    assert pauses.snapshot().collections == (0, 1, 3)


def test_a_pause_of_the_first_requests_is_said_at_debug_level_not_as_a_warning(caplog):
    # the first requests of a process make a full collection or three of what they created
    # after the freeze: 13-59 ms in the frontend on two CPU cores, expected and once
    now = [1000.0]
    pauses = heap.GcPauses(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="ferry.heap")
    pauses.record(2, 0.059)
    pauses.record(2, 0.013)  # not long enough to count at all
    pauses.report()
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and "paused this process 59 ms" in record.getMessage()
    now[0] += 61
    pauses.record(2, heap.SLOW_PAUSE_S)
    pauses.report()
    assert caplog.records[-1].levelno == logging.WARNING
