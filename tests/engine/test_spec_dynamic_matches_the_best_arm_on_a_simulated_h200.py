"""The dynamic verify length against no speculation and every fixed k, on the engine's
own scheduler and ``SpecDecoding`` driven as ``EngineCore`` drives them under overlap,
with step costs fitted to the H200 run (``bench.spec_decode_sim``).

At small batch (1 and 16 requests, decode-heavy and prefill-heavy) speculating nearly
every step with 3-5 drafts is best, at 64 one to three drafts a request: dynamic must
reach 0.98 of the best arm (at 64 decode streams 0.99 of fixed-3 over seeds 0-2 of the
drafter's draws, and over 4x the requests too, since drafts go two past what a request
verifies: one past, it stayed at one draft a request, 0.92-0.95 over 4x the requests).
At high load (128 and 256) no fixed k gains much over none, most lose: dynamic must
reach 0.98 of none. The points of 1 and 16 hold 4x the benchmark's requests (64 and 256 decode
requests), so that the acceptance draws of the arms average out.
"""

from __future__ import annotations

import pytest

from bench.spec_decode_sim import H200Costs, run

SMALL, HIGH = (1, 16, 64), (128, 256)
ARMS = ("none", "fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5", "dynamic")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return run(SMALL + HIGH, ("decode", "prefill-heavy"),
               scale=lambda c: 4 if c < 64 else 1,
               arms_at=lambda c: ARMS if c in SMALL else ("none", "dynamic"))  # fmt: skip


def _point(records: list[dict], workload: str, c: int) -> dict[str, float]:
    return {r["arm"]: r["tok_s"] for r in records
            if (r["workload"], r["concurrency"]) == (workload, c)}  # fmt: skip


@pytest.mark.parametrize("workload", ["decode", "prefill-heavy"])
@pytest.mark.parametrize("c", SMALL)
def test_dynamic_keeps_up_with_the_best_fixed_k_at_small_batch(records, workload, c):
    point = _point(records, workload, c)
    best = max(v for arm, v in point.items() if arm != "dynamic")
    assert point["dynamic"] >= 0.98 * best, point


@pytest.mark.parametrize("workload", ["decode", "prefill-heavy"])
@pytest.mark.parametrize("c", HIGH)
def test_dynamic_ties_no_speculation_at_high_load(records, workload, c):
    point = _point(records, workload, c)
    assert point["dynamic"] >= 0.98 * point["none"], point


@pytest.mark.parametrize("spell", [(40, 17), (80, 12), (120, 17)])
def test_a_slow_spell_of_the_host_costs_dynamic_no_more_than_its_steps(spell):
    """At 128 decode streams a draft a request pays (fixed-1 over none ~7 %). A slow spell
    of the host (``SimEngine.slow``: 2x its times, 1.35x the device's) while dynamic
    verifies every step left it verifying nothing for the rest of the H200's run (here,
    before the fix, 0.94-0.96 of fixed-1); it must keep up with fixed-1 meeting the
    same spell, within what a spell moves a choice between two sizes a few percent
    apart (1.017, 0.9746 and 0.986 of fixed-1 at these spells; the bound was 0.975 while
    the graphs had a 448-row bucket)."""
    records = run((128,), ("decode",), arms=("none", "fixed-1", "dynamic"), spells=[spell])
    point = _point(records, "decode", 128)
    assert point["dynamic"] >= 0.97 * max(point["none"], point["fixed-1"]), point


def test_dynamic_stays_near_no_speculation_where_the_hosts_work_makes_drafts_lose():
    """On a host twice as slow (``H200Costs.host_times(2)``) a verify step's planning and
    launch outlast the device's step at 128 decode streams: fixed-1 falls to ~0.93 of
    none. Dynamic must stay within 0.96 of none (0.97-0.98 over seeds 0-2; 0.90 while the
    guard counted the steps next to a switch of mode, whose wall time holds the other
    mode's host work, and its probes without drafts still drafted and priced; 0.95-0.97
    while the policy priced a step by its device time alone)."""
    records = run((128,), ("decode",), arms=("none", "fixed-1", "dynamic"),
                  costs=H200Costs().host_times(2.0))  # fmt: skip
    point = _point(records, "decode", 128)
    assert point["fixed-1"] < 0.95 * point["none"], point  # drafts lose here
    assert point["dynamic"] >= 0.96 * point["none"], point


def test_on_the_h100_dynamic_keeps_up_with_a_draft_a_request_at_256_streams():
    """On the H100 a draft a request pays at 256 decode streams (fixed-1 ~6 % over none:
    a 512-row step costs 1.63x a 256-row one, not the H200's 1.76x). Coming from 128
    streams of prefill-heavy, whose verdicts rest the drafter, dynamic explored 320 rows
    (64 drafts: 0.2 % over none), then priced 384 along the line through 256 and 320 at
    24.3 tok/ms, under none's 23.8 raised by the margin, and verified nothing for the rest
    of the point (0.94x fixed-1 over seeds 0, 2, 3; 0.98-1.00x since: exploring asks
    half the margin)."""
    from bench.spec_decode_sim import H100_COSTS

    records = run((128, 256), ("decode", "prefill-heavy"), costs=H100_COSTS,
                  arms=("none", "fixed-1", "dynamic"))  # fmt: skip
    point = _point(records, "decode", 256)
    assert point["fixed-1"] > 1.04 * point["none"], point  # drafts pay here
    assert point["dynamic"] >= 0.98 * point["fixed-1"], point
